"""One Adam/AdamW step on flat tensors: the native fused kernel on CPU, torch elsewhere.

This is the entry point of the fused mixed-precision path (ElixirOptimizer calls it on shards):

    adam_step(param, grad, exp_avg, exp_avg_sq, step=t, lr=..., beta1=..., beta2=..., eps=...,
              weight_decay=..., adamw_mode=True, bias_correction=True,
              div_scale=loss_scale / clip_coef, out_lowp=param_bf16)

does, in one pass over memory for CPU tensors (``g = grad / div_scale`` in fp32):

    Adam  (adamw_mode=False): g = g + weight_decay * param
    AdamW (adamw_mode=True):  param = param * (1 - lr * weight_decay)
    exp_avg    = lerp(exp_avg, g, 1 - beta1)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    param      = param - lr / bc1 * exp_avg / (sqrt(exp_avg_sq) / sqrt(bc2) + eps)
    out_lowp   = param.to(out_lowp.dtype)            (round to nearest even, as torch's .to())

with ``bc1 = 1 - beta1**step`` and ``bc2 = 1 - beta2**step`` (both 1 when ``bias_correction`` is
False). The operations, their order and their fmas are those of torch's fused CPU Adam, so fp32
results are bitwise equal to ``torch.optim.AdamW(fused=True)`` for all but the last
``numel % 16`` elements of a tensor, where torch's scalar tail rounds ``exp_avg_sq`` differently
by at most one ulp. Nothing is written to ``grad``.

Tensors not on the CPU, or non-contiguous ones, take the pure-torch path with the same formula:
torch's ``_fused_adam(w)_`` when ``bias_correction`` is on, else explicit torch ops. Without the
native extension CPU tensors take that path too, after one warning.
"""

from __future__ import annotations

import contextlib
import struct
from collections import defaultdict
from typing import Iterator, List, Optional, Sequence, Union

import torch

from elixir._native import get_native, warn_fallback
from elixir.optim import lowbit

__all__ = ["adam_step", "adam_step_multi", "adam_step_lowbit", "kernel_available", "kernel_level", "GRAD_DTYPES", "LOWP_DTYPES",
           "LOWBIT_OUT_DTYPES"]

#: Gradient dtypes the kernel reads.
GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Dtypes of the optional low-precision parameter copy.
LOWP_DTYPES = (torch.float16, torch.bfloat16)

_GRAD_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_OUT_CODE = {torch.float16: 1, torch.bfloat16: 2, None: 3}
#: the low-precision-state kernel's ``out`` also takes fp32 (the compensated bf16-kahan master)
LOWBIT_OUT_DTYPES = (torch.float32, *LOWP_DTYPES)
_LOWBIT_OUT_CODE = {torch.float32: 0, **_OUT_CODE}

_forced_simd = ""  # test hook, see _simd_override


def kernel_available() -> bool:
    """Whether CPU tensors are stepped by the native kernel (the extension is importable)."""
    native = get_native()
    return native is not None and hasattr(native, "adam_update")


def kernel_level() -> str:
    """The kernel variant CPU steps run: 'avx512bf16', 'avx512', 'avx2', 'scalar', or 'torch'."""
    return get_native().adam_kernel_level(_forced_simd) if kernel_available() else "torch"


@contextlib.contextmanager
def _simd_override(level: str) -> Iterator[None]:
    """Tests only: run the kernel variant ``level`` (capped at what the CPU supports)."""
    global _forced_simd
    previous, _forced_simd = _forced_simd, level
    try:
        yield
    finally:
        _forced_simd = previous


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    out_lowp: Optional[torch.Tensor] = None,
    **hyper: Union[int, float, bool],
) -> None:
    """One Adam (``adamw_mode=False``) or AdamW step, in place, on one tensor: :func:`adam_step_multi`
    on one tensor, with the same keyword arguments (``step``, ``lr``, ``beta1`` ... ``div_scale``).

    Args:
        param: fp32 master parameter, updated in place.
        grad: gradient, fp32, fp16 or bf16, same number of elements; it is read, never written.
        exp_avg, exp_avg_sq: fp32 moments, same number of elements, updated in place.
        out_lowp: optional fp16/bf16 tensor with as many elements, overwritten with the new
            ``param`` rounded to nearest even.
    """
    adam_step_multi([param], [grad], [exp_avg], [exp_avg_sq], out_lowps=None if out_lowp is None else [out_lowp], **hyper)


