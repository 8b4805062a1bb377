"""The footprint rule: what one chunk holds on one rank, where, and which collectives it issues.

The runtime and the cost model both ask this module, so that the bytes the search prices are the
bytes the runtime books (a rule written twice drifts: issue 30):

- the runtime's chunks book their tensors in the ledger by it (``chunk/storage.py``: whether the
  master is the shard tensor itself, :func:`master_shares_shard`; the bytes of an element,
  :func:`element_bytes`), and build each chunk's spec by it (``wrapper/chunk_builder.py``: which
  chunks stay whole at world size 1, :func:`resident_sharding`);
- the cost model prices every placement of a chunk by :func:`held_bytes` (sharded, ZeRO-1/2 and
  replicated chunks alike), counts its collectives by :func:`collectives`, and reads the dtype and
  optimizer-state byte tables here.

"A disk shard needs its optimizer state on disk too" is :func:`~elixir.plan.plan.placement_problem`
(the plan, the runtime's spec and the search's placements all check it); the byte counts here
assume a placement it accepts.

Bytes held **between uses** (resident all step), per rank, for a chunk of ``params`` compute-dtype
elements of parameters on this rank (a shard of a sharded chunk, the whole chunk of a ZeRO-1/2 one)
and ``state`` elements of fp32 master, kept gradient and optimizer state (this rank's part):

========= ============================================ ================================
what      where                                        bytes
========= ============================================ ================================
params    the shard placement (none on disk: derived)  ``params * e``
master    the optimizer placement                      ``state * 4``, 0 when it is the
                                                       shard itself
gradient  the optimizer placement (host for disk)      ``state * g``
state     the optimizer placement                      ``state * k``
disk      master and state, when placed on disk        ``state * (4 + k)``; low-precision
                                                       state at its own width
                                                       (:func:`disk_bytes_per_element`)
========= ============================================ ================================

With low-precision Adam state (``formats``: master and moments, :mod:`elixir.plan.state_format`,
issue 33) the master is its format's dtype (a bf16 master, with bf16 compute, is the shard itself),
``k`` is the moments at their width plus Kahan's buffer (:func:`optimizer_state_nbytes`: int8's
block scales by whole blocks), and a disk chunk keeps :func:`disk_bytes_per_element` on disk and
int8's block scales in host memory. The search prices by these and the runtime books by them.

Transient bytes (a gathered payload, gradient buffers, disk staging) are counted where they
happen: :data:`DISK_STAGING`, :data:`DISK_SHARD_STAGING` and :data:`CONSTRUCTION_STAGING` say how
many chunks' worth the runtime stages at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from elixir.plan.plan import Placement, Sharding, dtype_name
from elixir.plan.state_format import (
    FP32_STATE,
    QUANT_BLOCK,
    compensation_bytes,
    disk_state_bytes,
    is_lossy,
    master_dtype_name,
    moment_nbytes,
)

MASTER_BYTES = 4
"""Bytes of the fp32 master copy of one element."""
ADAM_STATE_BYTES = 8
"""Bytes of Adam's two fp32 moments for one element."""
# A trainable chunk with shard and state on disk (KK) stores no shard: each read derives it from the
# fp32 master, streamed through two read buffers of this many elements (elixir/offload/derived.py;
# the cost model counts their bytes in the disk staging)
DERIVED_SHARD_PIECE_ELEMENTS = 2 << 20
"""Elements per read buffer when a disk-resident shard is derived from its fp32 master."""
DERIVED_SHARD_READ_BUFFERS = 2
"""Read buffers a disk-resident shard is derived through (``offload/derived.py``: one read while
the other is converted), each of at most :data:`DERIVED_SHARD_PIECE_ELEMENTS` fp32 elements."""

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
"""Bytes of one element of each dtype a chunk, its master or its gradient may hold (by the name
plans use)."""

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "hybridadam": 8, "cpuadam": 8, "sgd": 4, "none": 0}
"""Elementwise fp32 optimizer state per element, by optimizer name (lower case): Adam's two
moments, SGD's momentum."""

