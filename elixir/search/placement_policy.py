"""One rule for how an integration gets its plan: ``plan=``, else ``search=``, else ``placement_policy=``.

``placement_policy`` keeps the names of the Lightning-era ColossalAI docs:

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

import os
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from elixir.search import SearchResult, minimum_waste_search, optimal_search

PLACEMENT_POLICIES = ("cuda", "cpu", "auto")
SEARCHES = ("minimum_waste", "optimal")

PlanArg = Optional[Union[SearchResult, str, os.PathLike]]
SearchArg = Optional[Union[str, Callable[[nn.Module, int, torch.dtype], SearchResult]]]


def check_plan_args(plan: PlanArg, search: SearchArg, placement_policy: str) -> None:
    """Reject contradictory or unknown arguments at construction, naming the fix."""
    if placement_policy not in PLACEMENT_POLICIES:
        raise ValueError(
            f"placement_policy must be one of {PLACEMENT_POLICIES}, got {placement_policy!r} "
            "(for fractions or disk placement, make a plan with `elixir plan` and pass plan=)"
        )
    if plan is not None and search is not None:
        raise ValueError("give plan= or search=, not both (a plan is already the result of a search)")
    if isinstance(search, str) and search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES} or a callable, got {search!r}")
    if plan is not None and not isinstance(plan, (SearchResult, str, os.PathLike)):
        raise TypeError(f"plan must be a SearchResult or the path of a plan JSON, got {type(plan).__name__}")


def make_plan(
    model: nn.Module,
    world_size: int,
    dtype: torch.dtype,
    plan: PlanArg = None,
    search: SearchArg = None,
    placement_policy: str = "cuda",
    verbose: bool = False,
) -> SearchResult:
    """The plan for ``model`` at ``world_size`` ranks computing in ``dtype`` (see the module docstring)."""
    check_plan_args(plan, search, placement_policy)
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
        return optimal_search(model, world_size, unified_dtype=dtype, verbose=verbose)
    return minimum_waste_search(
        model, world_size, unified_dtype=dtype, cpu_offload=placement_policy == "cpu", verbose=verbose
    )
