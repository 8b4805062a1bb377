"""GeminiPlugin (also ElixirPlugin): ColossalAI's Gemini arguments on ElixirModule/ElixirOptimizer."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from elixir import distributed as edist
from elixir.booster.runtime_plugin import ElixirRuntimePlugin
from elixir.search import SearchResult
from elixir.search.placement_policy import PLACEMENT_POLICIES, StaticFractions, make_plan

# GeminiPlugin arguments the runtime cannot honour: name -> (value that means "off", the alternative)
_SHARDFORMER = "Shardformer model rewrites are out of scope for elixir (it runs the model's own modules)"
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "tp_size": (1, "elixir is data parallel (chunked ZeRO-3); tensor parallelism is not supported: leave tp_size=1"),
    "extra_dp_size": (1, "elixir shards over the whole default group; leave extra_dp_size=1"),
    "enable_sequence_parallelism": (False, "sequence parallelism is not supported (data parallel only)"),
    "enable_flash_attention": (False, f"{_SHARDFORMER}; load the HF model with attn_implementation='sdpa' for fused attention"),
    "enable_fused_normalization": (False, f"{_SHARDFORMER}; the model's own normalization layers run as they are"),
    "enable_jit_fused": (False, f"{_SHARDFORMER}; the model's own modules run as they are"),
    "enable_all_optimization": (False, f"{_SHARDFORMER}; see enable_flash_attention"),
    "chunk_config_dict": (None, "chunk sizes come from the search: pass plan= (a SearchResult or `elixir plan --out` JSON)"),
    "search_range_m": (None, "chunk sizes come from the search: pass plan= or placement_policy='auto'"),
    "hidden_dim": (None, "chunk sizes come from the search: pass plan= or placement_policy='auto'"),
    "min_chunk_size_m": (None, "chunk sizes come from the search: pass plan= or placement_policy='auto'"),
    "warmup_non_model_data_ratio": (None, "'auto' budgets memory from the traced step: use optimal_search(device_memory=...) and plan="),
    "steady_cuda_cap_ratio": (None, "'auto' budgets memory from the traced step: use optimal_search(device_memory=...) and plan="),
    "gpu_margin_mem_ratio": (None, "'auto' budgets memory from the traced step: use optimal_search(device_memory=...) and plan="),
    "master_weights": (True, "elixir always keeps fp32 master weights for low-precision chunks"),
    "memstats": (None, "memory statistics come from the tracer: use elixir.tracer / `elixir plan`"),
}


class GeminiPlugin(ElixirRuntimePlugin):
    """Chunked ZeRO-3 with heterogeneous placement, on :class:`~elixir.wrapper.ElixirModule` and
    :class:`~elixir.wrapper.ElixirOptimizer`, under ColossalAI's GeminiPlugin argument names.

    Args:
        placement_policy: ``"static"`` (the fractions below, chunks in order), ``"auto"``
            (:func:`~elixir.search.optimal_search`), or the legacy ``"cuda"`` / ``"cpu"``
            (:mod:`elixir.search.placement_policy` has the rules).
        shard_param_frac, offload_optim_frac, offload_param_frac: ``"static"`` only.
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"``: the chunks' compute dtype (fp32 masters).
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the dynamic loss scaler (keywords: the fields of
            :class:`~elixir.wrapper.LossScalePolicy`, ColossalAI's names; fp16).
        max_norm, norm_type: gradient clipping inside the step (0 disables).
        enable_gradient_accumulation: allow :meth:`Booster.no_sync` (accumulate without reducing).
        max_prefetch: chunks gathered ahead (0: none).
        pin_memory: pinned host memory for host-placed shards (CUDA).
        offload_dir: where disk-placed state goes (plans with disk placement).
        verbose: print the plan.
        plan: a ready plan (a SearchResult or a plan JSON path); overrides the policy.

    Any other GeminiPlugin argument (Shardformer switches, chunk-size knobs, memory ratios) raises
    ``ValueError`` naming elixir's alternative when given a value that would change anything.
    """

    name = "gemini"

    def __init__(
        self,
        placement_policy: str = "static",
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        precision: str = "fp16",
        *,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        enable_gradient_accumulation: bool = False,
        max_prefetch: int = 0,
        pin_memory: bool = False,
        offload_dir: Optional[str] = None,
        verbose: bool = False,
        plan: Optional[Union[SearchResult, str]] = None,
        enable_async_reduce: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(UNSUPPORTED, options, precision, max_norm, norm_type, enable_gradient_accumulation, verbose, plan)
        if placement_policy not in PLACEMENT_POLICIES:
            raise ValueError(f"placement_policy must be one of {PLACEMENT_POLICIES}, got {placement_policy!r}")
        fractions = StaticFractions(shard_param_frac, offload_param_frac, offload_optim_frac)
        if placement_policy != "static" and fractions != StaticFractions():
            raise ValueError(
                f"shard_param_frac/offload_optim_frac/offload_param_frac apply to placement_policy='static'; "
                f"with {placement_policy!r} the placement is {'searched' if placement_policy == 'auto' else 'fixed'}: "
                "drop them or use placement_policy='static'"
            )
        if max_prefetch < 0:
            raise ValueError(f"max_prefetch must be >= 0, got {max_prefetch}")
        if not enable_async_reduce:
            raise ValueError("enable_async_reduce=False is not supported: elixir always overlaps the reductions with backward")
        self.placement_policy = placement_policy
        self.fractions = fractions
        self.max_prefetch = max_prefetch
        self.pin_memory = pin_memory
        self.offload_dir = offload_dir

    def make_plan(self, model: torch.nn.Module) -> SearchResult:
        world = edist.get_world_size()
        verbose = self.verbose and edist.get_rank() == 0
        if self.plan is not None:
            result = make_plan(model, world, self.dtype, plan=self.plan)
        else:
            result = make_plan(
                model, world, self.dtype, placement_policy=self.placement_policy, verbose=verbose,
                fractions=self.fractions if self.placement_policy == "static" else None, pin_memory=self.pin_memory,
            )
        if self.max_prefetch:
            result = dataclasses.replace(result, prefetch_depth=self.max_prefetch)
        return result

ElixirPlugin = GeminiPlugin
"""Another name for :class:`GeminiPlugin` (the plugin that runs `ElixirModule` and `ElixirOptimizer`)."""
