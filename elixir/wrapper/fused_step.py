"""The fused optimizer path: CPUAdam/HybridAdam step the fragments in one pass each.

When the inner optimizer is :class:`~elixir.optim.CPUAdam` (or HybridAdam), ElixirOptimizer does
not unscale or clip the gradients in separate passes: the combined factor goes into the kernel's
``div_scale``, and where a chunk keeps a low-precision compute shard beside its fp32 master (same
device), the kernel writes the updated parameter into that shard too (``out_lowp``), so the
runtime's copy of master into shard is not needed for that chunk. A bf16 master's fp32 compute
shard is written so too: for ``bf16-kahan`` with the compensated value (master plus its Kahan
buffer), which the runtime's copy of the bf16 master alone would drop (the forward would lag the
optimizer by up to half a bf16 ulp per weight: +3% validation loss at GPT-2 124M, issue 33).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Container, Optional

import torch

from elixir.optim.cpu_adam import CPUAdam
from elixir.optim.functional import LOWBIT_OUT_DTYPES, LOWP_DTYPES

if TYPE_CHECKING:
    from elixir.wrapper.interfaces import ShardedOptimizer


def uses_fused_path(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` takes the fused path (CPUAdam, HybridAdam and their subclasses)."""
    return isinstance(optimizer, CPUAdam)


def shard_target(chunk) -> bool:
    """Whether the kernel writes ``chunk``'s compute shard beside its master: a low-precision
    shard, or any shard of a bf16 master (never a shard derived from its master at each read,
    ``KK``: nothing keeps what a step would write)."""
    s, m = chunk.shard, chunk.master
    dtypes = LOWP_DTYPES if m is None or m.dtype == torch.float32 else LOWBIT_OUT_DTYPES
    return (s is not None and s is not m and s.dtype in dtypes and s.device == m.device and s.is_contiguous()
            and not chunk.storage.shard_is_derived())


def fused_step(eo: ShardedOptimizer, div_scale: float, skip: Container[int] = (), only: Optional[int] = None) -> set[int]:
    """Step every fragment that has a gradient with ``div_scale`` (of chunk ``only`` when given,
    none of the chunks in ``skip``); return the chunks whose compute shard is now up to date with
    their master (written by the kernel, or the master itself)."""
    em = eo.module
    params, grads, outs, stepped = [], [], [], []
    for f in eo.fragments if only is None else eo.chunk_fragments(only):
        g = eo.grad_of(f)  # fp32, or bf16/fp16 read as it is by the kernel
        if g is None or f.chunk in skip:
            continue
        c = em.chunks[f.chunk]
        params.append(f.tensor)
        grads.append(g)
        outs.append(c.shard[f.lo : f.hi] if shard_target(c) else None)
        stepped.append(f)
    with torch.no_grad():
        eo.optim.step_params(params, grads, div_scale=float(div_scale), out_lowps=outs)
    # step() was bypassed: tell an LR scheduler built on the inner optimizer that it stepped
    # (the flag torch's schedulers set from their wrapper of step()). Step hooks registered on the
    # inner optimizer do not run on this path.
    eo.optim._opt_called = True
    fresh = {c.index for c in em.chunks if c.shard is c.master or shard_target(c)}
    if eo.optim.state_format[0] == "bf16-kahan":
        fresh |= write_compensated(eo, [f for f in stepped if f.chunk not in fresh])
    return fresh


def write_compensated(eo: ShardedOptimizer, fragments: list) -> set[int]:
    """Write the compensated bf16-kahan master (the bf16 master plus its Kahan buffer, as the
    kernel's ``out`` gets it) into the compute shards of ``fragments``, where the kernel could not
    (a shard on another device than its master); return their chunks. A shard derived from its
    master at each read (``KK``) is left alone: its read adds the compensation
    (:meth:`elixir.offload.derived.DerivedShards.compensated`)."""
    done: set[int] = set()
    with torch.no_grad():
        for f in fragments:
            c = eo.module.chunks[f.chunk]
            if c.storage.shard_is_derived():
                continue
            comp = eo.optim.state[f.tensor]["master_comp"].reshape(-1)
            c.shard[f.lo : f.hi].copy_(f.tensor.reshape(-1).float() + comp.float())
            done.add(f.chunk)
    return done
