"""LowLevelZeroPlugin: ColossalAI's ZeRO-1/2 plugin on elixir's runtime, a plan of ZeRO-1/2 chunks.

Every chunk of the plan is ``Sharding.ZERO1`` (stage 1) or ``Sharding.ZERO2`` (stage 2): the
compute-dtype parameters stay whole on every rank, each rank keeps and steps only its part of the
fp32 master and optimizer state, gradients are all-reduced (stage 1) or reduce-scattered (stage 2)
chunk by chunk as backward produces them, and the updated parts are all-gathered after the step.
A chunk is the reduction bucket, so ``reduce_bucket_size_in_m`` caps the chunk size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from elixir import distributed as edist
from elixir.booster.compat import LOW_LEVEL_ZERO
from elixir.booster.runtime_plugin import ElixirRuntimePlugin
from elixir.search import Placement, SearchResult, Sharding, minimum_waste_search
from elixir.search.minimum_waste import print_plan

STAGES = {1: Sharding.ZERO1, 2: Sharding.ZERO2}

class LowLevelZeroPlugin(ElixirRuntimePlugin):
    """ZeRO stage 1 or 2 on :class:`~elixir.wrapper.ElixirModule` / :class:`~elixir.wrapper.ElixirOptimizer`
    under ColossalAI's LowLevelZeroPlugin argument names (see the module docstring).

    Args:
        stage: 1 (gradients all-reduced) or 2 (gradients reduce-scattered); both split the fp32
            master and optimizer state across the ranks.
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"``: the compute dtype (fp32 masters).
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the dynamic loss scaler (keywords: the fields of
            :class:`~elixir.wrapper.LossScalePolicy`, ColossalAI's names; fp16 only).
        max_norm, norm_type: gradient clipping inside the step (0 disables).
        reduce_bucket_size_in_m: the largest chunk, in millions (2**20) of elements: a chunk is
            the unit gradients are reduced in (a parameter larger than it gets a chunk of its own).
        communication_dtype: the dtype gradients are reduced in: None (the compute dtype) or
            ``torch.float32`` (reduce in fp32 while computing in bf16/fp16).
        cpu_offload: keep the fp32 master shards and optimizer state in host memory (gradients
            are copied there once reduced; the step runs on the host, e.g. with HybridAdam).
        enable_gradient_accumulation: allow :meth:`Booster.no_sync` (both stages; nothing is
            reduced until the backward outside the block).
        verbose: print the plan on rank 0.
        plan: a ready plan (a SearchResult or a plan JSON path) whose chunks are made ZeRO-1/2;
            ``reduce_bucket_size_in_m`` then does not apply.

    Every other argument of ColossalAI 0.5's LowLevelZeroPlugin is accepted
    (:data:`elixir.booster.compat.LOW_LEVEL_ZERO`): ``overlap_communication``,
    ``overlap_allgather``, ``cast_inputs`` and the fp8 switches at other values than ColossalAI's
    defaults are ignored with a one-line note saying what elixir does; ``master_weights=False`` and
    ``extra_dp_size > 1`` raise ``ValueError`` naming the alternative.
    """

    name = "low_level_zero"

    def __init__(
        self,
        stage: int = 1,
        precision: str = "fp16",
        *,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        reduce_bucket_size_in_m: Optional[float] = 12,
        communication_dtype: Optional[torch.dtype] = None,
        cpu_offload: bool = False,
        enable_gradient_accumulation: bool = True,
        verbose: bool = False,
        plan: Optional[SearchResult | str] = None,
        **options: Any,
    ) -> None:
        super().__init__(LOW_LEVEL_ZERO, options, precision, max_norm, norm_type, enable_gradient_accumulation, verbose, plan,
                         initial_scale=2.0**32)
        if self.allow_lossy_state:
            raise ValueError("LowLevelZeroPlugin(allow_lossy_state=True): its plans come from minimum_waste_search, which "
                             "keeps master/moments as given: name the formats (e.g. moments='int8'), or use "
                             "GeminiPlugin(placement_policy='auto', allow_lossy_state=True) to let the search choose")
        if stage not in STAGES:
            raise ValueError(f"stage must be 1 or 2, got {stage!r} (for ZeRO-3 use GeminiPlugin)")
        dtype = self.dtype
        if communication_dtype not in (None, dtype, torch.float32):
            raise ValueError(
                f"communication_dtype={communication_dtype} is not supported with precision={precision!r}: "
                f"gradients are reduced in the compute dtype (None) or in torch.float32"
            )
        if reduce_bucket_size_in_m is not None and not reduce_bucket_size_in_m > 0:
            raise ValueError(f"reduce_bucket_size_in_m must be > 0 (or None for the search's choice), got {reduce_bucket_size_in_m}")
        self.stage = stage
        self.sharding = STAGES[stage]
        self.reduce_always_fp32 = communication_dtype is torch.float32 and dtype is not torch.float32
        self.bucket_elements = None if reduce_bucket_size_in_m is None else max(1, int(reduce_bucket_size_in_m * 2**20))
        self.cpu_offload = cpu_offload

    def make_plan(self, model: torch.nn.Module) -> SearchResult:
        world = edist.get_world_size()
        if self.plan is not None:
            base = self.plan if isinstance(self.plan, SearchResult) else SearchResult.load(self.plan)
            if base.world_size != world:
                raise ValueError(f"the plan is for world size {base.world_size}, this run has {world} ranks; re-plan")
        else:
            base = minimum_waste_search(model, world, unified_dtype=self.dtype, max_chunk_size=self.bucket_elements)
        return zero_plan(base, self.sharding, Placement.HOST if self.cpu_offload else Placement.DEVICE, self.verbose)


def zero_plan(base: SearchResult, kind: Sharding, optim: Placement = Placement.DEVICE, verbose: bool = False) -> SearchResult:
    """``base`` with every chunk of ``kind`` (ZeRO-1 or ZeRO-2) and its master and optimizer state
    at ``optim``: nothing is gathered for compute, so the plan needs no rCache."""
    chunks = tuple(dataclasses.replace(c.with_sharding(kind, base.world_size), optim_placement=optim) for c in base.chunks)
    result = dataclasses.replace(
        base, chunks=chunks, cache_blocks=0, prefetch_depth=0, search=f"{base.search}+zero{kind.stage}", prediction=None,
    )
    if verbose and edist.get_rank() == 0:
        print_plan(result)
    return result