DISK_STAGING = 3
"""Disk chunks whose master and optimizer state are in host memory at once during the fused
backward-and-step: the one a step works on, the one read ahead and the previous one still being
written (``elixir/offload/pipeline.py``: :class:`~elixir.offload.pipeline.BackwardStager` stages
this many, the store books them in the runtime ledger, the cost model prices this many). The one
setting of the staging depth: 2 finishes each write before the next chunk is staged, so the
update never overlaps a write; 3 overlaps the update of chunk ``i`` with the write of ``i+1`` and
the read of ``i-1`` (issue 35, ``bench/disk_offload.py --breakdown``). The separate step's
pipeline (:func:`~elixir.offload.pipeline.run_pipelined`) stages two."""


def disk_chunks_staged(stepped: int, disk_chunks: int, depth: int = DISK_STAGING) -> int:
    """Disk chunks the fused step holds in host memory while it steps its ``stepped``-th
    (0-based) of ``disk_chunks``: the one stepped, the one read ahead, and the writes still in
    flight, which the pipeline fills one per chunk up to ``depth - 2``
    (:class:`~elixir.offload.pipeline.BackwardStager`; the cost model's timeline prices it so)."""
    return min(disk_chunks, 2 + min(stepped, depth - 2))


# One disk shard in host memory at once: a gather reads its shard and drops it before it returns,
# even when prefetching (Chunk.gather finishes a disk shard's gather at once), and a step stages one
# shard at a time; both run on the training thread, never at once. Two were counted (a prefetched
# chunk's shard used to stay staged until the chunk was used, beside the one a step staged), one
# shard above what a KK plan ever held without prefetching (bench/memory_breakdown.py,
# tests/test_disk_plan_memory.py).
DISK_SHARD_STAGING = 1
"""Disk-resident compute shards staged in host memory at once (see the comment above)."""
CONSTRUCTION_STAGING = 2
"""fp32 chunks staged while the model is built or loaded (``wrapper/materialize.py``,
``checkpoint/pretrained.py``): the flat a chunk is assembled in, and one initialisation unit."""


def element_bytes(dtype: Union[torch.dtype, str]) -> int:
    """Bytes of one element of ``dtype`` (a torch dtype or a plan's dtype name)."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    try:
        return ELEMENT_BYTES[name]
    except KeyError:
        raise ValueError(f"no element size for dtype {name!r}; chunks hold one of {sorted(ELEMENT_BYTES)}") from None


def optimizer_state_bytes(optimizer: str) -> int:
    """Optimizer-state bytes per element of the optimizer named ``optimizer`` (any case)."""
    try:
        return OPTIMIZER_STATE_BYTES[optimizer.lower()]
    except KeyError:
        raise ValueError(f"optimizer_type {optimizer!r} not known; use one of {sorted(OPTIMIZER_STATE_BYTES)}") from None


def disk_bytes_per_element(optimizer_state_bytes: int = ADAM_STATE_BYTES,
                           formats: tuple[str, str] = ("fp32", "fp32")) -> int:
    """Bytes per shard element that a chunk whose optimizer placement is :attr:`Placement.DISK`
    keeps on disk: its fp32 master and the optimizer's elementwise state (Adam's by default), or,
    with low-precision Adam state (``formats``: master and moments, issue 33), each at its own width
    (:func:`~elixir.plan.state_format.disk_state_bytes`: bf16-sr with int8 moments 4, their block
    scales in host memory). The one rule for the cost model's disk bytes and staging, and the
    offload file's reservation."""
    if is_lossy(*formats):
        return disk_state_bytes(*formats)
    return MASTER_BYTES + optimizer_state_bytes


def _same_dtype(a: Union[torch.dtype, str], b: Union[torch.dtype, str]) -> bool:
    return (a if isinstance(a, str) else dtype_name(a)) == (b if isinstance(b, str) else dtype_name(b))


