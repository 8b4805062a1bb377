"""GeminiPlugin (also ElixirPlugin): ColossalAI's Gemini arguments on ElixirModule/ElixirOptimizer."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from elixir import distributed as edist
from elixir.booster.compat import GEMINI, note
from elixir.booster.mesh_wrap import tp_dims
from elixir.booster.runtime_plugin import ElixirRuntimePlugin
from elixir.plan import MeshLayout
from elixir.search import SearchResult
from elixir.search.placement_policy import PLACEMENT_POLICIES, StaticFractions, check_lossy_search, make_plan


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
        max_prefetch: chunks gathered ahead (0: none). A plan made without a traced step has no
            parameter order; the runtime then learns it from the first training iteration and
            prefetches from the second.
        pin_memory: pinned host memory for host-placed shards (CUDA), on every path (``plan=``
            and ``"auto"`` included).
        force_outputs_fp32: the model's floating outputs in fp32 (None, elixir's default: whenever
            ``precision`` is low; False: in the compute dtype, as ColossalAI's default).
        enable_flash_attention, enable_all_optimization: switch Hugging Face models running eager
            attention to torch's fused SDPA (``ElixirModule(use_fused_kernels=True)``).
        offload_dir: where disk-placed state goes (plans with disk placement).
        verbose: print the plan.
        plan: a ready plan (a SearchResult or a plan JSON path); overrides the policy.
        tp_size: tensor-parallel ranks: the model is parallelised with torch's DTensor styles
            (:func:`elixir.parallel.tensor_parallel`, elixir's plan for the model) over groups of
            ``tp_size`` adjacent ranks, and the chunks, holding each rank's local shards, shard
            over the other ``world // tp_size`` (``placement_policy`` ``"static"``, ``"cuda"`` or
            ``"cpu"``; ``"auto"`` does not plan tensor parallelism yet).
        master, moments, frozen: the optimizer-state and frozen-weight formats
            (``MixedPrecisionPolicy``'s fields of these names; docs/optimizer.md). ``"auto"`` prices them.
        allow_lossy_state: let ``"auto"``'s search turn to leaner state formats where ``master``/
            ``moments`` do not fit (refused with another placement or ``plan=``: nothing would act on it).

    Every other argument of ColossalAI 0.5's GeminiPlugin is accepted: at a value other than
    ColossalAI's default it is ignored with a one-line note saying what elixir does instead
    (chunk-size hints, Gemini's memory ratios, devices), or refused naming the alternative where
    it cannot be honoured (``extra_dp_size > 1``, ``master_weights=False``); see
    :data:`elixir.booster.compat.GEMINI`.
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
        force_outputs_fp32: Optional[bool] = None,
        enable_flash_attention: bool = False,
        enable_all_optimization: bool = False,
        offload_dir: Optional[str] = None,
        verbose: bool = False,
        plan: Optional[Union[SearchResult, str]] = None,
        tp_size: int = 1,
        **options: Any,
    ) -> None:
        super().__init__(GEMINI, options, precision, max_norm, norm_type, enable_gradient_accumulation, verbose, plan)
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
        if enable_all_optimization:
            note("GeminiPlugin(enable_all_optimization=True): of Shardformer's optimizations elixir applies fused "
                 "attention (use_fused_kernels); fused normalization and JIT fusion are not applied")
        self.placement_policy = placement_policy
        self.fractions = fractions
        self.max_prefetch = max_prefetch
        self.pin_memory = pin_memory
        self.offload_dir = offload_dir
        self.output_fp32 = force_outputs_fp32
        self.use_fused_kernels = bool(enable_flash_attention or enable_all_optimization)
        self.layout = MeshLayout(**tp_dims(tp_size)) if tp_size != 1 else None
        self.tp_size = tp_size
        check_lossy_search(self.allow_lossy_state, plan, None, placement_policy, owner=type(self).__name__,
                           fix="placement_policy='auto'")
        if self.layout is not None and placement_policy == "auto":
            raise ValueError("GeminiPlugin(tp_size > 1, placement_policy='auto'): optimal_search does not plan a "
                             "tensor-parallel layout yet; use placement_policy='static' (or 'cuda'/'cpu')")

    def make_plan(self, model: torch.nn.Module) -> SearchResult:
        world = self.layout if self.layout is not None else edist.get_world_size()
        verbose = self.verbose and edist.get_rank() == 0
        if self.plan is not None:
            result = make_plan(model, world, self.dtype, plan=self.plan, pin_memory=self.pin_memory)
        else:
            result = make_plan(
                model, world, self.dtype, placement_policy=self.placement_policy, verbose=verbose,
                fractions=self.fractions if self.placement_policy == "static" else None, pin_memory=self.pin_memory,
                formats={"master": self.state_formats[0], "moments": self.state_formats[1], "frozen": self.frozen_format,
                         "allow_lossy_state": self.allow_lossy_state},
            )
        if self.max_prefetch:
            result = dataclasses.replace(result, prefetch_depth=self.max_prefetch)
        return result

ElixirPlugin = GeminiPlugin
"""Another name for :class:`GeminiPlugin` (the plugin that runs `ElixirModule` and `ElixirOptimizer`)."""
