"""One rule for how a front end (Booster, Lightning, HF Trainer) gets its plan: ``plan=``, else
``search=``, else ``placement_policy=``.

``placement_policy`` takes today's GeminiPlugin names:

- ``"static"``: the :func:`~elixir.search.minimum_waste_search` chunks, in order, with exactly the
  given fractions: the first ``shard_param_frac`` of the chunks sharded (the rest replicated), the
  first ``offload_param_frac`` keeping their shard in host memory, the first
  ``offload_optim_frac`` keeping fp32 master and optimizer state in host memory (fractions of the
  chunk count, rounded to the nearest chunk);

and those of the Lightning-era ColossalAI docs:

- ``"cuda"``: every shard and its optimizer state on the compute device (the CPU on a CPU-only
  box), padding minimised by :func:`~elixir.search.minimum_waste_search`;
- ``"cpu"``: the same chunks with shards and optimizer state in host memory;
- ``"auto"``: :func:`~elixir.search.optimal_search` picks chunk size, cache and placement from the
  machine's memory and hardware profile.

``search`` names a search directly (``"minimum_waste"`` or ``"optimal"``) or is a callable
``search(model, world_size, dtype) -> SearchResult``. ``plan`` is a ready
:class:`~elixir.search.SearchResult` or the path of a plan JSON (``elixir plan ... --out``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from elixir.plan import Placement, SearchResult, Sharding
from elixir.search.minimum_waste import minimum_waste_search, print_plan
from elixir.search.optimal import optimal_search

PLACEMENT_POLICIES = ("static", "auto", "cuda", "cpu")


@dataclass(frozen=True)
class StaticFractions:
    """The fractions of a ``"static"`` placement (GeminiPlugin's names), each in [0, 1].

    Attributes:
        shard_param_frac: share of the chunks split across ranks (ZeRO-3); the rest are replicated.
        offload_param_frac: share of the chunks whose compute shard lives in host memory; needs
            ``shard_param_frac == 1`` (a replicated chunk is not offloaded), as in GeminiPlugin.
        offload_optim_frac: share of the chunks whose fp32 master and optimizer state live in host
            memory.
    """

    shard_param_frac: float = 1.0
    offload_param_frac: float = 0.0
    offload_optim_frac: float = 0.0

    def __post_init__(self) -> None:
        for name in ("shard_param_frac", "offload_param_frac", "offload_optim_frac"):
            v = getattr(self, name)
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {v}")
        if self.offload_param_frac > 0 and self.shard_param_frac < 1:
            raise ValueError(
                "offload_param_frac > 0 needs shard_param_frac=1.0 (only sharded chunks offload their shard); "
                "raise shard_param_frac or set offload_param_frac=0"
            )


def _count(frac: float, n: int) -> int:
    return int(math.floor(frac * n + 0.5))


def apply_static(result: SearchResult, fractions: StaticFractions) -> SearchResult:
    """``result`` with its chunks placed by ``fractions``, chunks in order (see the module docstring)."""
    n = len(result.chunks)
    shard, off_p, off_o = (_count(f, n) for f in (fractions.shard_param_frac, fractions.offload_param_frac, fractions.offload_optim_frac))
    chunks = []
    for i, c in enumerate(result.chunks):
        sharded = i < shard and result.world_size > 1
        chunk_size = c.chunk_size
        if sharded and chunk_size % result.world_size:
            chunk_size += result.world_size - chunk_size % result.world_size
        chunks.append(
            dataclasses.replace(
                c,
                chunk_size=chunk_size,
                sharding=Sharding.SHARDED if sharded else Sharding.REPLICATED,
                shard_placement=Placement.HOST if i < off_p else Placement.DEVICE,
                optim_placement=Placement.HOST if i < off_o else Placement.DEVICE,
            )
        )
    return dataclasses.replace(result, chunks=tuple(chunks), search=f"{result.search}+static", prediction=None)
SEARCHES = ("minimum_waste", "optimal")

PlanArg = Optional[Union[SearchResult, str, os.PathLike]]
SearchArg = Optional[Union[str, Callable[[nn.Module, int, torch.dtype], SearchResult]]]


def check_plan_args(plan: PlanArg, search: SearchArg, placement_policy: str) -> None:
    """Reject contradictory or unknown arguments at construction, naming the fix."""
    if placement_policy not in PLACEMENT_POLICIES:
        raise ValueError(
            f"placement_policy must be one of {PLACEMENT_POLICIES}, got {placement_policy!r} "
            "(for disk placement, make a plan with `elixir plan --disk ...` and pass plan=)"
        )
    if plan is not None and search is not None:
        raise ValueError("give plan= or search=, not both (a plan is already the result of a search)")
    if isinstance(search, str) and search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES} or a callable, got {search!r}")
    if plan is not None and not isinstance(plan, (SearchResult, str, os.PathLike)):
        raise TypeError(f"plan must be a SearchResult or the path of a plan JSON, got {type(plan).__name__}")


def check_lossy_search(allow_lossy_state: bool, plan: PlanArg, search: SearchArg, placement_policy: str,
                       owner: str = "elixir", fix: str = "placement_policy='auto' or search='optimal'") -> None:
    """Refuse ``allow_lossy_state=True`` where no search would act on it: it lets
    :func:`~elixir.search.optimal_search` choose leaner state formats, and only ``search="optimal"``
    or ``placement_policy="auto"`` (no ``plan=``, no ``search=`` function) run that search here;
    ``minimum_waste_search`` keeps ``master``/``moments`` as given. Checked at construction."""
    if not isinstance(allow_lossy_state, bool):
        raise ValueError(f"{owner}: allow_lossy_state must be True or False, got {allow_lossy_state!r}")
    if not allow_lossy_state or search == "optimal" or (plan is None and search is None and placement_policy == "auto"):
        return
    source = ("the plan given (plan=)" if plan is not None else "the search= function" if callable(search)
              else "minimum_waste_search (" + (f"search={search!r}" if search else f"placement_policy={placement_policy!r}") + ")")
    raise ValueError(f"{owner}(allow_lossy_state=True) lets optimal_search choose leaner state formats, but this run's "
                     f"plan comes from {source}, which keeps master/moments as given: use {fix} (a ready plan: make "
                     "it with optimal_search(..., allow_lossy_state=True) or `elixir plan --allow-lossy-state`)")


def make_plan(
    model: nn.Module,
    world_size: int,
    dtype: torch.dtype,
    plan: PlanArg = None,
    search: SearchArg = None,
    placement_policy: str = "cuda",
    verbose: bool = False,
    fractions: Optional[StaticFractions] = None,
    pin_memory: Optional[bool] = None,
    accumulation: bool = False,
    formats: Optional[dict[str, Any]] = None,
) -> SearchResult:
    """The plan for ``model`` at ``world_size`` ranks computing in ``dtype`` (see the module
    docstring). ``pin_memory``: whether host-placed shards are page-locked, set on the plan
    whichever way it was made (None: the plan's own choice, pinned by default). ``accumulation``:
    the run accumulates under ``no_sync`` (``minimum_waste_search`` counts the blocks that holds).
    ``formats``: the state and frozen formats the run keeps (``master``, ``moments``, ``frozen``:
    ``MixedPrecisionPolicy``'s fields), which ``optimal_search`` prices and records."""
    result = _make_plan(model, world_size, dtype, plan, search, placement_policy, verbose, fractions, accumulation,
                        formats or {})
    if pin_memory is not None and result.info.get("pin_memory") is not bool(pin_memory):
        result = dataclasses.replace(result, info={**result.info, "pin_memory": bool(pin_memory)})
    return result


def _make_plan(model: nn.Module, world_size: int, dtype: torch.dtype, plan: PlanArg, search: SearchArg,
               placement_policy: str, verbose: bool, fractions: Optional[StaticFractions],
               accumulation: bool = False, formats: Optional[dict[str, Any]] = None) -> SearchResult:
    check_plan_args(plan, search, placement_policy)
    check_lossy_search(bool((formats or {}).get("allow_lossy_state", False)), plan, search, placement_policy)
    if plan is not None:
        result = plan if isinstance(plan, SearchResult) else SearchResult.load(plan)
        if result.world_size != world_size:
            raise ValueError(
                f"the plan is for world size {result.world_size}, this run has {world_size} ranks; "
                "re-plan for this world size (or pass search=/placement_policy= instead of plan=)"
            )
        return result
    if callable(search):
        result = search(model, world_size, dtype)
        if not isinstance(result, SearchResult):
            raise TypeError(f"search= returned {type(result).__name__}, expected a SearchResult")
        return result
    if search == "optimal" or (search is None and placement_policy == "auto"):
        return optimal_search(model, world_size, unified_dtype=dtype, verbose=verbose, **(formats or {}))
    if placement_policy == "static":
        base = minimum_waste_search(model, world_size, unified_dtype=dtype, accumulation=accumulation)
        result = apply_static(base, fractions or StaticFractions())
        if verbose:
            print_plan(result)
        return result
    if fractions is not None:
        raise ValueError(f"shard_param_frac/offload_*_frac apply to placement_policy='static', not {placement_policy!r}")
    return minimum_waste_search(model, world_size, unified_dtype=dtype, cpu_offload=placement_policy == "cpu",
                                verbose=verbose, accumulation=accumulation)
