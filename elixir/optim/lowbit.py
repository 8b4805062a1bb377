"""Adam with low-precision optimizer state (issue 33): bf16 masters, bf16 or 8-bit moments.

The formats (:mod:`elixir.plan.state_format`):

- master ``"bf16-sr"``: a bf16 master; each update is computed in fp32 and rounded to bf16
  stochastically (16 random bits added below bf16's mantissa, then truncated), so rounding is
  unbiased and small updates are not lost. ``"bf16-kahan"``: a bf16 master plus a bf16
  compensation buffer ``master_comp``; the master is ``p + comp`` in fp32, rounded to nearest
  even, the residual kept in ``comp``. The compute copy a step writes (``out``: fp32, fp16 or
  bf16) is the compensated value ``p + comp``: given ``p`` alone, the forward would lag the master
  by up to half a bf16 ulp, and the gradient, taken where the weights were, pushes the loss up
  (GPT-2 124M, 500 steps: +3.07% against fp32 AdamW, issue 33).
- moments ``"bf16"``: ``exp_avg`` and ``exp_avg_sq`` in bf16, rounded stochastically (with round
  to nearest, ``exp_avg_sq``'s per-step change, ``1 - beta2`` = 0.1% of it, is below half a bf16
  ulp and it would never decay). ``"int8"``: 8-bit codes in blocks of :data:`QUANT_BLOCK` elements
  with one fp32 absmax scale per block (``exp_avg_absmax``, ``exp_avg_sq_absmax``): ``exp_avg`` as
  sign plus a 7-bit float code (4 exponent, 3 mantissa bits), ``sqrt(exp_avg_sq)`` as an 8-bit
  unsigned float code (4 exponent, 4 mantissa bits), both relative to the block's absmax — a
  dynamic code spanning 15 binades, then a linear range to 0 — and rounded stochastically. Storing
  the square root halves the range the code must span, and the kernel computes it anyway.
  A nonzero ``sqrt(exp_avg_sq)`` never rounds to 0 (that would divide by eps alone).

Random bits come from a counter-based hash of (seed, stream, step, element index)
(:func:`stream_key`, :func:`random_bits`): a stream is a chunk (or, for a plain CPUAdam, a
parameter), the index is the element's place in it, so runs are reproducible and independent of
threads, SIMD level and how the work is split. The master's rounding and the moments' draw from two
streams of one key (the moments' key is :func:`_moment_key` of it): one hash per element when only
the moments round (the common fp32-master case). The moments' hash (:func:`moment_bits`) is a
cheaper one than the master's: the 8-bit kernel's second pass is compute-bound (issue 33).

:func:`adam_step_lowbit_torch` is the same arithmetic in torch, operation by operation (fmas in
float64, correctly rounded square roots), so it matches the native kernel bit for bit; it runs
when the extension is missing. Dequantise, update and requantise are one fused pass in the kernel
(``csrc/cpu_adam_lowbit.h``).
"""

from __future__ import annotations

import math
import struct
import warnings
from typing import Optional

import torch

from elixir.plan.state_format import QUANT_BLOCK, check_state_formats, master_torch_dtype

__all__ = [
    "MASTER_CODE", "MOMENT_CODE", "QUANT_BLOCK", "stream_key", "random_bits", "moment_bits", "new_state",
    "conform_state", "decode_moments", "encode_moments", "adam_step_lowbit_torch", "kernel_consts", "master_dtype", "state_keys",
]

MASTER_CODE = {"fp32": 0, "bf16-sr": 1, "bf16-kahan": 2}
MOMENT_CODE = {"fp32": 0, "bf16": 1, "int8": 2}
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_SALT = 0x68E31DA4
_ELEM_KEYS = ("exp_avg", "exp_avg_sq", "master_comp")
SCALE_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")
_SCALE_KEYS = SCALE_KEYS
#: Every state entry whose dtype is the format's own (not the parameter's).
FORMAT_KEYS = frozenset(("exp_avg", "exp_avg_sq", "master_comp", *SCALE_KEYS))


def master_dtype(master: str) -> torch.dtype:
    """The dtype of the master copy in format ``master``."""
    return master_torch_dtype(master)


