"""Low-precision GEMMs on CPUs that have no native kernel for them.

torch computes a bf16 (or fp16) matrix product on CPU with oneDNN only where the processor has
bf16 (fp16) dot-product instructions (AVX512-BF16, AMX). Elsewhere, on AVX2-only machines for
instance, it falls back to a reference loop: measured on a 2-core AVX2 EPYC with torch 2.13, a
bf16 ``torch.mm`` of 1024x1024 ran at 0.9 GFLOP/s against 113 GFLOP/s in fp32, and a GPT-2
81.9M forward+backward in bf16 took 85 s against 2.2 s with the products widened as below.

*Widening* computes such a product as the fallback kernel does, in fp32 with one rounding of the
result to the low-precision dtype, but through the fp32 BLAS: each operand is cast up (exact:
every bf16/fp16 value is an fp32 value), multiplied in fp32, and the result cast down once. The
fallback also accumulates in fp32 and rounds once, so the two differ only in the order of the
fp32 summation, as any two GEMM kernels do. Autograd saves the low-precision operands, as the
native product does, so activation memory is unchanged; backward widens its products the same
way.

:func:`widened_gemms` is the context the runtime (``ElixirModule``'s forward) and the hardware
measurement (``elixir hwprofile``'s low-precision matmul rates) enter, so the search prices the
products the runtime really computes. It is active only for CPU tensors of a low-precision dtype
torch has no native kernel for here; on an accelerator, and on CPUs with native bf16/fp16, it
is a no-op. ``ELIXIR_LOWP_GEMM=native`` turns it off, ``=widen`` forces it (tests use that on
machines with native kernels).

What it widens: ``F.linear``, ``torch.addmm``, ``torch.mm``, ``torch.bmm``, ``torch.baddbmm``
and ``torch.matmul`` (and the ``Tensor`` methods and ``@``) when both operands are CPU tensors of
the dtype and at least 2-D. Not widened: products inside fused kernels (SDPA keeps its own
kernel) and recomputed forwards run by activation checkpointing during backward, which happen
outside the forward's context (they stay exact, only not faster).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

LOW_PRECISION = (torch.bfloat16, torch.float16)
_ENV = "ELIXIR_LOWP_GEMM"
_MODES = ("auto", "native", "widen")


def _setting() -> str:
    value = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"{_ENV}={value!r}: use one of {', '.join(_MODES)} (auto: widen where torch has no native kernel)")
    return value


@functools.cache  # a property of the processor and the torch build: asked once, not per forward
def has_native_gemm(dtype: torch.dtype) -> bool:
    """Whether torch computes ``dtype`` matrix products on this CPU with a native (oneDNN) kernel."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def widens(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products of ``dtype`` on ``device`` are computed widened (see the module docstring)."""
    if dtype not in LOW_PRECISION or torch.device(device).type != "cpu":
        return False
    setting = _setting()
    return setting == "widen" or (setting == "auto" and not has_native_gemm(dtype))


def describe(dtype: torch.dtype = torch.bfloat16) -> str:
    """One line for reports: how this machine computes ``dtype`` products on CPU."""
    name = str(dtype).removeprefix("torch.")
    if widens(dtype, torch.device("cpu")):
        why = "forced" if _setting() == "widen" else f"no native {name} kernel"
        return f"widened to fp32 ({why})"
    return "native"


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return t if t.shape == shape else t.sum_to_size(shape)


# fp32 bytes of a weight widened at once: a 2-D operand (a weight) is widened this many columns
# at a time, so a product never holds an fp32 copy of a whole large weight (an LLaMA-7B lm_head
# would be 0.5 GiB); activations are widened whole (they are small next to the weights).
BLOCK_BYTES = 32 << 20


