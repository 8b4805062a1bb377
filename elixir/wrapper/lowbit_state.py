"""ElixirOptimizer's side of low-precision optimizer state (issue 33, :mod:`elixir.optim.lowbit`).

The module's :class:`~elixir.wrapper.policies.MixedPrecisionPolicy` (or its plan) names the
formats; the chunks hold masters in the master's dtype (:class:`~elixir.chunk.spec.ChunkSpec`'s
``master_dtype``); the inner CPUAdam/HybridAdam keeps each fragment's moments in the moments'
format, so host memory and the offload file (disk chunks bind every elementwise state entry to
a flat of its own dtype, :mod:`elixir.offload.state_binding`) hold the state at its own size.

State dicts and checkpoints hold each fragment's state as it is (bf16 moments and the Kahan
buffer in bf16). 8-bit moments: sharded checkpoints hold their codes and block scales as they are
(:mod:`elixir.checkpoint.quantised`, which decodes them for another layout); state dicts and mesh
checkpoints, which other layouts cut anew, the fp32 values they decode to (exactly). The format is
recorded beside them; loading into another format converts, with a warning naming the change.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Optional

import torch

from elixir.optim import lowbit
from elixir.optim.cpu_adam import CPUAdam
from elixir.plan.state_format import is_lossy

if TYPE_CHECKING:
    from elixir.wrapper.interfaces import ShardedOptimizer


def configure(eo: ShardedOptimizer, fused: bool) -> None:
    """Give the inner optimizer the module's state formats and one random stream per chunk (an
    element's index there is its place in the chunk, the same on every layout of the rank)."""
    master, moments = eo.module.state_formats
    opt = eo.optim
    if not is_lossy(master, moments):
        if isinstance(opt, CPUAdam) and opt.lossy:
            raise ValueError(
                f"{type(opt).__name__} was built with master={opt.state_format[0]!r}, moments={opt.state_format[1]!r} but "
                "the ElixirModule keeps fp32 state: put the formats in the module's MixedPrecisionPolicy(master=..., moments=...)"
            )
        return
    if not fused or not isinstance(opt, CPUAdam):
        raise ValueError(
            f"low-precision optimizer state (master={master!r}, moments={moments!r}) is stepped by elixir's fused Adam "
            f"only: build the optimizer as elixir.optim.CPUAdam or HybridAdam, not {type(opt).__name__}"
        )
    opt.set_state_format(master, moments)
    opt.rng_streams = {id(f.tensor): (f.chunk, eo.module.chunks[f.chunk].spec.shard_offset + f.lo) for f in eo.fragments}


def formats(eo: ShardedOptimizer) -> dict:
    """The recorded formats of ``eo``'s state (state dicts and checkpoints carry this)."""
    master, moments = eo.module.state_formats
    return {"master": master, "moments": moments}


def export_state(eo: ShardedOptimizer, st: Optional[dict], numel: int, decode: bool = True) -> Optional[dict]:
    """A fragment's state as state dicts and checkpoints hold it: 8-bit moments as the fp32 values
    they decode to (with ``decode=False``, meta tensors of that dtype: for the layout pass, which
    must not read disk chunks), everything else as it is."""
    if not st or eo.module.state_formats[1] != "int8" or "exp_avg_absmax" not in st:
        return st
    out = {k: v for k, v in st.items() if k not in lowbit.SCALE_KEYS}
    if decode:
        m, v = lowbit.decode_moments(st, "int8")
    else:
        m = v = torch.empty(numel, dtype=torch.float32, device="meta")
    out["exp_avg"], out["exp_avg_sq"] = m.view(st["exp_avg"].shape), v.view(st["exp_avg_sq"].shape)
    return out


def conform_loaded(eo: ShardedOptimizer, new_state: dict) -> None:
    """Convert freshly loaded fragment states (not yet bound to the disk) to the run's formats, so
    each state key keeps one dtype per chunk; the change of format is warned about by the caller."""
    if not isinstance(eo.optim, CPUAdam):
        return
    master, moments = eo.optim.state_format
    for t, st in new_state.items():
        if st and "exp_avg" in st:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # warned once, by warn_format_change
                lowbit.conform_state(st, t.numel(), master, moments)
            if not is_lossy(master, moments):
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = st[k].to(t.dtype)


def warn_format_change(saved: Optional[dict], eo: ShardedOptimizer, where: str) -> None:
    """Warn when state saved in one format is loaded into another (None: saved in fp32)."""
    saved = saved or {"master": "fp32", "moments": "fp32"}
    now = formats(eo)
    if saved != now:
        warnings.warn(
            f"elixir: {where}: optimizer state saved with master={saved['master']!r}, moments={saved['moments']!r} is "
            f"converted to master={now['master']!r}, moments={now['moments']!r} (a precision change)", stacklevel=3,
        )
