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

from elixir.tracer.hooks import map_tensors


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

    def scale(t: torch.Tensor) -> torch.Tensor:
        return ScaleGrad.apply(t, get_scale) if t.requires_grad and t.is_floating_point() else t

    return map_tensors(obj, scale)