def state_keys(master: str, moments: str) -> tuple[str, ...]:
    """The state entries (besides ``step``) a parameter keeps in these formats."""
    keys = ("exp_avg", "exp_avg_sq")
    if moments == "int8":
        keys += _SCALE_KEYS
    if master == "bf16-kahan":
        keys += ("master_comp",)
    return keys


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def stream_key(seed: int, stream: int, step: int) -> int:
    """The 32-bit key of the random stream of ``stream`` (a chunk) at ``step``, for ``seed``."""
    return _mix32((seed & _M32) ^ _mix32((stream & _M32) ^ _mix32(step & _M32)))


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix32` on an int64 tensor of uint32 values (products wrap; the low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _moment_key(key: int) -> int:
    """The key of the moments' random stream, from the master's (``moment_key`` in the kernel)."""
    return _mix32((key & _M32) ^ _SALT)


def random_bits(key: int, offset: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """32 random bits (int64 tensor) for elements ``offset .. offset + n`` of stream ``key``."""
    idx = (torch.arange(n, dtype=torch.int64, device=device) + offset) & _M32
    return _mix32_t(((idx * _GOLDEN) & _M32) ^ key)


_WEYL_MUL = 0x7FEB352D
_MOM_MUL = 0x846CA68B


def moment_bits(key: int, offset: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The moments' 32 random bits (int64 tensor) for elements ``offset .. offset + n`` of the
    moments' stream ``key`` (``moment_bits`` in the kernel): a Weyl sequence
    ``(key + index * golden) * 0x7FEB352D`` (one add per element in the kernel's SIMD loop), then
    half of :func:`_mix32` (xorshift, multiply, xorshift)."""
    idx = (torch.arange(n, dtype=torch.int64, device=device) + offset) & _M32
    x = ((((idx * _GOLDEN) + key) & _M32) * _WEYL_MUL) & _M32
    x = ((x ^ (x >> 16)) * _MOM_MUL) & _M32
    return x ^ (x >> 16)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 bits as int64 values in [0, 2**32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _M32


def _from_bits(u: torch.Tensor) -> torch.Tensor:
    """fp32 from int64 values in [0, 2**32)."""
    return (((u + 2**31) & _M32) - 2**31).to(torch.int32).view(torch.float32)


def _sr_bf16(x: torch.Tensor, rb: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 stochastically with the low 16 bits of ``rb``."""
    return _from_bits(((_bits(x) + (rb & 0xFFFF)) >> 16) << 16).to(torch.bfloat16)


def _encode(y: torch.Tensor, rb: torch.Tensor, mant: int) -> torch.Tensor:
    """8-bit float code (``mant`` mantissa bits) of ``y`` >= 0, rounded with the 16 random bits
    ``rb`` (at the top of the bits the code drops): int64."""
    shift = 23 - mant
    normal = ((_bits(y) + (rb << (shift - 16))) >> shift) - (112 << mant)
    linear = (y * float(1 << (14 + mant)) + rb.to(torch.float32) * 2.0**-16).to(torch.int32).to(torch.int64)
    q = torch.where(y >= 2.0**-14, normal, linear)
    return q.clamp(max=127 if mant == 3 else 255)


def _decode(c: torch.Tensor, mant: int) -> torch.Tensor:
    c = c.to(torch.int64)
    sub = c.to(torch.float32) * (1.0 / (1 << (14 + mant)))
    return torch.where(c < (1 << mant), sub, _from_bits((c + (112 << mant)) << (23 - mant)))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D) padded with zeros to whole blocks, as (blocks, QUANT_BLOCK)."""
    pad = (-x.numel()) % QUANT_BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(-1, QUANT_BLOCK)


def _absmax(x: torch.Tensor) -> torch.Tensor:
    return _blocks(x).abs().amax(dim=1) if x.numel() else x.new_zeros(0)


def _per_element(scale: torch.Tensor, n: int) -> torch.Tensor:
    return scale.repeat_interleave(QUANT_BLOCK)[:n]


def decode_moments(st: dict, moments: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``exp_avg`` and ``exp_avg_sq`` (1-D) of state ``st`` kept in format ``moments``."""
    m, v = st["exp_avg"].reshape(-1), st["exp_avg_sq"].reshape(-1)
    if moments != "int8":
        return m.float(), v.float()
    n = m.numel()
    mag = _decode(m.to(torch.int64) & 0x7F, 3) * _per_element(st["exp_avg_absmax"], n)
    m32 = torch.where((m.to(torch.int64) & 0x80) != 0, -mag, mag)
    q = _decode(v, 4) * _per_element(st["exp_avg_sq_absmax"], n)
    return m32, q * q


def _store_moments(m: torch.Tensor, v: torch.Tensor, sq: Optional[torch.Tensor], moments: str, key: int,
                   offset: int) -> dict:
    """The state entries holding fp32 ``m``, ``v`` (``sq``: sqrt(v) when computed) in ``moments``,
    rounded with the moments' stream of ``key`` from element ``offset``."""
    if moments == "fp32":
        return {"exp_avg": m, "exp_avg_sq": v}
    h2 = moment_bits(_moment_key(key), offset, m.numel(), m.device)
    hm, hv = h2 & 0xFFFF, h2 >> 16
    if moments == "bf16":
        return {"exp_avg": _sr_bf16(m, hm), "exp_avg_sq": _sr_bf16(v, hv)}
    if sq is None:
        sq = torch.sqrt(v.double()).float()
    n = m.numel()
    mmax, vmax = _absmax(m), _absmax(sq)
    one = torch.ones((), dtype=torch.float32)
    minv = torch.where(mmax > 0, one / mmax, torch.zeros_like(mmax))
    vinv = torch.where(vmax > 0, one / vmax, torch.zeros_like(vmax))
    qm = _encode(m.abs() * _per_element(minv, n), hm, 3) | ((_bits(m) >> 24) & 0x80)
    y = sq * _per_element(vinv, n)
    qv = _encode(y, hv, 4)
    qv = torch.where((qv == 0) & (y > 0), torch.ones_like(qv), qv)
    return {"exp_avg": qm.to(torch.uint8), "exp_avg_sq": qv.to(torch.uint8), "exp_avg_absmax": mmax, "exp_avg_sq_absmax": vmax}


def encode_moments(m: torch.Tensor, v: torch.Tensor, moments: str, key: int = 0) -> dict:
    """The state entries of fp32 moments ``m``, ``v`` (1-D) converted to format ``moments``."""
    return _store_moments(m.reshape(-1).float(), v.reshape(-1).float(), None, moments, key, 0)


def new_state(numel: int, master: str, moments: str, device: torch.device | str = "cpu") -> dict:
    """Zero state (``step`` aside) of a ``numel``-element parameter in these formats."""
    check_state_formats(master, moments, where="CPUAdam")
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[moments]
    st = {"exp_avg": torch.zeros(numel, dtype=dt, device=device), "exp_avg_sq": torch.zeros(numel, dtype=dt, device=device)}
    if moments == "int8":
        blocks = -(-numel // QUANT_BLOCK)
        st["exp_avg_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=device)
        st["exp_avg_sq_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=device)
    if master == "bf16-kahan":
        st["master_comp"] = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    return st


def _moments_format_of(st: dict) -> str:
    dt = st["exp_avg"].dtype
    if dt == torch.uint8:
        return "int8" if "exp_avg_absmax" in st else "corrupt"
    return "bf16" if dt == torch.bfloat16 else "fp32"


def conform_state(st: dict, numel: int, master: str, moments: str, where: str = "") -> bool:
    """Convert state ``st`` (a loaded one, or one from another format) to these formats in place,
    with a warning naming the precision change; return whether anything changed. fp32 or bf16
    moments with the master's dtype (what a torch-format state dict loads as) convert silently
    when that is the format already."""
    if "exp_avg" not in st:
        return False
    have = _moments_format_of(st)
    if have == "corrupt":
        raise ValueError(f"optimizer state{where}: 8-bit exp_avg without its block scales (exp_avg_absmax)")
    changed = False
    want_dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[moments]
    if have != moments or st["exp_avg"].dtype != want_dt or st["exp_avg_sq"].dtype != want_dt:
        m32, v32 = decode_moments(st, have)
        for k in _SCALE_KEYS:
            st.pop(k, None)
        shape = st["exp_avg"].shape
        new = encode_moments(m32, v32, moments)
        st.update({k: (t.view(shape) if k in ("exp_avg", "exp_avg_sq") else t) for k, t in new.items()})
        if have != moments and not (have == "fp32" and moments == "fp32"):
            warnings.warn(f"elixir: optimizer state{where} converted from moments={have!r} to moments={moments!r} "
                          "(a precision change)", stacklevel=3)
        changed = True
    if master == "bf16-kahan" and "master_comp" not in st:
        st["master_comp"] = torch.zeros(numel, dtype=torch.bfloat16, device=st["exp_avg"].device)
        changed = True
    elif master != "bf16-kahan" and "master_comp" in st:
        st.pop("master_comp")
        warnings.warn(f"elixir: optimizer state{where}: the bf16 Kahan compensation is dropped (master={master!r}; "
                      "a precision change)", stacklevel=3)
        changed = True
    return changed


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def kernel_consts(*, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  adamw_mode: bool, bias_correction: bool, div_scale: float) -> dict:
    """The native kernel's per-call constants (``make_consts`` in csrc/cpu_adam.cpp), rounded to
    float where it rounds them."""
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    w = _f32(1.0 - beta1)
    from_m = abs(w) < 0.5
    c = dict(
        scale=div_scale != 1.0, div_scale=_f32(div_scale),
        wd_mode=(2 if adamw_mode else 1) if weight_decay != 0.0 else 0, wd=_f32(weight_decay),
        decay=_f32(1.0 - lr * weight_decay), lerp_w=w if from_m else _f32(w - 1.0), lerp_from_m=from_m,
        beta2=_f32(beta2), c2=_f32(1.0 - beta2), bc2_sqrt=_f32(math.sqrt(bc2)), eps=_f32(eps), neg_step=_f32(-(lr / bc1)),
    )
    # 8-bit moments divide once (csrc q8_step, q8_eps): p + (neg_step * bc2_sqrt * m) / (sqrt(v) + eps * bc2_sqrt)
    c["q8_step"], c["q8_eps"] = _f32(c["neg_step"] * c["bc2_sqrt"]), _f32(c["eps"] * c["bc2_sqrt"])
    return c


def _fma(a: torch.Tensor, b, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once (the product of two floats is exact in float64)."""
    b64 = b.double() if isinstance(b, torch.Tensor) else b
    return (a.double() * b64 + c.double()).float()


def _moments_for_update(st: dict, moments: str, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``exp_avg`` and ``exp_avg_sq * beta2`` as the kernel computes them: for 8-bit moments
    ``d * d * (scale * scale * beta2)`` with ``d`` the decoded code (csrc q8_v_factor)."""
    if moments != "int8":
        m0, v0 = decode_moments(st, moments)
        return m0, v0 * beta2
    m0 = decode_moments(st, moments)[0]
    d = _decode(st["exp_avg_sq"].reshape(-1), 4)
    vs = st["exp_avg_sq_absmax"]
    return m0, (d * d) * _per_element((vs * vs) * beta2, d.numel())


def adam_step_lowbit_torch(p: torch.Tensor, g: torch.Tensor, st: dict, out: Optional[torch.Tensor], *, master: str,
                           moments: str, key: int, offset: int, consts: dict) -> None:
    """One step of one parameter in torch with the native kernel's arithmetic (``consts``: the
    fp32-rounded constants of :func:`kernel_consts`)."""
    c = consts
    n = p.numel()
    gf = g.reshape(-1).float()
    if c["scale"]:
        gf = gf / torch.tensor(c["div_scale"], dtype=torch.float32)
    pf = p.reshape(-1).float()
    if master == "bf16-kahan":
        pf = pf + st["master_comp"].reshape(-1).float()
    m0, v_beta2 = _moments_for_update(st, moments, c["beta2"])
    if c["wd_mode"] == 1:
        gf = _fma(pf, c["wd"], gf)
    if c["wd_mode"] == 2:
        pf = pf * c["decay"]
    mn = _fma(gf - m0, c["lerp_w"], m0 if c["lerp_from_m"] else gf)
    vn = _fma(gf * c["c2"], gf, v_beta2)
    sq = torch.sqrt(vn.double()).float()  # correctly rounded, like the sqrt instruction
    if moments == "int8":
        pf = pf + (mn * c["q8_step"]) / (sq + c["q8_eps"])
    else:
        pf = pf + (mn * c["neg_step"]) / (sq / torch.tensor(c["bc2_sqrt"], dtype=torch.float32) + c["eps"])
    if master == "fp32":
        p.copy_(pf.view(p.shape))
    elif master == "bf16-sr":
        q = _sr_bf16(pf, random_bits(key, offset, n, p.device))
        p.copy_(q.view(p.shape))
        pf = q.float()
    else:  # out (the compute copy) gets the compensated master q + comp, not q alone
        q = pf.to(torch.bfloat16)
        comp = (pf - q.float()).to(torch.bfloat16)
        st["master_comp"].copy_(comp.view(st["master_comp"].shape))
        p.copy_(q.view(p.shape))
        pf = q.float() + comp.float()
    for k, t in _store_moments(mn, vn, sq, moments, key, offset).items():
        st[k].copy_(t.view(st[k].shape))
    if out is not None:
        out.copy_(pf.view(out.shape))