def adam_step_multi(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    div_scale: float = 1.0,
    out_lowps: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> None:
    """Adam/AdamW steps over several tensors sharing ``step`` and hyperparameters (each tensor as
    :func:`adam_step` describes its arguments).

    Args:
        step: the step number this update makes, counting from 1 (the caller increments it).
        lr, beta1, beta2, eps, weight_decay: Adam's hyperparameters.
        adamw_mode: decoupled weight decay (AdamW) when True, else L2 added to the gradient (Adam).
        bias_correction: divide by ``1 - beta**step`` (see the module docstring).
        div_scale: each gradient is divided by this first (loss scale times the inverse clip
            coefficient); 1.0 skips the division.
        out_lowps: per tensor, None or an fp16/bf16 tensor overwritten with the new parameter.

    CPU tensors go to the kernel in one call per (grad dtype, out dtype), one OpenMP region over
    all of them; tensors on other devices take torch's fused multi-tensor kernel per device.
    """
    n = len(params)
    if out_lowps is None:
        out_lowps = [None] * n
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(out_lowps) == n):
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs and out_lowps must have the same length")
    if int(step) < 1:
        raise ValueError(f"step must be >= 1 (the step this update makes), got {step}")
    if not div_scale > 0:
        raise ValueError(f"div_scale must be > 0, got {div_scale}")
    for p, g, m, v, o in zip(params, grads, exp_avgs, exp_avg_sqs, out_lowps):
        _check(p, g, m, v, o)

    kernel = kernel_available()
    native_groups: dict = defaultdict(list)
    torch_idx: List[int] = []
    for i, (p, g, m, v, o) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, out_lowps)):
        if _kernel_eligible(p, g, m, v, o):
            if kernel:
                native_groups[(g.dtype, None if o is None else o.dtype)].append(i)
                continue
            warn_fallback("CPU Adam")
        torch_idx.append(i)

    hyper = dict(
        step=int(step), lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
        weight_decay=float(weight_decay), adamw_mode=bool(adamw_mode),
        bias_correction=bool(bias_correction), div_scale=float(div_scale),
    )
    if torch_idx:
        # First, so accelerator kernels are queued before the host kernel starts: the device
        # updates its chunks while the CPU updates the host-placed ones (HybridAdam's overlap).
        _torch_adam(
            [params[i] for i in torch_idx], [grads[i] for i in torch_idx], [exp_avgs[i] for i in torch_idx],
            [exp_avg_sqs[i] for i in torch_idx], [out_lowps[i] for i in torch_idx], **hyper,
        )
    if native_groups:
        native = get_native()
        threads = torch.get_num_threads()
        for (gdt, odt), idx in native_groups.items():
            spans = [
                (
                    params[i].data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
                    0 if out_lowps[i] is None else out_lowps[i].data_ptr(), params[i].numel(),
                )
                for i in idx
            ]
            native.adam_update(
                spans, _GRAD_CODE[gdt], _OUT_CODE[odt], hyper["step"], hyper["lr"], hyper["beta1"],
                hyper["beta2"], hyper["eps"], hyper["weight_decay"], hyper["adamw_mode"],
                hyper["bias_correction"], hyper["div_scale"], threads, _forced_simd,
            )


