"""ElixirPrecision: Lightning's precision flags, carried out by elixir's chunks instead of autocast.

elixir keeps fp32 masters and computes in the chunks' dtype, so the flag chooses that dtype; no
``torch.autocast`` and no ``GradScaler`` are involved:

================  ======================  ===========================================================
precision         chunk (compute) dtype   what else
================  ======================  ===========================================================
``"32-true"``     float32
``"bf16-mixed"``  bfloat16                outputs cast to fp32 (losses in fp32)
``"16-mixed"``    float16                 outputs cast to fp32; dynamic loss scaling by
                                          ``ElixirOptimizer`` (an overflow on any rank skips the step
                                          on every rank)
``"bf16-true"``   bfloat16                the model is built in bf16 (``configure_model`` and
                                          ``Trainer.init_module``), inputs and outputs stay bf16;
                                          elixir still updates fp32 masters
================  ======================  ===========================================================

Gradient clipping by norm goes to :meth:`ElixirOptimizer.clip_grad_norm_` (the global norm over
every rank's shards, folded into the step); clipping by value is refused.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Union

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities import apply_to_collection
from torch.optim import Optimizer

SUPPORTED = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
}


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer behind Lightning's ``LightningOptimizer`` wrapper (or the object itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


class ElixirPrecision(Precision):
    """The precision plugin of :class:`~elixir.integrations.lightning.ElixirStrategy`."""

    def __init__(self, precision: str = "32-true") -> None:
        precision = str(precision)
        if precision not in SUPPORTED:
            raise ValueError(
                f"strategy='elixir' does not support precision={precision!r}; use one of {sorted(SUPPORTED)} "
                "(elixir computes in the chunk dtype and keeps fp32 masters; 64-bit, fp16-true and "
                "transformer-engine are not implemented)"
            )
        self.precision = precision
        self.dtype: torch.dtype = SUPPORTED[precision]

    @property
    def output_fp32(self) -> bool:
        """Cast the module's outputs (the loss) to fp32: the mixed flags do, the "true" ones do not."""
        return self.precision.endswith("-mixed")

    def tensor_init_context(self) -> AbstractContextManager:
        if self.precision == "bf16-true":
            return _DtypeContextManager(self.dtype)
        return nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        if self.precision == "bf16-true":
            return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self.dtype)
        return data

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        # Run the closure (forward, backward, clipping hooks) here, then step without it:
        # ElixirOptimizer steps once on reduced shards and takes no closure.
        closure()
        self._after_closure(model, optimizer)
        return optimizer.step(**kwargs)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val is None or clip_val <= 0:
            return
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            raise ValueError(
                "strategy='elixir' clips by norm only (the gradients live in shards across ranks); "
                "use gradient_clip_algorithm='norm'"
            )
        unwrap_optimizer(optimizer).clip_grad_norm_(float(clip_val))

    def state_dict(self) -> dict[str, Any]:
        return {}  # the loss scale is saved with the optimizer in elixir's checkpoint