def _column_blocks(k: int, n: int) -> Iterator[slice]:
    step = max(1, BLOCK_BYTES // (4 * max(1, k)))
    for j in range(0, n, step):
        yield slice(j, min(n, j + step))


def _widened_forward(c, a, b, beta, alpha) -> torch.Tensor:
    af = a.float()
    if b.dim() != 2:
        out = torch.matmul(af, b.float())
        if alpha != 1:
            out.mul_(alpha)
        if c is not None:
            out.add_(c.float(), alpha=beta)
        return out.to(a.dtype)
    k, n = b.shape
    cf = None if c is None else c.float().expand(*a.shape[:-1], n)
    out = torch.empty(*a.shape[:-1], n, dtype=a.dtype, device=a.device)
    for cols in _column_blocks(k, n):
        part = torch.matmul(af, b[:, cols].float())
        if alpha != 1:
            part.mul_(alpha)
        if cf is not None:
            part.add_(cf[..., cols], alpha=beta)
        out[..., cols] = part  # the one rounding
    return out


class _WidenedProduct(torch.autograd.Function):
    """``beta * c + alpha * (a @ b)`` in fp32, rounded once to ``a``'s dtype; ``c`` may be None.

    ``a`` is ``(..., m, k)``, ``b`` is ``(k, n)`` or ``(..., k, n)`` (broadcast as ``matmul``
    does), ``c`` broadcasts to the result. A 2-D ``b`` is widened in column blocks of
    :data:`BLOCK_BYTES`; every output element is still one fp32 dot product rounded once.
    """

    @staticmethod
    def forward(ctx, c: Optional[torch.Tensor], a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float):
        ctx.save_for_backward(a, b)
        ctx.beta, ctx.alpha = beta, alpha
        ctx.c_shape = None if c is None else c.shape
        return _widened_forward(c, a, b, beta, alpha)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        need_c, need_a, need_b = ctx.needs_input_grad[:3]
        grad_c = grad_a = grad_b = None
        if need_c:
            gc = grad.float() * ctx.beta if ctx.beta != 1 else grad.float()
            grad_c = _sum_to(gc, ctx.c_shape).to(grad.dtype)
        if b.dim() != 2:
            g = grad.float() * ctx.alpha if ctx.alpha != 1 else grad.float()
            if need_a:
                grad_a = _sum_to(torch.matmul(g, b.float().transpose(-1, -2)), a.shape).to(a.dtype)
            if need_b:
                grad_b = _sum_to(torch.matmul(a.float().transpose(-1, -2), g), b.shape).to(b.dtype)
            return grad_c, grad_a, grad_b, None, None
        # one weight for every leading index of a: rows are tokens, products by column block of b
        k, n = b.shape
        g2 = grad.reshape(-1, n)
        a2 = a.reshape(-1, k).float() if need_b else None
        acc = torch.zeros(g2.shape[0], k, dtype=torch.float32, device=a.device) if need_a else None
        grad_b = torch.empty_like(b) if need_b else None
        for cols in _column_blocks(k, n):
            gf = g2[:, cols].float()
            if ctx.alpha != 1:
                gf.mul_(ctx.alpha)
            if need_a:
                acc.addmm_(gf, b[:, cols].float().t())
            if need_b:
                grad_b[:, cols] = a2.t() @ gf  # the one rounding
        if need_a:
            grad_a = _sum_to(acc.reshape(*grad.shape[:-1], k), a.shape).to(a.dtype)
        return grad_c, grad_a, grad_b, None, None


def _low(t, dtype: torch.dtype) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == dtype and t.device.type == "cpu" and t.dim() >= 2


def _arg(args: tuple, kwargs: dict, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


_LINEAR = {F.linear}
# the operands' keyword names
_ADD_PRODUCT = {torch.addmm: ("mat1", "mat2"), torch.Tensor.addmm: ("mat1", "mat2"),
                torch.baddbmm: ("batch1", "batch2"), torch.Tensor.baddbmm: ("batch1", "batch2")}
_PRODUCT = {torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.matmul, torch.Tensor.matmul,
            torch.Tensor.__matmul__}


class WidenedGemms(TorchFunctionMode):
    """Routes ``dtype`` products of CPU tensors through :class:`_WidenedProduct`."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.widened = 0  # products routed so far (tests and reports read it)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dt = self.dtype
        if func in _LINEAR:
            x, w, bias = args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
            if _low(x, dt) and _low(w, dt) and (bias is None or bias.dtype == dt):
                self.widened += 1
                return _WidenedProduct.apply(bias, x, w.t(), 1, 1)
        elif func in _ADD_PRODUCT and not kwargs.get("out"):
            first, second = _ADD_PRODUCT[func]
            c, a, b = args[0], _arg(args, kwargs, 1, first), _arg(args, kwargs, 2, second)
            if _low(a, dt) and _low(b, dt) and isinstance(c, torch.Tensor) and c.dtype == dt:
                self.widened += 1
                return _WidenedProduct.apply(c, a, b, kwargs.get("beta", 1), kwargs.get("alpha", 1))
        elif func in _PRODUCT and not kwargs.get("out") and len(args) >= 2:
            a, b = args[0], args[1]
            if _low(a, dt) and _low(b, dt):
                self.widened += 1
                return _WidenedProduct.apply(None, a, b, 1, 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def widened_gemms(dtype: torch.dtype, device: torch.device) -> Iterator[Optional[WidenedGemms]]:
    """Widen ``dtype`` products on ``device`` inside the block where :func:`widens` says so;
    yields the mode (or None when nothing is widened)."""
    if not widens(dtype, device):
        yield None
        return
    with WidenedGemms(dtype) as mode:
        yield mode


__all__ = ["LOW_PRECISION", "WidenedGemms", "describe", "has_native_gemm", "widened_gemms", "widens"]