def adam_step_lowbit(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Sequence[dict],
    *,
    master: str,
    moments: str,
    keys: Sequence[int],
    offsets: Sequence[int],
    out_lowps: Optional[Sequence[Optional[torch.Tensor]]] = None,
    **hyper: Union[int, float, bool],
) -> None:
    """:func:`adam_step_multi` with low-precision state (:mod:`elixir.optim.lowbit`): ``params``
    in the master's dtype (fp32, or bf16 for ``bf16-sr``/``bf16-kahan``), ``states[i]`` the state
    dict of ``params[i]`` in format ``moments`` (:func:`lowbit.new_state`), ``keys[i]`` and
    ``offsets[i]`` its random stream (:func:`lowbit.stream_key`) and the index of its first
    element there. ``out_lowps[i]`` (optional, fp32, fp16 or bf16) receives the new master: for
    ``bf16-kahan`` the compensated value ``p + comp``, what the forward should see. The native
    kernel on contiguous CPU tensors, else torch with the same arithmetic (bitwise the same
    results)."""
    n = len(params)
    outs = list(out_lowps) if out_lowps is not None else [None] * n
    if not (len(grads) == len(states) == len(keys) == len(offsets) == len(outs) == n):
        raise ValueError("params, grads, states, keys, offsets and out_lowps must have the same length")
    if int(hyper["step"]) < 1:
        raise ValueError(f"step must be >= 1 (the step this update makes), got {hyper['step']}")
    pdt = lowbit.master_dtype(master)
    for p, g, o in zip(params, grads, outs):
        if p.dtype != pdt:
            raise TypeError(f"master={master!r} steps {pdt} parameters, got {p.dtype}")
        if g.dtype not in GRAD_DTYPES or g.numel() != p.numel():
            raise TypeError(f"grad must be one of {GRAD_DTYPES} with {p.numel()} elements, got {g.dtype} ({g.numel()})")
        if o is not None and (o.dtype not in LOWBIT_OUT_DTYPES or o.numel() != p.numel()):
            raise TypeError(f"out_lowp must be one of {LOWBIT_OUT_DTYPES} with {p.numel()} elements")
    consts = lowbit.kernel_consts(**{k: hyper[k] for k in ("step", "lr", "beta1", "beta2", "eps", "weight_decay",
                                                          "adamw_mode", "bias_correction", "div_scale")})
    native = get_native() if hasattr(get_native(), "adam_update_lowbit") else None
    groups: dict = defaultdict(list)
    for i, (p, g, st, o) in enumerate(zip(params, grads, states, outs)):
        tensors = [p, g, o, *(st[k] for k in lowbit.state_keys(master, moments))]
        if native is not None and all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors):
            groups[(g.dtype, None if o is None else o.dtype)].append(i)
            continue
        if native is None and p.device.type == "cpu":
            warn_fallback("CPU Adam with low-precision state")
        lowbit.adam_step_lowbit_torch(p, g, st, o, master=master, moments=moments, key=keys[i], offset=offsets[i],
                                      consts=consts)
    threads = torch.get_num_threads()
    for (gdt, odt), idx in groups.items():
        spans = []
        for i in idx:
            st = states[i]
            ptr = {k: st[k].data_ptr() if k in st else 0 for k in ("exp_avg_absmax", "exp_avg_sq_absmax", "master_comp")}
            spans.append((params[i].data_ptr(), grads[i].data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                          ptr["exp_avg_absmax"], ptr["exp_avg_sq_absmax"], ptr["master_comp"],
                          0 if outs[i] is None else outs[i].data_ptr(), params[i].numel(), keys[i] & 0xFFFFFFFF,
                          offsets[i] & 0xFFFFFFFF))
        native.adam_update_lowbit(
            spans, _GRAD_CODE[gdt], lowbit.MASTER_CODE[master], lowbit.MOMENT_CODE[moments], _LOWBIT_OUT_CODE[odt],
            int(hyper["step"]), float(hyper["lr"]), float(hyper["beta1"]), float(hyper["beta2"]), float(hyper["eps"]),
            float(hyper["weight_decay"]), bool(hyper["adamw_mode"]), bool(hyper["bias_correction"]),
            float(hyper["div_scale"]), threads, _forced_simd,
        )


