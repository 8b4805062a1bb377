"""Automatic fp16 loss scaling at the boundary of the wrapped model.

With fp16 chunks, :class:`~elixir.wrapper.ElixirOptimizer` wraps every floating output of the
:class:`~elixir.wrapper.ElixirModule` that requires grad in :class:`ScaleGrad`: an identity in
forward that multiplies the gradient flowing back into the model by the current loss scale. So a
plain ``loss.backward()`` yields gradients scaled by ``optimizer.loss_scale``, and the optimizer
unscales them (fused with clipping) at ``step``. Do not scale the loss yourself as well.

Wrapping the outputs rather than the loss keeps a loss computed inside the model (Hugging Face
``labels=``) and one computed outside both scaled exactly once: gradients that flow from one
output to another inside the model never pass through a wrapper. The loss-side gradient outside
the model is formed before scaling, so compute the loss in fp32 (``output_fp32=True`` or an
explicit ``.float()``) to keep tiny loss gradients from underflowing in fp16.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class ScaleGrad(torch.autograd.Function):
    """``y = x`` in forward; ``dL/dx = scale * dL/dy`` in backward (scale read at backward time)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, get_scale: Callable[[], float]) -> torch.Tensor:  # type: ignore[override]
        ctx.get_scale = get_scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.get_scale(), None


def scale_outputs(obj: Any, get_scale: Callable[[], float]) -> Any:
    """``obj`` with every floating tensor that requires grad wrapped in :class:`ScaleGrad`."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and obj.is_floating_point():
            return ScaleGrad.apply(obj, get_scale)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(scale_outputs(x, get_scale) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(scale_outputs(x, get_scale) for x in obj)
    if isinstance(obj, dict):
        for k in list(obj.keys()):
            obj[k] = scale_outputs(obj[k], get_scale)
        return obj
    return obj
