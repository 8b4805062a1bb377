"""What a trainer integration (the Lightning strategy, the HF Trainer) asks of elixir, held and
checked in one place, and the three steps both take with it: plan the model, wrap it, wrap its
optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from elixir.plan import SearchResult
from elixir.plan.state_format import check_frozen_format, check_state_formats
from elixir.search.placement_policy import PlanArg, SearchArg, check_lossy_search, check_plan_args, make_plan
from elixir.wrapper import ElixirModule, ElixirOptimizer
from elixir.wrapper.policies import SCALE_KEYWORDS, LossScalePolicy, MixedPrecisionPolicy, loss_scale_policy


@dataclass(frozen=True)
class ElixirOptions:
    """An integration's elixir arguments (see :mod:`elixir.search.placement_policy` for the first
    three).

    Attributes:
        placement_policy: ``"cuda"``, ``"cpu"`` or ``"auto"``.
        plan: a ready plan (a SearchResult or a plan JSON path), or None.
        search: ``"minimum_waste"``, ``"optimal"`` or a callable, or None.
        prefetch: gather ahead along the traced order.
        offload_dir: where disk-placed masters and optimizer state go.
        loss_scale: the fp16 loss scale's arguments (``initial_scale`` ... ``hysteresis``).
        verbose: print the search's report on the main process.
        master, moments: the optimizer-state formats (``MixedPrecisionPolicy.master`` and
            ``.moments``: low-precision state, docs/optimizer.md); fp32 by default.
        frozen: the frozen weights' format (``MixedPrecisionPolicy.frozen``: ``"nf4"``, ``"int8"``
            for a quantised adapter base); None by default.
        allow_lossy_state: let ``optimal_search`` turn to leaner state formats where ``master``/
            ``moments`` do not fit (``MixedPrecisionPolicy.allow_lossy_state``); needs
            ``placement_policy="auto"`` or ``search="optimal"``. The run keeps the plan's formats.
    """

    placement_policy: str = "cuda"
    plan: PlanArg = None
    search: SearchArg = None
    prefetch: bool = False
    offload_dir: Optional[str] = None
    loss_scale: Mapping[str, float] = field(default_factory=dict)
    verbose: bool = False
    master: str = "fp32"
    moments: str = "fp32"
    frozen: Optional[str] = None
    allow_lossy_state: bool = False

    def __post_init__(self) -> None:
        check_state_formats(self.master, self.moments, where="elixir")
        check_frozen_format(self.frozen, where="elixir")
        check_plan_args(self.plan, self.search, self.placement_policy)
        check_lossy_search(self.allow_lossy_state, self.plan, self.search, self.placement_policy)
        unknown = sorted(set(self.loss_scale) - set(SCALE_KEYWORDS))
        if unknown:
            raise ValueError(f"loss_scale got {unknown}; its keys are {list(SCALE_KEYWORDS)}")
        object.__setattr__(self, "loss_scale", dict(self.loss_scale))
        self.scale_policy()  # checks the values now, not at the first step

    def scale_policy(self) -> LossScalePolicy:
        """The loss-scale policy ``loss_scale`` spells."""
        return loss_scale_policy(None, **self.loss_scale)

    def make_plan(self, model: nn.Module, world_size: int, dtype: torch.dtype, main: bool,
                  accumulation: bool = False) -> SearchResult:
        """The plan for ``model`` (``main``: this process prints the report when verbose;
        ``accumulation``: the run accumulates gradients under ``no_sync``)."""
        return make_plan(model, world_size, dtype, self.plan, self.search, self.placement_policy,
                         verbose=self.verbose and main, accumulation=accumulation,
                         formats=self.formats())

    def formats(self) -> dict[str, Any]:
        """The state and frozen formats as ``optimal_search``'s (and ``MixedPrecisionPolicy``'s) keywords."""
        return {"master": self.master, "moments": self.moments, "frozen": self.frozen,
                "allow_lossy_state": self.allow_lossy_state}

    def wrap(self, model: nn.Module, plan: SearchResult, dtype: torch.dtype, output_fp32: bool,
             init_seed: Optional[int] = None) -> ElixirModule:
        mp = MixedPrecisionPolicy(param_dtype=dtype, output_dtype=torch.float32 if output_fp32 else None,
                                  **self.formats())
        return ElixirModule(model, plan, prefetch=self.prefetch, mp_policy=mp, offload_dir=self.offload_dir,
                            init_seed=init_seed)

    def wrap_optimizer(self, module: ElixirModule, optimizer: torch.optim.Optimizer) -> ElixirOptimizer:
        return ElixirOptimizer(module, optimizer, loss_scale_policy=self.scale_policy())