def _check(p, g, m, v, o) -> None:
    n = p.numel()
    if not p.is_floating_point():
        raise TypeError(f"param must be floating point, got {p.dtype}")
    if g.dtype not in GRAD_DTYPES:
        raise TypeError(f"grad dtype {g.dtype} unsupported; use one of {GRAD_DTYPES}")
    if m.dtype != p.dtype or v.dtype != p.dtype:
        raise TypeError(f"exp_avg/exp_avg_sq must have the param's dtype {p.dtype}, got {m.dtype}/{v.dtype}")
    if g.numel() != n or m.numel() != n or v.numel() != n:
        raise ValueError(f"grad, exp_avg, exp_avg_sq must have {n} elements, got {g.numel()}/{m.numel()}/{v.numel()}")
    if g.is_sparse:
        raise TypeError("sparse gradients are not supported")
    if o is not None:
        if o.dtype not in LOWP_DTYPES:
            raise TypeError(f"out_lowp dtype {o.dtype} unsupported; use one of {LOWP_DTYPES}")
        if o.numel() != n:
            raise ValueError(f"out_lowp must have {n} elements, got {o.numel()}")
    devices = {t.device for t in (p, g, m, v, o) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"param, grad, states and out_lowp must share one device, got {sorted(map(str, devices))}")


def _kernel_eligible(p, g, m, v, o) -> bool:
    tensors = [t for t in (p, g, m, v, o) if t is not None]
    return (
        p.device.type == "cpu"
        and p.dtype == torch.float32
        and all(t.is_contiguous() for t in tensors)
        and len({t.data_ptr() for t in (p, m, v)}) == 3
    )


# --------------------------------------------------------------------------------------------
# Pure-torch path: the same arithmetic, for accelerators, non-contiguous tensors and no extension.


def _f32(x: float) -> float:
    """``x`` rounded to float32, as a Python float (so torch's scalar cast is exact)."""
    return struct.unpack("f", struct.pack("f", x))[0]


#: The most gradient elements the pure-torch path widens to fp32 at once. A bf16/fp16 gradient is
#: widened (and unscaled) into a new fp32 tensor before torch's fused Adam reads it; over a whole
#: model at once that is 4 extra bytes per parameter at the step (4.4 GB at 1.1B) that neither the
#: ledger nor the search counts. Per block of at most this many elements (64 Mi: 256 MiB of fp32),
#: or one tensor when a single tensor is larger, it is a bounded transient (:func:`widen_block_bytes`).
WIDEN_BLOCK_NUMEL = 64 << 20
_widened_live = [0, 0]  # test hook: [elements widened and alive now, the most alive at once]


def widen_block_bytes(largest_numel: int) -> int:
    """The fp32 bytes the device Adam step widens at once: one block, or the largest tensor."""
    return 4 * max(WIDEN_BLOCK_NUMEL, int(largest_numel))


def _blocks(idx: Sequence[int], grads: Sequence[torch.Tensor]) -> Iterator[List[int]]:
    """``idx`` split into runs whose gradients total at most :data:`WIDEN_BLOCK_NUMEL` elements (a
    single larger tensor is a run of its own)."""
    block: List[int] = []
    size = 0
    for i in idx:
        n = grads[i].numel()  # widened, or (div_scale != 1) divided into a new fp32 tensor
        if block and size + n > WIDEN_BLOCK_NUMEL:
            yield block
            block, size = [], 0
        block.append(i)
        size += n
    if block:
        yield block


def _torch_adam(params, grads, exp_avgs, exp_avg_sqs, out_lowps, **hyper) -> None:
    """:func:`_torch_adam_block` over blocks of tensors, so at most one block of gradients is
    widened to fp32 at a time (see :data:`WIDEN_BLOCK_NUMEL`)."""
    for block in _blocks(range(len(params)), grads):
        _torch_adam_block(*([xs[i] for i in block] for xs in (params, grads, exp_avgs, exp_avg_sqs, out_lowps)), **hyper)