def master_shares_shard(dtype: Union[torch.dtype, str], master_dtype: Union[torch.dtype, str],
                        shard: Placement, optim: Placement) -> bool:
    """Whether the master is the compute shard's tensor itself (no bytes of its own): the compute
    dtype is the master's (fp32, or bf16 with a bf16 master) and both live in the same place, not
    on disk (a disk master is staged in a tensor of its own)."""
    return shard is optim and optim is not Placement.DISK and _same_dtype(dtype, master_dtype)


def resident_sharding(sharding: Sharding, shard: Placement, world: int, quantised: bool = False) -> Sharding:
    """The sharding a chunk runs with on ``world`` ranks: at world size 1 a device shard is the
    whole chunk, kept resident like a replicated chunk (gathering would only copy it), and so is
    a ZeRO-1/2 chunk's state; a sharded chunk whose shard lives off the device still goes through
    the rCache (a copy into a block to gather, a copy out to reduce). A ``quantised`` frozen
    chunk is always sharded: its shard is codes, dequantised into a block at each use."""
    if quantised:
        return Sharding.SHARDED
    if world == 1 and not (sharding is Sharding.SHARDED and shard is not Placement.DEVICE):
        return Sharding.REPLICATED
    return sharding


def optimizer_state_nbytes(state: int, opt_bytes: int, formats: tuple[str, str] = FP32_STATE) -> int:
    """Bytes of the optimizer state (not the master) of ``state`` elements of one flat kept in
    memory: ``opt_bytes`` each, or with low-precision Adam state (``formats``) the moments in
    their format (int8's block scales by whole blocks) and Kahan's compensation buffer."""
    if not is_lossy(*formats):
        return state * opt_bytes
    return moment_nbytes(formats[1], state) + state * compensation_bytes(formats[0])


def held_bytes(params: int, state: int, dtype: Union[torch.dtype, str], shard: Placement, optim: Placement,
               grad_bytes: int, opt_bytes: int, master_dtype: Union[torch.dtype, str] = "float32",
               formats: tuple[str, str] = FP32_STATE) -> tuple[int, int, int]:
    """(device, host, disk) bytes one chunk holds between uses on one rank (see the module doc's
    table): ``params`` compute-dtype elements of parameters kept ``shard`` (0 for a replicated
    chunk's payload when counted apart), ``state`` elements of master, kept gradient
    (``grad_bytes`` each, 0 with the fused step) and optimizer state (``opt_bytes`` each) kept
    ``optim``. A shard on disk holds nothing here: it is derived from the disk master at each read.

    With low-precision Adam state (``formats``: master and moments, issue 33; ``opt_bytes`` is then
    Adam's) the master is the format's dtype (a bf16 master is the bf16 compute shard itself, as
    an fp32 one is an fp32 shard), the state is :func:`optimizer_state_nbytes`, and a disk chunk
    keeps :func:`disk_bytes_per_element` on disk and its int8 block scales in host memory."""
    where = {Placement.DEVICE: 0, Placement.HOST: 1, Placement.DISK: 2}
    out = [0, 0, 0]
    if shard is not Placement.DISK:
        out[where[shard]] += params * element_bytes(dtype)
    if is_lossy(*formats):
        master_dtype = master_dtype_name(formats[0])
    if optim is Placement.DISK:
        # the gradient waits in host memory for the streamed step, beside int8's block scales
        scales = moment_nbytes(formats[1], state) - 2 * state if formats[1] == "int8" else 0
        out[1] += state * grad_bytes + scales
        out[2] += state * disk_bytes_per_element(opt_bytes, formats)
    else:
        master = 0 if master_shares_shard(dtype, master_dtype, shard, optim) else element_bytes(master_dtype)
        out[where[optim]] += state * (master + grad_bytes) + optimizer_state_nbytes(state, opt_bytes, formats)
    return out[0], out[1], out[2]



