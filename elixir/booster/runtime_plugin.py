"""What the plugins on elixir's own runtime share: ElixirModule and ElixirOptimizer wrap the
model and optimizer, and backward, ``no_sync``, clipping and checkpoints go through them.
:class:`~elixir.booster.gemini.GeminiPlugin` and :class:`~elixir.booster.low_level_zero.LowLevelZeroPlugin`
differ only in the plan they make (:meth:`ElixirRuntimePlugin.make_plan`) and their arguments."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from elixir import checkpoint
from elixir import distributed as edist
from elixir.booster.compat import Compat, check_compat
from elixir.booster.mesh_wrap import (
    bind_optimizer,
    device_mesh,
    local_slice,
    parameter_names,
    tp_dims,
    whole_state,
)
from elixir.booster.plugin import Plugin
from elixir.parallel import tensor_parallel
from elixir.plan.state_format import check_frozen_format, check_state_formats
from elixir.search import SearchResult
from elixir.wrapper import ElixirModule, ElixirOptimizer, LossScalePolicy
from elixir.wrapper.policies import SCALE_KEYWORDS, MixedPrecisionPolicy, loss_scale_policy

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def pop_loss_scale(options: dict[str, Any], **defaults: float) -> LossScalePolicy:
    """The plugin's fp16 loss-scale policy, from the loss-scale arguments in ``options``
    (ColossalAI's ``initial_scale`` ... ``max_scale``, the fields of
    :class:`~elixir.wrapper.LossScalePolicy`), which it removes from ``options``. ``defaults``:
    the plugin's own defaults where they differ from the policy's. Checked now, at the plugin's
    construction, not at the first boost."""
    given = {k: options.pop(k) for k in SCALE_KEYWORDS if k in options}
    return loss_scale_policy(None, **{**defaults, **given})


class ElixirRuntimePlugin(Plugin):
    """A plugin that runs a plan on :class:`ElixirModule` / :class:`ElixirOptimizer` (see the
    module docstring). Subclasses set the attributes below in ``__init__`` and define
    :meth:`make_plan`.

    Attributes:
        dtype: the chunks' compute dtype.
        reduce_always_fp32: reduce gradients in fp32 even when computing in low precision.
        loss_scale: the dynamic loss scale (fp16), a :class:`~elixir.wrapper.LossScalePolicy`.
        max_norm, norm_type: clipping inside the optimizer step (0: none).
        enable_gradient_accumulation: whether :meth:`no_sync` is allowed.
        max_prefetch: chunks gathered ahead (0: none).
        offload_dir: where disk-placed state goes.
        output_fp32: the model's floating outputs in fp32 (None: whenever the chunks compute in
            low precision).
        use_fused_kernels: ElixirModule's ``use_fused_kernels`` (fused SDPA attention).
        tp_size: tensor-parallel ranks (DTensor, :func:`elixir.parallel.tensor_parallel`); the
            chunks shard over the other ``world // tp_size`` ranks.
        precision, verbose, plan: the plugin's arguments of these names.
    """

    dtype: torch.dtype = torch.float32
    reduce_always_fp32: bool = False
    loss_scale: LossScalePolicy
    max_norm: float = 0.0
    norm_type: float = 2.0
    enable_gradient_accumulation: bool = True
    max_prefetch: int = 0
    offload_dir: Optional[str] = None
    output_fp32: Optional[bool] = None
    use_fused_kernels: bool = False
    tp_size: int = 1

    def __init__(
        self,
        compat: dict[str, Compat],
        options: dict[str, Any],
        precision: str,
        max_norm: float,
        norm_type: float,
        enable_gradient_accumulation: bool,
        verbose: bool,
        plan: Optional[SearchResult | str],
        **scale_defaults: float,
    ) -> None:
        """Check and keep the arguments every runtime plugin takes. ``options``: the subclass's
        remaining keyword arguments: the loss-scale ones (:func:`pop_loss_scale`, with the
        subclass's ``scale_defaults``), else ColossalAI arguments ``compat`` lists
        (:func:`~elixir.booster.compat.check_compat`: noted or refused)."""
        self.loss_scale = pop_loss_scale(options, **scale_defaults)
        # optimizer-state formats (MixedPrecisionPolicy.master / .moments), checked now
        self.state_formats = (options.pop("master", "fp32"), options.pop("moments", "fp32"))
        check_state_formats(*self.state_formats, where=type(self).__name__)
        self.frozen_format = options.pop("frozen", None)  # MixedPrecisionPolicy.frozen (a quantised base)
        check_frozen_format(self.frozen_format, where=type(self).__name__)
        # MixedPrecisionPolicy.allow_lossy_state: the subclass refuses it unless its plan is searched
        self.allow_lossy_state = options.pop("allow_lossy_state", False)
        if not isinstance(self.allow_lossy_state, bool):
            raise ValueError(f"{type(self).__name__}(allow_lossy_state=...) must be True or False, got {self.allow_lossy_state!r}")
        check_compat(type(self).__name__, options, compat)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
        if max_norm < 0:
            raise ValueError(f"max_norm must be >= 0 (0 disables clipping), got {max_norm}")
        self.precision, self.dtype = precision, PRECISIONS[precision]
        self.max_norm, self.norm_type = max_norm, norm_type
        self.enable_gradient_accumulation = enable_gradient_accumulation
        self.verbose = verbose
        self.plan = plan

    def make_plan(self, model: torch.nn.Module) -> SearchResult:
        raise NotImplementedError

    def configure(self, model, optimizer, criterion, dataloader, lr_scheduler) -> tuple:
        if not isinstance(model, ElixirModule):
            output_fp32 = self.dtype != torch.float32 if self.output_fp32 is None else self.output_fp32
            names, mesh = parameter_names(model), None
            if self.tp_size > 1:  # DTensor tensor parallelism first; chunks then hold the local shards
                mesh = device_mesh(tp_dims(self.tp_size))
                tensor_parallel(model, mesh)
            mp = MixedPrecisionPolicy(
                param_dtype=self.dtype, reduce_dtype=torch.float32 if self.reduce_always_fp32 else None,
                output_dtype=torch.float32 if output_fp32 else None, master=self.state_formats[0],
                moments=self.state_formats[1], frozen=self.frozen_format, allow_lossy_state=self.allow_lossy_state,
            )
            model = ElixirModule(
                model, self.make_plan(model), mp_policy=mp, prefetch=self.max_prefetch > 0,
                offload_dir=self.offload_dir, use_fused_kernels=self.use_fused_kernels, mesh=mesh,
            )
            if mesh is not None and optimizer is not None and not isinstance(optimizer, ElixirOptimizer):
                bind_optimizer(optimizer, names, model)  # its parameters were replaced by local shards
        if optimizer is not None and not isinstance(optimizer, ElixirOptimizer):
            optimizer = ElixirOptimizer(model, optimizer, max_norm=self.max_norm, norm_type=self.norm_type,
                                        loss_scale_policy=self.loss_scale)
        return model, optimizer, criterion, dataloader, lr_scheduler

    def backward(self, loss, optimizer) -> None:
        optimizer.backward(loss)

    def no_sync(self, model, optimizer) -> contextlib.AbstractContextManager:
        if not self.enable_gradient_accumulation:
            raise RuntimeError(f"no_sync needs {type(self).__name__}(enable_gradient_accumulation=True)")
        return model.no_sync()

    def clip_grad_by_norm(self, model, optimizer, max_norm, norm_type=2.0) -> torch.Tensor:
        return optimizer.clip_grad_norm_(max_norm, norm_type)

    def full_state_dict(self, model) -> dict:
        if model.tensor_parallel is not None:  # whole tensors from the tp shards (collective over dp and tp)
            whole = whole_state(model, self.tp_size)
            return whole if edist.get_rank() == 0 else {}
        return model.state_dict(rank0_only=True)

    def load_full_state_dict(self, model, state, strict) -> None:
        if model.tensor_parallel is not None:  # each tp rank its slice
            state = {k: local_slice(model, k, v, self.tp_size) for k, v in state.items()}
        model.load_state_dict(state, strict=strict)

    def save_optimizer(self, optimizer, path) -> None:
        # elixir's sharded checkpoint: each rank writes its own fp32 master shards and optimizer state
        if optimizer.module.tensor_parallel is not None:  # one part per tp rank, loadable at another tp
            checkpoint.save_mesh(path, optimizer.module, optimizer)
        else:
            checkpoint.save(path, optimizer.module, optimizer)

    def load_optimizer(self, optimizer, path) -> None:
        checkpoint.load(path, optimizer.module, optimizer)