def _torch_adam_block(params, grads, exp_avgs, exp_avg_sqs, out_lowps, *, step, lr, beta1, beta2, eps,
                      weight_decay, adamw_mode, bias_correction, div_scale) -> None:
    grads32 = [_unscaled(g, div_scale) for g in grads]
    widened = sum(g.numel() for g, g0 in zip(grads32, grads) if g is not g0)
    _widened_live[0] += widened
    _widened_live[1] = max(_widened_live[1], _widened_live[0])
    try:
        _torch_adam_widened(params, grads32, exp_avgs, exp_avg_sqs, out_lowps, step=step, lr=lr, beta1=beta1,
                            beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                            bias_correction=bias_correction)
    finally:
        _widened_live[0] -= widened


def _torch_adam_widened(params, grads32, exp_avgs, exp_avg_sqs, out_lowps, *, step, lr, beta1, beta2, eps,
                        weight_decay, adamw_mode, bias_correction) -> None:
    fused_idx, explicit_idx = [], []
    for i, p in enumerate(params):
        fusable = bias_correction and p.dtype == torch.float32 and p.is_contiguous()
        fusable = fusable and exp_avgs[i].is_contiguous() and exp_avg_sqs[i].is_contiguous()
        (fused_idx if fusable else explicit_idx).append(i)
    by_device: dict = defaultdict(list)
    for i in fused_idx:
        by_device[params[i].device].append(i)
    fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    for device, idx in by_device.items():
        steps = [torch.full((), float(step), dtype=torch.float32, device=device)] * len(idx)
        try:
            fused(
                [params[i] for i in idx], [grads32[i].contiguous() for i in idx], [exp_avgs[i] for i in idx],
                [exp_avg_sqs[i] for i in idx], [], steps, lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
            )
        except (RuntimeError, NotImplementedError):  # no fused kernel for this device
            explicit_idx.extend(idx)
    for i in explicit_idx:
        _explicit_adam(params[i], grads32[i], exp_avgs[i], exp_avg_sqs[i], step=step, lr=lr, beta1=beta1,
                       beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                       bias_correction=bias_correction)
    for p, o in zip(params, out_lowps):
        if o is not None:
            o.copy_(p.reshape(o.shape))


def _unscaled(grad: torch.Tensor, div_scale: float) -> torch.Tensor:
    """``grad`` as fp32 divided by ``div_scale`` in fp32; a new tensor unless nothing changes."""
    g = grad if grad.dtype == torch.float32 else grad.float()
    if div_scale != 1.0:
        g = g / torch.tensor(_f32(div_scale), device=g.device)
    return g


def _fma(a: torch.Tensor, b, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` with one rounding (in float64: the product of two floats is exact there)."""
    b64 = b.double() if isinstance(b, torch.Tensor) else b
    return (a.double() * b64 + c.double()).float()


def _explicit_adam(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction):
    """The kernel's arithmetic in torch ops (fp32, any layout or device; low-precision params upcast)."""
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    w = _f32(1.0 - beta1)
    from_m = abs(w) < 0.5
    lerp_w = w if from_m else _f32(w - 1.0)

    def scalar(x: float) -> torch.Tensor:  # a device tensor, so division stays a true division
        return torch.tensor(_f32(x), dtype=torch.float32, device=p.device)

    p32, m32, v32 = p.float(), m.float(), v.float()
    if weight_decay != 0 and not adamw_mode:
        g = _fma(p32, _f32(weight_decay), g)
    if weight_decay != 0 and adamw_mode:
        p32 = p32 * _f32(1.0 - lr * weight_decay)
    m_new = _fma(g - m32, lerp_w, m32 if from_m else g)
    v_new = _fma(g * _f32(1.0 - beta2), g, v32 * _f32(beta2))
    # torch.sqrt on CPU float32 is not correctly rounded (about 1 in 6 results is 1 ulp off); the
    # float64 root rounded to float32 is, like the kernel's sqrt instruction.
    denom = torch.sqrt(v_new.double()).float() / scalar(bc2**0.5) + _f32(eps)
    p32 = p32 + (m_new * _f32(-(lr / bc1))) / denom
    m.copy_(m_new)
    v.copy_(v_new)
    p.copy_(p32)