def state_floor_bytes(numel: int, frozen: int, dtype: Union[torch.dtype, str], world: int, kept_grad: int,
                      opt_bytes: int, disk: int = 0, frozen_elem: Optional[float] = None,
                      formats: tuple[str, str] = FP32_STATE) -> int:
    """The least memory (device and host together) per rank that ``numel`` trainable and
    ``frozen`` frozen elements hold between uses, whatever their chunks and placements, with
    ``disk`` bytes of disk per rank to offload to.

    Each trainable element costs a rank at least ``1 / world`` of :func:`held_bytes` at its
    leanest (a sharded chunk's: value, fp32 master unless the value is the master, ``kept_grad``
    and ``opt_bytes``), or only ``kept_grad`` where its chunk's master and state are on disk (at
    :func:`disk_bytes_per_element` there); a frozen element ``1 / world`` of its value, or nothing
    on disk. As many elements go to disk as it could hold (each sort on its own: a floor). The
    search's memory floor (``search/bounds.py``) and the refusal before tracing
    (``plan/budgets.py``) are both this rule. ``frozen_elem``: a frozen element's bytes when the
    frozen chunks are quantised (``plan/state_format.py:frozen_element_bytes``; default the
    compute dtype's). ``formats``: the optimizer state's (master, moments), at their bytes per
    element (int8's block scales spread over the block's elements)."""
    elem = element_bytes(dtype)
    fe = elem if frozen_elem is None else frozen_elem
    n = QUANT_BLOCK  # whole blocks: the per-element rate of int8's scales, exactly
    full = sum(held_bytes(n, n, dtype, Placement.DEVICE, Placement.DEVICE, kept_grad, opt_bytes, formats=formats)) / n
    state = (numel * full + frozen * fe) / world
    if disk > 0:
        disk_elem = disk_bytes_per_element(opt_bytes, formats)
        kept = held_bytes(0, n, dtype, Placement.DEVICE, Placement.DISK, kept_grad, opt_bytes, formats=formats)[1] / n
        per_disk = (full - kept) / world  # memory an element on disk frees
        on_disk = min(numel, -(-disk * world // max(1, disk_elem)))
        state -= on_disk * per_disk + min(frozen, -(-disk * world // max(1e-9, fe))) * fe / world
    return max(0, int(state))

@dataclass(frozen=True)
class Collectives:
    """The collectives one chunk issues on one rank in a training step.

    Attributes:
        gathers_per_use: its parameters are all-gathered into an rCache block for each use the
            cache does not hold (how many: the simulator's count for the plan's cache).
        reduction: ``"reduce_scatter"``, ``"all_reduce"`` or None: its gradient's one reduction
            per step (None at world size 1 for a resident chunk: nothing to reduce across).
        publishes: its updated parameters are all-gathered after each optimizer step (ZeRO-1/2).
    """

    gathers_per_use: bool
    reduction: Optional[str]
    publishes: bool


@functools.cache  # a handful of distinct arguments, asked per priced candidate
def collectives(sharding: Sharding, world: int, shard: Placement = Placement.DEVICE, frozen: bool = False,
                quantised: bool = False) -> Collectives:
    """The collectives of a chunk of ``sharding`` on ``world`` ranks with its shard kept ``shard``
    (a frozen chunk is gathered like any sharded chunk and never reduced; a ``quantised`` frozen
    one is gathered, and dequantised, at each use even at world size 1). At world size 1 a
    sharded chunk with an off-device shard still gathers (a copy into a block) and, trainable,
    reduces (a copy out) through the same calls."""
    sharding = resident_sharding(sharding, shard, world, quantised and frozen)
    if sharding.params_sharded:
        return Collectives(True, None if frozen else "reduce_scatter", False)
    if world == 1 or frozen:
        return Collectives(False, None, False)
    return Collectives(False, "reduce_scatter" if sharding.reduce_scatters else "all_reduce", sharding.state_sharded)
