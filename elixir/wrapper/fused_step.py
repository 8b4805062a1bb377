"""The fused optimizer path: CPUAdam/HybridAdam step the fragments in one pass each.

When the inner optimizer is :class:`~elixir.optim.CPUAdam` (or HybridAdam), ElixirOptimizer does
not unscale or clip the gradients in separate passes: the combined factor goes into the kernel's
``div_scale``, and where a chunk keeps a low-precision compute shard beside its fp32 master (same
device), the kernel writes the updated parameter into that shard too (``out_lowp``), so the
runtime's copy of master into shard is not needed for that chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Container, Optional

import torch

from elixir.optim.cpu_adam import CPUAdam
from elixir.optim.functional import LOWP_DTYPES

if TYPE_CHECKING:
    from elixir.wrapper.interfaces import ShardedOptimizer


def uses_fused_path(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` takes the fused path (CPUAdam, HybridAdam and their subclasses)."""
    return isinstance(optimizer, CPUAdam)


def lowp_target(chunk) -> bool:
    """Whether the kernel writes ``chunk``'s low-precision compute shard beside its master (never
    a shard derived from its master at each read, ``KK``: nothing keeps what a step would write)."""
    s, m = chunk.shard, chunk.master
    return (s is not None and s is not m and s.dtype in LOWP_DTYPES and s.device == m.device and s.is_contiguous()
            and not chunk.storage.shard_is_derived())


def fused_step(eo: ShardedOptimizer, div_scale: float, skip: Container[int] = (), only: Optional[int] = None) -> set[int]:
    """Step every fragment that has a gradient with ``div_scale`` (of chunk ``only`` when given,
    none of the chunks in ``skip``); return the chunks whose compute shard now equals their master
    cast down (written by the kernel, or the master itself)."""
    em = eo.module
    params, grads, outs = [], [], []
    for f in eo.fragments if only is None else eo.chunk_fragments(only):
        g = eo.grad_of(f)  # fp32, or bf16/fp16 read as it is by the kernel
        if g is None or f.chunk in skip:
            continue
        c = em.chunks[f.chunk]
        params.append(f.tensor)
        grads.append(g)
        outs.append(c.shard[f.lo : f.hi] if lowp_target(c) else None)
    with torch.no_grad():
        eo.optim.step_params(params, grads, div_scale=float(div_scale), out_lowps=outs)
    # step() was bypassed: tell an LR scheduler built on the inner optimizer that it stepped
    # (the flag torch's schedulers set from their wrapper of step()). Step hooks registered on the
    # inner optimizer do not run on this path.
    eo.optim._opt_called = True
    return {c.index for c in em.chunks if c.shard is c.master or lowp_target(c)}
