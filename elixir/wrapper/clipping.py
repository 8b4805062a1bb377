"""Global gradient norm over the chunked shards, and the clip coefficient torch would use.

Every element of every gradient is counted exactly once across the group: a sharded chunk's shard
gradient belongs to one rank only; a replicated chunk is held whole (and identical) on every rank,
so for p-norms only rank 0 counts it (for the inf-norm every rank may). Tied parameters are one
parameter in one chunk, so they count once by construction. Padding holds zeros.

Each chunk's norm is taken in fp32 (as torch takes each tensor's), then squared and summed across
chunks and ranks in float64; one all-reduce carries the partial sum and the inf/NaN flags
together, so the overflow decision comes for free and is identical on every rank.

Tensor parallelism (``em.tensor_parallel``): the elements of ``Shard``-placed parameters differ on
each tp rank and are summed over the tp group too; replicated ones are identical there and count
once (the partial sums travel apart, :func:`_tp_split`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from elixir import distributed as edist

if TYPE_CHECKING:
    from elixir.wrapper.interfaces import ChunkedModel


@dataclass(frozen=True)
class GradNorm:
    """A global gradient norm and whether any rank saw an inf or NaN gradient."""

    norm: float  # of the gradients as they are stored, before any pending scale factor
    found_inf: bool
    norm_type: float


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


def global_grad_norm(em: ChunkedModel, norm_type: float = 2.0) -> GradNorm:
    """The ``norm_type``-norm of all reduced gradients across the group (collective).

    Each chunk's term stays on its gradient's device until all are taken; then one copy per
    device brings them to the host (no host sync per chunk on an accelerator)."""
    p = _check_norm_type(norm_type)
    is_inf = math.isinf(p)
    tp = em.tensor_parallel
    counted = [c for c in em.chunks if c.grad_valid and c.shard_grad is not None and c.shard_grad.numel() > 0
               and (c.spec.state_sharded or is_inf or em.rank == 0)]
    terms = []  # per chunk: (replicated term, Shard-placed tensor-parallel term), on the chunk's device
    for c in counted:
        g = c.shard_grad
        if is_inf:
            lo, hi = torch.aminmax(g)  # one pass, no |g| temporary; NaN propagates
            terms.append((torch.maximum(-lo, hi).double(), None))
        elif tp is not None:
            terms.append(_tp_split(em, c, g, p))
        else:  # fp32 per chunk, as torch's per tensor (bf16/fp16 gradients are upcast on the fly)
            terms.append((_power(torch.linalg.vector_norm(g, p, dtype=torch.float32).double(), p), None))
    partial = torch.zeros((), dtype=torch.float64)
    tp_partial = torch.zeros((), dtype=torch.float64)  # of Shard-placed tensor-parallel elements
    has_inf = False
    has_nan = False
    for c, (v, v_tp) in zip(counted, _on_host(terms)):
        if is_inf:
            partial = torch.maximum(partial, v)
        else:
            partial = partial + v
            if v_tp is not None:
                tp_partial = tp_partial + v_tp
                v = v + v_tp  # (a p-th power sum: only its finiteness is read below)
        if not torch.isfinite(v):
            # find out which (the partial goes to 0 so MAX/SUM across ranks stay well defined)
            g = c.shard_grad
            finite = torch.isfinite(g)
            has_nan = has_nan or bool(torch.isnan(g).any())
            has_inf = has_inf or bool((~finite & ~torch.isnan(g)).any())
            partial = torch.zeros((), dtype=torch.float64)
            tp_partial = torch.zeros((), dtype=torch.float64)
    packed = torch.stack([partial, torch.tensor(float(has_inf), dtype=torch.float64), torch.tensor(float(has_nan), dtype=torch.float64), tp_partial])
    if has_inf or has_nan:
        packed[0] = packed[3] = 0.0
    op = torch.distributed.ReduceOp.MAX if is_inf else torch.distributed.ReduceOp.SUM
    if em.world_size > 1:
        packed = packed.to(em.device)
        edist.all_reduce(packed, em.group, op=op)
        packed = packed.cpu()
    if tp is not None:  # the flags and the Shard-placed part over tp (replicated parts are equal there)
        packed = _over_tp(packed, tp.tp_group, is_inf)
    total, any_inf, any_nan, tp_total = packed.tolist()
    total = max(total, tp_total) if is_inf else total + tp_total
    if any_nan:
        return GradNorm(float("nan"), True, p)
    if any_inf:
        return GradNorm(float("inf"), True, p)
    norm = total if is_inf else (math.sqrt(total) if p == 2.0 else total ** (1.0 / p))
    return GradNorm(norm, False, p)


def _over_tp(packed: torch.Tensor, group, is_inf: bool) -> torch.Tensor:
    """``[partial, inf, nan, tp_partial]`` reduced over the tp group: flags by MAX, the Shard-placed
    partial by SUM (by MAX for the inf-norm, where the whole vector is a max)."""
    if is_inf:
        edist.all_reduce(packed, group, op=torch.distributed.ReduceOp.MAX)
        return packed
    flags, sharded = packed[1:3].clone(), packed[3:].clone()
    edist.all_reduce(flags, group, op=torch.distributed.ReduceOp.MAX)
    edist.all_reduce(sharded, group)
    return torch.cat([packed[:1], flags, sharded])


def _tp_split(em: ChunkedModel, c, g: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(replicated, Shard-placed)`` sums of ``|g|**p`` of chunk ``c``'s shard gradient ``g``
    (fp32 per piece, as torch takes each tensor's norm)."""
    lo = c.spec.shard_offset if c.spec.state_sharded else 0
    ranges = em.tensor_parallel.sharded_ranges([em.param_map.slots[i] for i in em.param_map.by_chunk[c.index]], lo, lo + g.numel())
    mask = torch.zeros(g.numel(), dtype=torch.bool, device=g.device)
    for a, b in ranges:
        mask[a:b] = True

    def power(x: torch.Tensor) -> torch.Tensor:
        return _power(torch.linalg.vector_norm(x, p, dtype=torch.float32).double(), p)

    return power(g[~mask]), power(g[mask])


def _power(v: torch.Tensor, p: float) -> torch.Tensor:
    return v * v if p == 2.0 else v**p


def _on_host(terms: list) -> list:
    """``terms`` (pairs of 0-d float64 tensors, the second possibly None) copied to the host with
    one transfer per device they live on, in the same order."""
    flat = [t for pair in terms for t in pair if t is not None]
    by_device: dict = {}
    for i, t in enumerate(flat):
        by_device.setdefault(t.device, []).append(i)
    host: list = [None] * len(flat)
    for device, idx in by_device.items():
        stacked = torch.stack([flat[i] for i in idx])
        values = stacked if device.type == "cpu" else stacked.cpu()
        for j, i in enumerate(idx):
            host[i] = values[j]
    out, k = [], 0
    for _, b in terms:
        out.append((host[k], None if b is None else host[k + 1]))
        k += 1 if b is None else 2
    return out


def clip_coefficient(total_norm: float, max_norm: float) -> torch.Tensor:
    """torch's ``clamp(max_norm / (total_norm + 1e-6), max=1)`` in fp32, as a 0-d tensor."""
    t = torch.tensor(total_norm, dtype=torch.float32)
    coef = max_norm / (t + 1e-6)
    return torch.clamp(coef, max=1.0)
