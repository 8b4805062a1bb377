"""The cost model: per-rank memory and step time of a candidate plan, from a hardware profile.

Everything here is a formula over the :class:`~elixir.search.step_profile.StepProfile` (what the
step touches, when) and the :class:`~elixir.hardware.HardwareProfile` (what the machine can do).
No constant is fitted: bandwidths, optimizer throughput and matmul throughput all come from the
hardware profile; byte counts come from the plan and the tracer.

**Layout.** For a chunk size ``C`` the trainable parameters are packed greedily, in order of first
use, into chunks of capacity ``C`` (a multiple of ``world * ALIGN``). Tied parameters get chunks of
their own, either replicated (all-reduced gradient, whole master and optimizer state on every rank)
or sharded (``shard_shared``: gathered wherever a module uses them, gradient reduce-scattered once
both uses have contributed, optimizer state split); the search prices both and keeps the faster
that fits. A sharded tied chunk keeps its shard and optimizer state on the device (``DD``).

**Memory, per rank** (bytes; ``s = C / world`` shard elements, ``e`` the compute element size,
``r`` the reduce element size, ``k`` optimizer-state bytes per element: 8 for Adam, 4 for SGD):

- device, fixed: activation peak + buffers + ``blocks * C * e`` (rCache) + ``G * C * r`` (gradient
  buffers: ``G`` is the most chunks whose backward is in progress at once) + replicated payloads
  and their gradient buffers (+ one shard gradient ``s g`` in flight with the fused step);
- per sharded chunk, by placement of (shard, optimizer state):
  ``DD``: device ``s(e + m + g + k)``; ``DH``: device ``s e``, host ``s(4 + g + k)``;
  ``HH``: host ``s(e + m + g + k)``; ``DK``/``HK``: as ``DH``/``HH`` with master and state
  (``s(4 + k)``) on disk and up to :data:`DISK_STAGING` chunks' worth staged in host memory
  while the optimizer streams them (``elixir/offload/pipeline.py`` reads one ahead);
  ``KK``: host ``s g`` only, the shard too on disk, but derived from the master at each read
  (``s(4 + k)`` on disk: :mod:`elixir.offload.derived`), up to :data:`DISK_SHARD_STAGING` shard
  staged while gathered or stepped, plus two fp32 read buffers of up to
  :data:`~elixir.plan.DERIVED_SHARD_PIECE_ELEMENTS` each. The search turns to ``KK`` only when
  no plan fits with every shard resident: the least-gathered chunks first, as few as fit by the
  pricing's own peak (:func:`_disk_shard_plan`);
  ``m`` is 4 for the fp32 master copy, 0 when the compute dtype is fp32 and shard and master live
  together (the runtime then uses one tensor); ``g`` is the shard gradient's element size (4 in
  fp32, 2 with bf16/fp16 ``grad_dtype``), and 0 with the fused backward-and-step, which frees each
  chunk's gradient as soon as it has stepped the chunk (:mod:`elixir.wrapper.backward_step`);
- host, transient: :func:`transient_host_bytes`, the larger of the construction's staging
  (:func:`construction_staging_bytes`: :data:`CONSTRUCTION_STAGING` fp32 chunks while the model is
  materialised from meta or loaded) and the disk staging above: the two never coexist;
- host, fixed: ``process_bytes``, what the training process holds besides the model and elixir's
  own tensors (the interpreter, torch, the libraries it imported: about 0.3-0.5 GiB on a CPU box);
  :func:`~elixir.search.optimal.optimal_search` measures it as this process's RSS less the bytes
  of the model it plans (the most over the ranks of an initialised process group);
- a safety margin (:class:`MemoryPolicy`) is held back from each budget for allocator
  fragmentation and workspaces that the tracer does not see.

Each term is counted at its own peak. Where device and host are one pool (a CPU box) the pool's
peak is not their sum but the most live at one moment: :func:`timeline_peak` walks the traced
steps (construction; each forward step with its activations and a ``KK`` gather's shard; each
backward step with its activations, the gradient buffers then open and, from the first disk
chunk whose gradient is final on, the fused step's disk staging; after backward) and
``memory["not_at_once"]`` (a host term, <= 0) is the difference. A plan with trainable disk
chunks counts the activations' heap slack of :meth:`HardwareProfile.step_extra_bytes` with
``streams_from_disk`` instead of without (``Setting.heap_slack_bytes``), one whose only disk bytes are
frozen shards none: both run under :func:`elixir.device.return_host_memory`.

**Time, per step** (seconds): compute (``flops`` over the profile's measured training
throughput at that size, or its matmul throughput) + all-gathers (one per simulated
gather, ``all_gather_time(C e)``) + reduce-scatters (one per sharded chunk) + all-reduces of
replicated chunks + host->device copies of host shards at each gather (none on a CPU-only
profile: :func:`gather_h2d_seconds`) + per-placement optimizer
phase (device Adam; or grad shard device->host, host Adam, updated shard host->device; plus disk
read and write of master and state; a ``KK`` chunk's fp32 master is also read at each of its
gathers, before the gather and not overlapped, to derive its shard). With ``overlap`` hardware and a prefetch depth >= 1,
communication during forward/backward hides under compute: ``max(compute, comm) + one gather``.
With the fused backward-and-step the disk transfers run on the I/O threads while backward
computes (:meth:`~elixir.search.step_profile.StepProfile.backward_share` of the compute: two
thirds, as backward costs twice the forward's FLOPs; three quarters with recompute), so up to that much
of the disk time hides, less one chunk's read that nothing precedes; the optimizer arithmetic
itself runs on the same cores as backward and hides nothing on a CPU box.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Optional, Sequence

import numpy as np

from elixir.hardware.profile import HardwareProfile
from elixir.plan import MeshLayout, Placement, Sharding, state_format
from elixir.plan.budgets import MemoryPolicy, unified_memory  # noqa: F401 - the budgets' margins and pools, re-exported here
from elixir.plan.footprint import (  # the one footprint rule, shared with the runtime
    CONSTRUCTION_STAGING,
    DERIVED_SHARD_PIECE_ELEMENTS,
    DERIVED_SHARD_READ_BUFFERS,
    DISK_SHARD_STAGING,
    DISK_STAGING,
    MASTER_BYTES,
    collectives,
    disk_bytes_per_element,
    disk_chunks_staged,
    element_bytes,
    held_bytes,
    resident_sharding,
)
from elixir.plan.placement import DD, DH, DK, HD, HH, HK, KK, RD, RH, SHARDED_PLACEMENTS, ChunkPlacement
from elixir.search.gather_windows import gather_windows
from elixir.search.minimum_waste import ALIGN  # both searches align shards alike
from elixir.search.simulator import AccessTrace, simulate
from elixir.search.step_profile import BACKWARD, StepProfile

# the host terms of Evaluation.memory (the rest are device terms)
HOST_TERMS = ("process", "placed_host", "staging", "not_at_once")


@dataclass(frozen=True)
class Layout:
    """Chunks for one chunk size: names per chunk, which are sharded, and the cache trace."""

    chunk_size: int
    chunks: tuple[tuple[str, ...], ...]
    capacities: tuple[int, ...]
    sharded: tuple[bool, ...]
    trace: AccessTrace  # over sharded chunks only (ids index `sharded_ids`)
    sharded_ids: tuple[int, ...]
    min_blocks: int
    grad_buffers: int  # most sharded chunks with backward in progress at once
    used: int  # parameter elements in sharded chunks of size chunk_size
    own: int = 0  # the last `own` sharded chunks hold one tied parameter each, sized to it (shard_shared)
    # frozen chunks (capacity frozen_chunk_size each, always sharded): trace ids n_sharded .. n_sharded + n_frozen - 1
    frozen: tuple[tuple[str, ...], ...] = ()
    frozen_chunk_size: int = 0
    zero: int = 0  # the `zero` chunks after the sharded ones are ZeRO-1/2: parameters whole, state split

    @property
    def block_size(self) -> int:
        """Elements of one rCache block: the larger of the trainable and the frozen chunk size."""
        return max(self.chunk_size, self.frozen_chunk_size if self.frozen else 0)

    @property
    def n_sharded(self) -> int:
        return len(self.sharded_ids)

    @property
    def n_frozen(self) -> int:
        return len(self.frozen)

    @cached_property
    def zero_capacities(self) -> tuple[int, ...]:
        """Capacities of the ZeRO-1/2 chunks (the ``zero`` chunks right after the sharded ones)."""
        n = self.n_sharded
        return tuple(self.capacities[n : n + self.zero])

    @cached_property
    def replicated_capacities(self) -> tuple[int, ...]:
        """Capacities of the replicated chunks (every chunk neither sharded nor ZeRO-1/2)."""
        return tuple(self.capacities[self.n_sharded + self.zero :])

    @cached_property
    def own_capacities(self) -> tuple[int, ...]:
        """Capacities of the sharded tied chunks (the last ``own`` sharded chunks)."""
        n = self.n_sharded
        return tuple(self.capacities[n - self.own : n]) if self.own else ()

    @cached_property
    def gathers_by_blocks(self) -> dict[int, np.ndarray]:
        """:func:`simulate_layout`'s answers for this layout, by block count (filled by it)."""
        return {}

    @cached_property
    def solo_frozen_gathers_by_blocks(self) -> dict[int, np.ndarray]:
        """:func:`solo_resident_gathers`' simulations of the frozen chunks alone, by block count."""
        return {}

    @cached_property
    def figures(self) -> dict[tuple, tuple]:
        """Figures of this layout on one hardware (:func:`per_hardware`, which fills it)."""
        return {}


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class _PackContext:
    """What packing needs from a profile, precomputed once as arrays."""

    sh_names: tuple[str, ...]  # untied params in use order
    sh_numel: tuple[int, ...]
    shared: tuple[tuple[str, int], ...]  # tied params in use order, with numel
    frozen: tuple[tuple[str, int], ...]  # chunkable frozen params in use order, with numel
    acc_step: np.ndarray  # int64, step of each (step, param) access
    acc_param: np.ndarray  # int64, index into sh_names + the names of shared + the frozen names
    backward: np.ndarray  # bool per step
    n_steps: int

    @cached_property
    def sh_numel_array(self) -> np.ndarray:
        """``sh_numel`` as int64 (each layout sums it under a mask)."""
        return np.asarray(self.sh_numel, dtype=np.int64)


_CONTEXTS: dict[int, tuple[StepProfile, _PackContext]] = {}


def _context(profile: StepProfile) -> _PackContext:
    hit = _CONTEXTS.get(id(profile))
    if hit is not None and hit[0] is profile:
        return hit[1]
    numel = profile.numel
    order = profile.use_order()
    sh_names = [n for n in order if n not in profile.shared]
    frozen = profile.frozen_use_order()
    index = {n: i for i, n in enumerate(sh_names + [n for n in order if n in profile.shared] + [n for n, _ in frozen])}
    steps, params = [], []
    for t, st in enumerate(profile.steps):
        for n in st:
            i = index.get(n)
            if i is not None:
                steps.append(t)
                params.append(i)
    ctx = _PackContext(
        sh_names=tuple(sh_names), sh_numel=tuple(numel[n] for n in sh_names),
        shared=tuple((n, numel[n]) for n in order if n in profile.shared), frozen=tuple(frozen),
        acc_step=np.asarray(steps, dtype=np.int64), acc_param=np.asarray(params, dtype=np.int64),
        backward=np.asarray([k == BACKWARD for k in profile.step_kinds], dtype=bool), n_steps=len(profile.steps),
    )
    if len(_CONTEXTS) > 16:
        _CONTEXTS.clear()
    _CONTEXTS[id(profile)] = (profile, ctx)
    return ctx


def pack(profile: StepProfile, chunk_size: int, world: int, shard_shared: bool = False, zero: int = 0) -> Layout:
    """Greedy in-order packing of ``profile``'s parameters into chunks of ``chunk_size``; each tied
    parameter gets a chunk of its own, replicated, or sharded with ``shard_shared``. Frozen
    parameters are packed the same way, apart, into frozen chunks of ``chunk_size`` (sharded; they
    share the rCache, take no gradient buffer and no optimizer state). The frozen chunk size is
    :func:`frozen_chunk_size`: adapters are small, so trainable chunks may be far smaller than the
    frozen weights they adapt. The ``zero`` body chunks used in the most steps (those a small rCache
    gathers most often) become ZeRO-1/2 chunks: never gathered, so they leave the cache trace
    (:func:`zero_order`).

    The cache trace lists, per step, the sharded chunks it needs (the runtime pins a chunk only
    while a module using it runs, and the last backward step's chunks until the next backward step,
    so across any recomputation in between). A chunk's gradient buffer lives from its first backward use to
    its last (the runtime reduces it once every gradient has arrived): ``grad_buffers`` is the most
    such intervals open at once.
    """
    ctx = _context(profile)
    if ctx.sh_numel and chunk_size < max(ctx.sh_numel):
        raise ValueError(f"chunk size {chunk_size} is smaller than the largest parameter")
    chunks, param_chunk = _greedy(ctx, chunk_size)
    n_body = len(chunks)
    zero = min(max(0, int(zero)), n_body) if world > 1 else 0
    caps = [chunk_size] * n_body
    sharded = [True] * n_body
    own = len(ctx.shared) if shard_shared and world > 1 else 0
    for j, (n, k) in enumerate(ctx.shared):
        chunks.append([n])
        if own:
            param_chunk[len(ctx.sh_names) + j] = len(chunks) - 1
        caps.append(round_up(k, ALIGN * world) if own else k)
        sharded.append(bool(own))
    zero_buffers = zero_used = 0
    if zero:
        # move the chosen body chunks behind the sharded ones (sharded body, sharded tied, zero, replicated)
        key = (id(ctx), chunk_size, "zero_order")  # the same for every count (tied chunks: not in it)
        hit = _GREEDY.get(key)
        if hit is None or hit[0] is not ctx:
            hit = _GREEDY[key] = (ctx, zero_order(ctx, param_chunk, n_body), None)
        chosen = set(hit[1][:zero])
        n_sh = n_body - zero + own
        order = [i for i in range(n_body) if i not in chosen] + list(range(n_body, n_body + own)) + sorted(chosen)
        order += list(range(n_body + own, len(chunks)))
        chunks = [chunks[i] for i in order]
        caps = [caps[i] for i in order]
        sharded = [i < n_sh for i in range(len(order))]
        new_id = np.asarray(order, dtype=np.int64).argsort()  # old chunk id -> new
        param_chunk = np.where(param_chunk >= 0, new_id[np.maximum(param_chunk, 0)], -1)
        # their gradient buffers live like a sharded chunk's; they are never gathered (not in the trace)
        zero_buffers = _grad_buffer_peak(ctx, param_chunk, n_sh + zero)
        zero_used = _numel_where(ctx, param_chunk >= n_sh)
        param_chunk = np.where(param_chunk >= n_sh, -1, param_chunk)
    fsize = frozen_chunk_size(ctx, chunk_size, world)
    frozen = _pack_frozen(ctx, fsize, param_chunk, sum(sharded))
    return _layout(ctx, chunk_size, chunks, caps, sharded, param_chunk, own, frozen, fsize, zero, zero_buffers, zero_used)


def _numel_where(ctx: _PackContext, mask: np.ndarray) -> int:
    """Elements of the untied trainable parameters (``ctx.sh_names``) where ``mask`` is set."""
    k = len(ctx.sh_numel)
    return int(ctx.sh_numel_array[mask[:k]].sum()) if k else 0


_GREEDY: dict[tuple, tuple[_PackContext, list, Optional[np.ndarray]]] = {}


def _greedy(ctx: _PackContext, chunk_size: int) -> tuple[list[list[str]], np.ndarray]:
    """The untied parameters packed in use order into chunks of ``chunk_size`` (fresh copies of
    a remembered packing: the search packs each size once per count of ZeRO-1/2 chunks)."""
    hit = _GREEDY.get((id(ctx), chunk_size))
    if hit is None or hit[0] is not ctx:
        param_chunk = np.full(len(ctx.sh_names) + len(ctx.shared) + len(ctx.frozen), -1, dtype=np.int64)
        chunks: list[list[str]] = []
        used, c = chunk_size + 1, -1
        for i, (n, k) in enumerate(zip(ctx.sh_names, ctx.sh_numel)):
            if used + k > chunk_size:
                chunks.append([])
                c += 1
                used = 0
            chunks[-1].append(n)
            param_chunk[i] = c
            used += k
        if len(_GREEDY) > 1024:
            _GREEDY.clear()
        hit = _GREEDY[(id(ctx), chunk_size)] = (ctx, chunks, param_chunk)
    return [list(c) for c in hit[1]], hit[2].copy()


def zero_order(ctx: _PackContext, param_chunk: np.ndarray, n_body: int) -> list[int]:
    """Body chunks by how many steps use them, most first (ties: plan order): the chunks whose
    gathers a ZeRO-1/2 chunk saves most."""
    if not ctx.acc_step.size:
        return list(range(n_body))
    c = param_chunk[ctx.acc_param]
    keep = (c >= 0) & (c < n_body)
    uses = np.zeros(n_body, dtype=np.int64)
    pairs = np.unique(ctx.acc_step[keep] * n_body + c[keep])
    np.add.at(uses, pairs % n_body, 1)
    return sorted(range(n_body), key=lambda i: (-int(uses[i]), i))


def _grad_buffer_peak(ctx: _PackContext, param_chunk: np.ndarray, n: int) -> int:
    """The most of chunks ``0..n-1`` whose backward is in progress at once (first to last
    backward use: the runtime reduces a chunk once all its gradients arrived)."""
    if not n or not ctx.acc_step.size:
        return 0
    c = param_chunk[ctx.acc_param]
    keep = (c >= 0) & (c < n) & ctx.backward[ctx.acc_step]
    if not keep.any():
        return 0
    first = np.full(n, ctx.n_steps, dtype=np.int64)
    last = np.full(n, -1, dtype=np.int64)
    np.minimum.at(first, c[keep], ctx.acc_step[keep])
    np.maximum.at(last, c[keep], ctx.acc_step[keep])
    has = last >= 0
    delta = np.zeros(ctx.n_steps + 1, dtype=np.int64)
    np.add.at(delta, first[has], 1)
    np.add.at(delta, last[has] + 1, -1)
    return int(np.cumsum(delta).max())


def frozen_chunk_size(ctx: _PackContext, chunk_size: int, world: int) -> int:
    """The frozen chunks' capacity for trainable chunks of ``chunk_size``: that size, or the
    largest frozen parameter (aligned) when it is larger."""
    big = max((k for _, k in ctx.frozen), default=0)
    return max(chunk_size, round_up(big, ALIGN * world)) if big else 0


def _pack_frozen(ctx: _PackContext, chunk_size: int, param_chunk: np.ndarray, first_id: int) -> list[list[str]]:
    """Greedy in-order packing of the frozen parameters into chunks of ``chunk_size``, numbered
    from ``first_id`` in ``param_chunk``."""
    base = len(ctx.sh_names) + len(ctx.shared)
    chunks: list[list[str]] = []
    used = chunk_size + 1
    for j, (n, k) in enumerate(ctx.frozen):
        if used + k > chunk_size:
            chunks.append([])
            used = 0
        chunks[-1].append(n)
        param_chunk[base + j] = first_id + len(chunks) - 1
        used += k
    return chunks


def _layout(ctx: _PackContext, chunk_size: int, chunks: list, caps: list, sharded: list,
            param_chunk: np.ndarray, own: int = 0, frozen: Sequence[Sequence[str]] = (),
            frozen_size: int = 0, zero: int = 0, zero_buffers: int = 0, zero_used: int = 0) -> Layout:
    """The cache trace and counts for chunks; ``param_chunk[i]`` is the sharded chunk of the i-th
    name of ``ctx.sh_names`` then ``ctx.shared`` then ``ctx.frozen`` (-1 if it is in no sharded
    chunk). Sharded chunks come first, the ``own`` sharded tied chunks last among them, then (in
    the trace only) the frozen chunks. The ``zero`` ZeRO-1/2 chunks follow the sharded ones among
    ``chunks`` but are in no trace (``param_chunk`` -1): ``zero_buffers`` is the gradient-buffer
    peak with them counted, ``zero_used`` their parameter elements."""
    n_tr = sum(sharded)
    n_sh = n_tr + len(frozen)  # chunks in the trace
    n_steps = ctx.n_steps
    grad_buffers = 0
    if n_sh and ctx.acc_step.size:
        acc_chunk = param_chunk[ctx.acc_param]
        keep = acc_chunk >= 0
        keys = np.unique(ctx.acc_step[keep] * n_sh + acc_chunk[keep])
        bw = ctx.backward[keys // n_sh]
        if bw.any():
            bk = keys[bw & (keys % n_sh < n_tr)]  # frozen chunks take no gradient buffer
            first = np.full(n_sh, n_steps, dtype=np.int64)
            last = np.full(n_sh, -1, dtype=np.int64)
            np.minimum.at(first, bk % n_sh, bk // n_sh)
            np.maximum.at(last, bk % n_sh, bk // n_sh)
            has = last >= 0
            delta = np.zeros(n_steps + 1, dtype=np.int64)
            np.add.at(delta, first[has], 1)
            np.add.at(delta, last[has] + 1, -1)
            grad_buffers = int(np.cumsum(delta).max()) if bk.size else 0
        offsets = np.searchsorted(keys // n_sh, np.arange(n_steps + 1)).astype(np.int64)
        if bw.any() and not ctx.backward.all():
            # The runtime keeps the chunks of the last backward step pinned until the next backward
            # step; recomputation (checkpointing) in between needs them resident too.
            extra = _pinned_backward_keys(ctx.backward, keys, offsets, n_sh)
            if extra.size:
                keys = np.unique(np.concatenate([keys, extra]))
                offsets = np.searchsorted(keys // n_sh, np.arange(n_steps + 1)).astype(np.int64)
        trace = AccessTrace(offsets, (keys % n_sh).astype(np.int32), n_sh)
        min_blocks = int(np.diff(offsets).max()) if n_steps else 0
    else:
        trace = AccessTrace(np.zeros(n_steps + 1, dtype=np.int64), np.zeros(0, dtype=np.int32), n_sh)
        min_blocks = 0
    return Layout(
        chunk_size=chunk_size, chunks=tuple(map(tuple, chunks)), capacities=tuple(caps),
        sharded=tuple(sharded), trace=trace, sharded_ids=tuple(range(n_tr)), min_blocks=min_blocks,
        grad_buffers=max(grad_buffers, zero_buffers),
        used=_numel_where(ctx, param_chunk >= 0) + zero_used, own=own,
        frozen=tuple(map(tuple, frozen)), frozen_chunk_size=frozen_size, zero=zero,
    )


def _pinned_backward_keys(backward: np.ndarray, keys: np.ndarray, offsets: np.ndarray, n_sh: int) -> np.ndarray:
    """The trace keys (``step * n_sh + chunk``) the pinning adds: to every non-empty step that is
    not backward, the chunks of the last non-empty backward step before it (none before the
    first). Vectorised: the search packs about a thousand layouts, each over every traced step."""
    n_steps = len(offsets) - 1
    counts = np.diff(offsets)
    steps = np.arange(n_steps)
    last_bw = np.maximum.accumulate(np.where(backward & (counts > 0), steps, -1))
    targets = steps[~backward & (counts > 0) & (last_bw >= 0)]
    if not targets.size:
        return np.zeros(0, dtype=keys.dtype)
    src = last_bw[targets]
    lengths = counts[src]
    # the positions in ``keys`` of each source step's accesses, one target after another
    ends = np.cumsum(lengths)
    pos = np.arange(int(ends[-1])) + np.repeat(offsets[src] - (ends - lengths), lengths)
    return np.repeat(targets, lengths) * n_sh + keys[pos] % n_sh


def replicate(profile: StepProfile, layout: Layout) -> Layout:
    """``layout`` with every chunk replicated (data-parallel: no gathers, gradients all-reduced,
    every rank holding the whole model and optimizer state). Capacities shrink to what each chunk
    holds, aligned. Frozen chunks stay sharded (they cost no reduction either way)."""
    ctx = _context(profile)
    numel = profile.numel
    caps = [round_up(sum(numel[n] for n in names), ALIGN) if sh else cap
            for names, cap, sh in zip(layout.chunks, layout.capacities, layout.sharded)]
    param_chunk = np.full(len(ctx.sh_names) + len(ctx.shared) + len(ctx.frozen), -1, dtype=np.int64)
    frozen = _pack_frozen(ctx, layout.frozen_chunk_size, param_chunk, 0)
    return _layout(ctx, layout.chunk_size, [list(c) for c in layout.chunks], caps, [False] * len(caps),
                   param_chunk, 0, frozen, layout.frozen_chunk_size)


# ---------------------------------------------------------------------------------------------
# placements

PLACEMENTS = SHARDED_PLACEMENTS  # what the search chooses from for a sharded chunk (shard, optimizer state)


@dataclass(frozen=True)
class Setting:
    """What is fixed for one evaluation: the mesh layout, dtypes, optimizer, hardware."""

    layout: MeshLayout  # chunks split over its dp_shard axis (:attr:`world`)
    elem: int  # compute element size
    reduce_elem: int
    opt_bytes: int  # optimizer-state bytes per element
    hardware: HardwareProfile
    dtype: str
    pin: bool = True
    grad_elem: int = 4  # shard-gradient element size (grad_dtype)
    process_bytes: int = 0  # host bytes the process holds outside elixir (interpreter, libraries)
    # the part of process_bytes that is the activations' heap slack under keep_host_memory
    # (HardwareProfile.step_extra_bytes beyond its step_untracked_bytes): a plan that streams from
    # disk gives freed blocks back at once instead (device.return_host_memory), so it holds only
    # what step_extra_bytes(streams_from_disk=True) says for trainable disk chunks, none for frozen ones
    heap_slack_bytes: int = 0
    fused_step: bool = False  # the fused backward-and-step (no persistent shard gradients)
    # frozen chunks' shards quantised ("nf4", "int8": plan/state_format.py's sizes), dequantised
    # into an rCache block at each use, even at world size 1 (footprint.resident_sharding)
    frozen_format: Optional[str] = None
    # the optimizer state's formats (plan/state_format.py, issue 33): each priced at its bytes
    # (footprint.held_bytes) and its Adam kernel's measured rate (HardwareProfile.optimizer_time)
    master_format: str = "fp32"
    moments_format: str = "fp32"

    def __post_init__(self) -> None:
        state_format.check_frozen_format(self.frozen_format, "Setting")
        state_format.check_state_formats(self.master_format, self.moments_format, "Setting")
        if element_bytes(self.dtype) != self.elem:
            raise ValueError(f"Setting: elem={self.elem} is not the element size of dtype {self.dtype!r} "
                             f"({element_bytes(self.dtype)}); pass the compute dtype's")

    @property
    def world(self) -> int:
        """Ranks a chunk is split over: the layout's ``dp_shard`` axis."""
        return self.layout.dp_shard

    @property
    def formats(self) -> tuple[str, str]:
        """The optimizer state's (master, moments) formats."""
        return self.master_format, self.moments_format

    @property
    def master_elem(self) -> int:
        """Bytes of one element of the master (fp32 4, a bf16 master 2): what a ``KK`` chunk reads
        to derive its shard."""
        return element_bytes(state_format.master_dtype_name(self.master_format))

    @property
    def derived_read_elem(self) -> int:
        """Bytes per element a ``KK`` chunk reads to derive its shard: the master, and for an fp32
        shard of a ``bf16-kahan`` master its compensation too (:mod:`elixir.offload.derived`)."""
        comp = state_format.compensation_bytes(self.master_format) if self.elem == 4 else 0
        return self.master_elem + comp

    @property
    def disk_elem(self) -> int:
        """Bytes per shard element a disk chunk keeps on disk (and stages in host memory)."""
        return disk_bytes_per_element(self.opt_bytes, self.formats)

    def held(self, params: int, state: int, shard: Placement, optim: Placement) -> tuple[int, int, int]:
        """:func:`~elixir.plan.footprint.held_bytes` of a chunk in this setting (its dtype, kept
        gradient, optimizer and state formats)."""
        return held_bytes(params, state, self.dtype, shard, optim, self.kept_grad, self.opt_bytes, formats=self.formats)

    def optimizer_time(self, params: float, where: str) -> float:
        """Seconds of the Adam step over ``params`` elements on ``where`` in this setting's formats."""
        return self.hardware.optimizer_time(params, where, self.formats)

    @property
    def frozen_elem(self) -> float:
        """Bytes per element of a frozen shard (the compute dtype's, or its quantised format's)."""
        return state_format.frozen_element_bytes(self.frozen_format, self.elem)

    def frozen_shard(self, layout: Layout) -> int:
        """Bytes of one rank's shard of one frozen chunk of ``layout`` (as the runtime books it)."""
        return state_format.frozen_shard_bytes(self.frozen_format, layout.frozen_chunk_size // self.world, self.elem)

    @property
    def kept_grad(self) -> int:
        """Bytes per element of the shard gradient kept until the optimizer step."""
        return 0 if self.fused_step else self.grad_elem


_PER_SETTING: dict[int, tuple[Setting, dict]] = {}


def _memo(st: Setting) -> dict:
    """Figures remembered for one :class:`Setting` (per shard size, capacity, placement): the
    search prices tens of thousands of candidates under one Setting, and rebuilt them each time
    (issue 35: most of a search's time). Keyed by identity; the Setting is kept alive with it."""
    hit = _PER_SETTING.get(id(st))
    if hit is None or hit[0] is not st:
        if len(_PER_SETTING) > 16:
            _PER_SETTING.clear()
        hit = _PER_SETTING[id(st)] = (st, {})
    return hit[1]


def _per_layout(st: Setting, name: str, layout: Layout, make: Callable[[], Any], zero: Optional[tuple] = None) -> Any:
    """``make()``, remembered per Setting for ``layout`` (by identity, the layout kept alive with
    it) and the ZeRO chunks' placements ``zero`` (by identity, else equality): the search prices
    each layout at many block counts and depths, and hashing its per-chunk tuples for a key cost
    more than the figures (issue 35)."""
    memo = _memo(st)
    key = (name, id(layout))
    hit = memo.get(key)
    if hit is None or hit[0] is not layout or not (hit[1] is zero or hit[1] == zero):
        hit = memo[key] = (layout, zero, make())
    return hit[2]


def per_hardware(st: Setting, layout: Layout, name: str, make: Callable[[], Any], *inputs: Any) -> Any:
    """``make()``, remembered on ``layout`` for what of ``st`` its collectives depend on (the
    hardware, the compute and reduction element sizes, the ranks, the dtype) and ``inputs`` (by
    identity; tuples also by equality): the same for every configuration the search prices on one machine
    (fp32 gradients, the lean one, the report's unconstrained one), which differ in what they
    keep, not in what they move."""
    key = (name, id(st.hardware), st.elem, st.reduce_elem, st.world, st.dtype, st.frozen_format)
    hit = layout.figures.get(key)
    if (hit is None or hit[0] is not st.hardware
            or not all(a is b or (isinstance(a, tuple) and a == b) for a, b in zip(hit[1], inputs))):
        hit = layout.figures[key] = (st.hardware, inputs, make())
    return hit[2]


def per_chunk_bytes(st: Setting, shard: int) -> dict[ChunkPlacement, tuple[int, int, int]]:
    """(device, host, disk) bytes of one sharded chunk's state for each placement (remembered per
    Setting: read it, do not change it)."""
    memo = _memo(st)
    hit = memo.get(("bytes", shard))
    if hit is None:
        hit = memo[("bytes", shard)] = _per_chunk_bytes(st, shard)
    return hit


def _per_chunk_bytes(st: Setting, shard: int) -> dict[ChunkPlacement, tuple[int, int, int]]:
    # DD, DH, HH, DK, HK, KK (whose shard is the master cast down: not stored), and HD (only
    # priced for given plans): elixir.plan.footprint.held_bytes, the runtime's own rule
    return {k: st.held(shard, shard, k.shard, k.optim) for k in SHARDED_PLACEMENTS + (HD,)}


def construction_staging_bytes(layout: Layout) -> int:
    """Host bytes staged while the model is built or loaded: :data:`CONSTRUCTION_STAGING` chunks
    of fp32 values (the flat a chunk is assembled in, and the values of one initialisation unit
    of a meta-built model or the rows ``load_pretrained`` reads for it)."""
    return CONSTRUCTION_STAGING * max(layout.capacities, default=0) * element_bytes("float32")


def derived_piece_bytes(shard: int, master_elem: int = MASTER_BYTES) -> int:
    """Host bytes of the read buffers a disk-resident shard of ``shard`` elements is derived
    through (held once any is read), of the master's dtype (``master_elem`` bytes)."""
    return DERIVED_SHARD_READ_BUFFERS * min(DERIVED_SHARD_PIECE_ELEMENTS, shard) * master_elem


def staging_bytes(st: Setting, shard: int, disk_chunks: int, disk_shards: int = 0) -> int:
    """Host bytes that stream the optimizer state of ``disk_chunks`` disk chunks, and the shards
    of the ``disk_shards`` among them whose shard is on disk too."""
    return (min(int(disk_chunks), DISK_STAGING) * shard * st.disk_elem
            + min(int(disk_shards), DISK_SHARD_STAGING) * shard * st.elem
            + (derived_piece_bytes(shard, st.master_elem) if disk_shards else 0))


def transient_host_bytes(layout: Layout, st: Setting, shard: int, disk_chunks: int, disk_shards: int = 0) -> int:
    """Host bytes of the two stagings, construction (:func:`construction_staging_bytes`) and disk
    (:func:`staging_bytes`), counted as the larger of the two, not their sum.

    They never coexist. Construction ends (its staging freed) before the first step stages a
    disk chunk. Freed, it is also gone from the process where disk staging exists at all: a plan
    with disk-placed optimizer state does not keep freed host memory
    (:class:`~elixir.wrapper.ElixirModule` skips :func:`elixir.device.keep_host_memory` for it),
    so malloc returns the chunk-sized staging buffer to the OS (a separate mapping; the heap is
    trimmed after each chunk of a meta build). Without disk chunks the staging is 0 and the
    construction's buffer is counted as held for the whole run: with ``keep_host_memory`` malloc
    keeps it in its heap. Counting both (as before) over-predicted disk plans' peak RSS by two
    fp32 chunks: 0.37 GiB of the 2.70 GiB predicted for a 0.44B plan with every chunk on disk,
    1.3 GiB of 12.6 GiB at 5.2B (issue 21's measurements)."""
    return max(construction_staging_bytes(layout), staging_bytes(st, shard, disk_chunks, disk_shards))


_STEP_TABLES: dict[int, tuple[StepProfile, np.ndarray, np.ndarray]] = {}


def _step_tables(profile: StepProfile, st_elem: int) -> tuple[np.ndarray, np.ndarray]:
    """Per traced step: the activation bytes live at most in it (``profile.step_activations``,
    else the activation peak) and the elements of the largest parameter it uses (whose
    gradient autograd holds until the runtime has added it into its chunk), remembered per
    profile: the search prices many candidates of one profile."""
    hit = _STEP_TABLES.get(id(profile))
    if hit is None or hit[0] is not profile:
        n = len(profile.steps)
        act = (np.asarray(profile.step_activations, dtype=np.int64) if profile.step_activations
               else np.full(n, int(profile.activation_bytes), dtype=np.int64))
        numel = profile.numel
        largest = np.asarray([max((numel.get(x, 0) for x in names), default=0) for names in profile.steps],
                             dtype=np.int64)
        if len(_STEP_TABLES) > 16:
            _STEP_TABLES.clear()
        hit = _STEP_TABLES[id(profile)] = (profile, act, largest)
    return hit[1], hit[2]


_SPANS: dict[int, tuple[StepProfile, Layout, tuple[np.ndarray, np.ndarray]]] = {}


def _backward_spans(profile: StepProfile, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_spans`, remembered per (profile, layout): the search prices a layout many times."""
    hit = _SPANS.get(id(layout))
    if hit is None or hit[0] is not profile or hit[1] is not layout:
        if len(_SPANS) > 4096:
            _SPANS.clear()
        hit = _SPANS[id(layout)] = (profile, layout, _spans(profile, layout))
    return hit[2]


def _spans(profile: StepProfile, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """First and last backward step of each body sharded chunk (``layout.trace`` ids
    ``0 .. n_sharded - 1``; -1 for a chunk backward never touches): a chunk's gradient buffer
    is open from the first to the last, and the last is when its gradient is final (the fused
    backward-and-step steps it then)."""
    n = layout.n_sharded
    first = np.full(n, -1, dtype=np.int64)
    last = np.full(n, -1, dtype=np.int64)
    tr = layout.trace
    kinds = profile.step_kinds
    if not n or tr.n_steps != len(kinds):
        return first, last
    step_of = np.repeat(np.arange(tr.n_steps, dtype=np.int64), np.diff(tr.offsets))
    ids = tr.chunks.astype(np.int64)
    bw = np.asarray([k == BACKWARD for k in kinds], dtype=bool)[step_of] & (ids < n)
    if bw.any():
        big = np.iinfo(np.int64).max
        lo = np.full(n, big, dtype=np.int64)
        np.minimum.at(lo, ids[bw], step_of[bw])
        np.maximum.at(last, ids[bw], step_of[bw])
        first = np.where(lo == big, -1, lo)
    return first, last


def timeline_peak(profile: StepProfile, layout: Layout, st: Setting, kinds: Sequence[ChunkPlacement],
                  memory: dict[str, int], pooled_grads: bool = False) -> int:
    """The most bytes live at one moment of a step in one memory pool (device and host together,
    as on a CPU box), over a timeline of the moments whose terms differ, instead of the sum of
    every term at its own peak (which counted, e.g., the activation peak of the start of
    backward together with disk staging that begins only once a disk chunk's gradient is final).

    ``memory`` holds the terms at their own peaks (:func:`price`); ``kinds`` the body sharded
    chunks' placements. Live at every moment (``K``): the process, the placed shards, masters,
    kept gradients and optimizer state, buffers, replicated payloads, the rCache, and with ``KK``
    chunks their two read buffers (held once used). Then, the most of:

    - **construction**: ``K`` + the construction's staging;
    - **forward step t**: ``K`` + the activations live in step ``t`` + one ``KK`` shard (read
      for a gather);
    - **backward step t**: ``K`` + the activations live in step ``t`` + the gradient of the
      largest parameter step ``t`` uses + the gradient buffers of the chunks whose backward is in
      progress at ``t`` (first to last backward use; the ZeRO and tied chunks' at their peak) +
      one ``KK`` shard + with the fused step one shard gradient in flight and, from the first
      step at which a disk chunk's gradient is final (the backward stager's first stage) to the
      end of backward, :data:`DISK_STAGING` disk chunks' masters + state;
    - **after backward** (the separate step; with the fused step, chunks stepped at the end of
      backward): ``K`` + the last step's activations + the disk staging + one ``KK`` shard +
      the shard gradient in flight.

    With ``pooled_grads`` (a CPU runtime that keeps its gradient buffers for the next backward,
    :class:`elixir.chunk.GradBufferPool`) the gradient buffers' peak is resident at every moment
    after construction instead of only while backward has them open.

    Activations per step come from the tracer's per-op timeline (``profile.step_activations``);
    without it every step is priced at the activation peak. Never more than the sum of the terms."""
    total = sum(v for k, v in memory.items() if k != "frozen_shards")  # that one is inside placed_*
    n = layout.n_sharded - layout.own
    shard = layout.chunk_size // st.world if n else 0
    n_disk = sum(k.on_disk for k in kinds)
    n_kk = sum(k.shard_on_disk for k in kinds)
    masters = min(n_disk, DISK_STAGING) * shard * st.disk_elem
    pieces = derived_piece_bytes(shard, st.master_elem) if n_kk else 0
    kk = min(n_kk, DISK_SHARD_STAGING) * shard * st.elem
    always = (total - memory["activations"] - memory["grad_buffers"] - memory["param_grad"]
              - memory["grad_in_flight"] - memory["staging"] + pieces)  # frozen_shards: left out of total
    gif = memory["grad_in_flight"]
    moments = [always + construction_staging_bytes(layout)]
    act, largest = _step_tables(profile, st.elem)
    n_steps = len(profile.steps)
    bw = np.asarray([k == BACKWARD for k in profile.step_kinds], dtype=bool)
    if not bw.any():
        return total  # no traced backward: no timeline to place the terms on
    first_bw = int(np.argmax(bw)) if bw.any() else n_steps
    pool = memory["grad_buffers"] if pooled_grads else 0  # held between backwards
    moments.append(always + pool + int(act[:first_bw].max(initial=0)) + kk)  # forward
    # gradient buffers open per step: the body chunks' spans, the rest (tied, ZeRO, replicated) at their peak
    r, C = st.reduce_elem, layout.chunk_size
    first, last = _backward_spans(profile, layout)
    if layout.zero or layout.own:
        open_bufs = np.full(n_steps, layout.grad_buffers, dtype=np.int64)
    else:
        delta = np.zeros(n_steps + 1, dtype=np.int64)
        has = last >= 0
        np.add.at(delta, first[has], 1)
        np.add.at(delta, last[has] + 1, -1)
        open_bufs = np.minimum(np.cumsum(delta)[:n_steps], layout.grad_buffers)
    other_bufs = memory["grad_buffers"] - layout.grad_buffers * C * r
    staged = np.zeros(n_steps, dtype=np.int64)
    if n_disk and st.fused_step:
        ready = sorted(int(last[c]) for c, k in enumerate(kinds[: len(last)]) if k.on_disk and last[c] >= 0)
        if not ready:
            staged[first_bw:] = masters
        # the stager's writes in flight fill up one per stepped chunk (disk_chunks_staged)
        for k, t0 in enumerate(ready[: DISK_STAGING - 1]):
            staged[t0:] = disk_chunks_staged(k, n_disk) * shard * st.disk_elem
    if first_bw < n_steps:
        t = np.arange(first_bw, n_steps)
        # a parameter's gradient is in the tracer's activations until AccumulateGrad takes it,
        # and the runtime's hook (the reduction, the fused step) runs just before, so with the
        # per-step timeline it is counted already; without it, the largest one the step uses
        grads = 0 if profile.step_activations else np.minimum(largest[t] * st.elem, memory["param_grad"])
        bufs = np.full(len(t), pool, dtype=np.int64) if pooled_grads else open_bufs[t] * C * r + other_bufs
        during = act[t] + grads + bufs + staged[t]
        moments.append(always + int(during.max()) + kk + gif)
    moments.append(always + pool + int(act[-1]) + masters + kk + gif)  # after backward
    return min(total, max(moments))


def per_chunk_fixed_time(st: Setting, shard: int) -> dict[ChunkPlacement, float]:
    """Optimizer-phase seconds of one sharded chunk for each placement (gathers excluded;
    remembered per Setting: read it, do not change it)."""
    memo = _memo(st)
    hit = memo.get(("time", shard))
    if hit is None:
        hit = memo[("time", shard)] = _per_chunk_fixed_time(st, shard)
    return hit


def _per_chunk_fixed_time(st: Setting, shard: int) -> dict[ChunkPlacement, float]:
    hw = st.hardware
    grad_d2h = hw.d2h_time(shard * st.reduce_elem, st.pin)
    param_h2d = hw.h2d_time(shard * st.elem, st.pin)
    dev = st.optimizer_time(shard, "device")
    host = st.optimizer_time(shard, "host")
    disk = hw.disk_time(shard * st.disk_elem, shard * st.disk_elem)
    return {
        DD: dev,
        DH: grad_d2h + host + param_h2d,
        HH: grad_d2h + host,
        DK: grad_d2h + host + param_h2d + disk,
        HK: grad_d2h + host + disk,
        KK: grad_d2h + host + disk,  # as HK: the step writes no shard (derived at each read)
        HD: dev + hw.d2h_time(shard * st.elem, st.pin),
    }


@dataclass(frozen=True)
class Evaluation:
    """One fully placed candidate and its predictions."""

    chunk_size: int
    blocks: int
    prefetch_depth: int
    placements: tuple[ChunkPlacement, ...]  # per chunk of the layout, in its order
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    step_time: float
    breakdown: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    gathers: int = 0
    shard_shared: bool = False  # tied parameters in sharded chunks of their own (Layout.own)
    frozen_placement: Placement = Placement.DEVICE  # where every frozen chunk's shard lives
    zero: int = 0  # ZeRO-1/2 chunks in the layout (Layout.zero)


def reduction_in_flight_elements(layout: Layout, st: Setting) -> int:
    """Gradient-buffer elements the runtime holds beyond the open buffers: on a CPU device at world
    size > 1 a chunk's reduction is left running while the next chunk's gradients arrive
    (``elixir.wrapper.grad_sync.REDUCTIONS_IN_FLIGHT``, one), and its buffer lives until it completes.
    A replicated chunk's buffer is its kept gradient, counted already; a sharded tied chunk's is
    open for the whole backward and completes last (at the end of backward), so the largest body
    or ZeRO chunk is the one counted."""
    if st.world == 1 or not unified_memory(st.hardware):
        return 0
    body = [layout.chunk_size] if layout.n_sharded - layout.own else []
    return max(body + list(layout.zero_capacities), default=0)


def fixed_device_bytes(profile: StepProfile, layout: Layout, st: Setting, blocks: int) -> dict[str, int]:
    """Device bytes that do not depend on placement."""
    repl = sum(layout.replicated_capacities)
    # a sharded tied chunk larger than the others takes a larger block while gathered, and a larger
    # gradient buffer (from the first use's backward to the last's: both ends of backward)
    own_extra = sum(max(0, c - layout.chunk_size) for c in layout.own_capacities)
    out = {
        "activations": int(profile.activation_bytes),
        "buffers": int(profile.buffer_bytes),
        "rcache": (blocks * layout.block_size + (own_extra if blocks else 0)) * st.elem,
        # sharded: the most chunks whose backward is in progress at once; replicated (tied) chunks:
        # their gradients arrive at both ends of backward, so their buffers live throughout
        "grad_buffers": (layout.grad_buffers * layout.chunk_size + own_extra + repl
                         + reduction_in_flight_elements(layout, st)) * st.reduce_elem,
        "replicated": repl * st.elem,
        # autograd's gradient of one parameter, before the runtime adds it into its chunk's buffer
        "param_grad": _largest_param(profile) * st.elem,
        # fused step: the one chunk's shard gradient between its reduction and its step
        "grad_in_flight": _largest_shard(layout, st.world) * st.grad_elem if st.fused_step else 0,
    }
    if layout.own:
        out["tied_shards"] = sum(per_chunk_bytes(st, c // st.world)[DD][0] for c in layout.own_capacities)
    return out


_LARGEST: dict[int, tuple[StepProfile, int]] = {}


def _largest_param(profile: StepProfile) -> int:
    """Elements of ``profile``'s largest trainable parameter (remembered per profile:
    ``StepProfile.numel`` builds a dict at each call)."""
    hit = _LARGEST.get(id(profile))
    if hit is None or hit[0] is not profile:
        if len(_LARGEST) > 16:
            _LARGEST.clear()
        hit = _LARGEST[id(profile)] = (profile, max(profile.numel.values(), default=0))
    return hit[1]


def _largest_shard(layout: Layout, world: int) -> int:
    """Elements of the largest shard gradient one rank holds (a sharded chunk's shard or a whole
    replicated chunk)."""
    return max([layout.chunk_size // world if layout.n_sharded else 0]
               + [c // world for c in layout.own_capacities]
               + [c // world for c in layout.zero_capacities] + list(layout.replicated_capacities))


def replicated_optimizer_bytes(layout: Layout, st: Setting, where: Placement) -> tuple[int, int]:
    """(device, host) bytes of the replicated chunks' master, gradient and optimizer state, kept
    ``where`` (the device or the host); their payload is the ``replicated`` term."""
    d, h, _ = st.held(0, sum(layout.replicated_capacities), Placement.DEVICE, where)
    return d, h


_COMPUTE: dict[tuple[int, int, str], tuple[StepProfile, HardwareProfile, float]] = {}


def compute_seconds(profile: StepProfile, hw: HardwareProfile, dtype: str) -> float:
    """Forward/backward compute of one step: from the tracer's per-op costs when the profile has
    them (roofline per op, see :meth:`HardwareProfile.op_compute_time`), else ``6 N D`` FLOPs at
    the profile's training throughput. Remembered per (profile, hardware, dtype): a search asks
    for it once per candidate."""
    key = (id(profile), id(hw), dtype)
    hit = _COMPUTE.get(key)
    if hit is not None and hit[0] is profile and hit[1] is hw:
        return hit[2]
    if profile.op_costs is not None and profile.op_costs.ops:
        t = hw.op_compute_time(profile.op_costs, dtype)
    else:
        t = hw.compute_time(profile.flops(), dtype)
    if len(_COMPUTE) > 16:
        _COMPUTE.clear()
    _COMPUTE[key] = (profile, hw, t)
    return t


def replicated_optimizer_time(st: Setting, numel: int, where: Placement) -> float:
    """Optimizer-phase seconds of the replicated chunks (``numel`` elements) with their optimizer
    on the device or on the host (gradients down, parameters back up)."""
    hw = st.hardware
    if where is Placement.DEVICE or not numel:
        return st.optimizer_time(numel, "device")
    return (st.optimizer_time(numel, "host") + hw.d2h_time(numel * st.reduce_elem, st.pin)
            + hw.h2d_time(numel * st.elem, st.pin))


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2 chunks: parameters whole on every rank, master + optimizer state split


def zero_stage(st: Setting, capacity: int) -> int:
    """The faster reduction for a ZeRO chunk of ``capacity`` elements on this hardware: 1
    (all-reduce, then keep this rank's slice) or 2 (reduce-scatter). Equal memory either way."""
    memo = _memo(st)
    hit = memo.get(("stage", capacity))
    if hit is None:
        hw, r = st.hardware, capacity * st.reduce_elem
        hit = memo[("stage", capacity)] = 1 if hw.all_reduce_time(r, st.world) < hw.reduce_scatter_time(r, st.world) else 2
    return hit


def zero_chunk_bytes(st: Setting, capacity: int, where: Placement) -> tuple[int, int, int]:
    """(device, host, disk) bytes of one ZeRO-1/2 chunk with its state ``where``: the whole
    compute-dtype parameters on the device, and this rank's ``capacity / world`` elements of
    master (none in fp32 on the device: the master is the rank's slice of the parameters), kept
    gradient and optimizer state."""
    return st.held(capacity, capacity // st.world, Placement.DEVICE, where)


def zero_chunk_optimizer_time(st: Setting, capacity: int, where: Placement) -> float:
    """Optimizer-phase seconds of one ZeRO-1/2 chunk (its part only, as a sharded chunk whose
    shard is on the device); the updated parameters' all-gather is ``comm_times``'s ``publish``."""
    memo = _memo(st)
    hit = memo.get(("zero_time", capacity, where))
    if hit is None:
        hit = memo[("zero_time", capacity, where)] = per_chunk_fixed_time(st, capacity // st.world)[
            ChunkPlacement(Placement.DEVICE, where)]
    return hit


def zero_placements(st: Setting, layout: Layout, where: Placement = Placement.DEVICE) -> tuple[ChunkPlacement, ...]:
    """The search's placements of ``layout``'s ZeRO chunks: the faster stage, state ``where``."""
    def make() -> tuple[ChunkPlacement, ...]:
        kinds: dict[int, ChunkPlacement] = {}  # by capacity: one placement object per stage
        return tuple(kinds[c] if c in kinds else kinds.setdefault(
            c, ChunkPlacement(Placement.DEVICE, where, zero=zero_stage(st, c))) for c in layout.zero_capacities)
    return per_hardware(st, layout, f"zero_kinds {where.value}", make)


def comm_times(profile: StepProfile, layout: Layout, st: Setting, gathers: int,
               own_gathers: Optional[np.ndarray] = None, frozen_gathers: int = 0,
               zero: Sequence[ChunkPlacement] = ()) -> dict[str, float]:
    """Compute and collective seconds of one step; ``gathers`` counts every all-gather,
    ``own_gathers`` those of each sharded tied chunk (``layout.own_capacities``),
    ``frozen_gathers`` those of the frozen chunks (never reduced), ``zero`` the placements of
    the ZeRO-1/2 chunks (their reductions, and ``publish``: the all-gather of their updated
    parameters after the step, which nothing overlaps)."""
    per = _layout_collectives(layout, st, tuple(zero))
    n = layout.n_sharded - layout.own
    own_gathers = [] if own_gathers is None else [int(g) for g in own_gathers]
    out = {
        "compute": compute_seconds(profile, st.hardware, st.dtype),
        "all_gather": ((gathers - sum(own_gathers) - frozen_gathers) * per.gather_full if n else 0.0)
        + sum(g * t for g, t in zip(own_gathers, per.gather_own))
        + (frozen_gathers * per.gather_frozen if frozen_gathers else 0.0),
        "reduce_scatter": per.reduce_scatter,
        "all_reduce": per.all_reduce,
    }
    if per.publish is not None:
        out["publish"] = per.publish
    return out


@dataclass(frozen=True)
class _LayoutCollectives:
    """The parts of :func:`comm_times` fixed by a layout and its ZeRO-1/2 placements: the
    seconds of one all-gather of each kind of chunk, and of every reduction of a step."""

    gather_full: float  # one sharded body chunk
    gather_own: tuple[float, ...]  # each sharded tied chunk
    gather_frozen: float  # one frozen chunk
    reduce_scatter: float
    all_reduce: float
    publish: Optional[float]  # the ZeRO-1/2 chunks' all-gather after the step (None: there are none)


def _layout_collectives(layout: Layout, st: Setting, zero: tuple[ChunkPlacement, ...]) -> _LayoutCollectives:
    """:class:`_LayoutCollectives` of ``layout`` with ``zero``, remembered (:func:`per_hardware`:
    the search prices each layout at many block counts and depths, in up to three configurations)."""
    return per_hardware(st, layout, "collectives", lambda: _collectives(layout, st, zero), zero)


def _collectives(layout: Layout, st: Setting, zero: tuple[ChunkPlacement, ...]) -> _LayoutCollectives:
    hw, w = st.hardware, st.world
    seen: dict[tuple, float] = {}  # the ZeRO chunks of a layout share one capacity: each figure once

    # a gathered payload is allocated for its gather: on a CPU box its pages are faulted in again
    # each time (hw.first_touch_time; 0 on an accelerator, whose caching allocator reuses blocks)
    def gather(nbytes: float) -> float:
        return hw.all_gather_time(nbytes, w) + hw.first_touch_time(nbytes)

    # each chunk's reduction and publish, by the runtime's rule (footprint.collectives); at world
    # size 1 resident chunks reduce nothing, and price counts the off-device shards' copies
    def reduction(sharding: Sharding, c: int, kind: str) -> float:
        key = (sharding, c, kind)
        if key not in seen:
            t = hw.reduce_scatter_time if kind == "reduce_scatter" else hw.all_reduce_time
            seen[key] = t(c * st.reduce_elem, w) if collectives(sharding, w).reduction == kind else 0.0
        return seen[key]

    def publish(sharding: Sharding, c: int) -> float:
        key = (sharding, c, "publish")
        if key not in seen:
            seen[key] = hw.all_gather_time(c * st.elem, w) if collectives(sharding, w).publishes else 0.0
        return seen[key]

    own = layout.own_capacities
    zc = list(zip(layout.zero_capacities, zero))
    n = layout.n_sharded - layout.own
    rs = "reduce_scatter"
    per = _LayoutCollectives(
        gather_full=gather(layout.chunk_size * st.elem),
        gather_own=tuple(gather(c * st.elem) for c in own),
        gather_frozen=frozen_gather_time(layout, st),
        reduce_scatter=(n * reduction(Sharding.SHARDED, layout.chunk_size, rs) if n else 0.0)
        + sum(reduction(Sharding.SHARDED, c, rs) for c in own)
        + sum(reduction(k.sharding, c, rs) for c, k in zc),
        all_reduce=sum(reduction(Sharding.REPLICATED, c, "all_reduce") for c in layout.replicated_capacities)
        + sum(reduction(k.sharding, c, "all_reduce") for c, k in zc),
        publish=sum(publish(k.sharding, c) for c, k in zc) if zc else None,
    )
    return per


def frozen_gather_time(layout: Layout, st: Setting) -> float:
    """Seconds of one gather of one frozen chunk of ``layout``, as the runtime does it
    (:meth:`elixir.chunk.storage.ChunkStorage.decode_gather` for a quantised one): an unquantised
    chunk is all-gathered in the compute dtype (a device copy at world size 1); a quantised one
    all-gathers its ranks' packed shards (``world x`` :meth:`Setting.frozen_shard` bytes on the
    wire, none at world size 1) and decodes the whole chunk at the profile's measured rate
    (:meth:`~elixir.hardware.HardwareProfile.frozen_decode_time`). Either way the payload is
    allocated for the gather (its first touch on a CPU box), and so is a quantised gather's
    receive buffer at world size > 1."""
    hw, w, n = st.hardware, st.world, layout.frozen_chunk_size
    if not n:
        return 0.0
    payload = n * st.elem
    if st.frozen_format is None:
        return hw.all_gather_time(payload, w) + hw.first_touch_time(payload)
    wire = w * st.frozen_shard(layout) if w > 1 else 0
    return (hw.all_gather_time(wire, w) + hw.first_touch_time(wire + payload)
            + hw.frozen_decode_time(n, st.frozen_format, st.dtype))


def place(
    profile: StepProfile,
    layout: Layout,
    st: Setting,
    blocks: int,
    depth: int,
    budgets: tuple[int, int, int],
    allow_disk: bool,
    per_chunk_gathers: np.ndarray,
) -> Optional[Evaluation]:
    """The fastest placement of every chunk for this (chunk size, blocks, depth), or None if none fits.

    Sharded chunks are identical in memory, and their optimizer-phase time depends only on the
    placement; only host-shard gathers depend on the chunk. So the best placement keeps on the
    device the shards of the most-gathered chunks, and is found exactly by scanning ``y`` (chunks
    with optimizer state on device), with as many device shards ``x >= y`` as fit, and the fewest
    optimizer states on disk ``z`` that make host memory fit. Sharded tied chunks (``layout.own``)
    are not scanned: they stay ``DD``, priced in the fixed part.

    The scan only chooses, on the per-chunk tables (:func:`per_chunk_bytes`,
    :func:`per_chunk_fixed_time`); the chosen placement's memory and time come from
    :func:`price`, the one pricing rule, which :func:`evaluate_plan` uses too.

    On a CPU-only profile the "device" is the host: one memory pool, so ``host`` budgets the
    device and host bytes together (see :func:`unified_memory`), and ``device`` is a cap on the
    device part alone.
    """
    sc = _place_scan(profile, layout, st, blocks, depth, budgets, allow_disk, per_chunk_gathers)
    best: Optional[Evaluation] = None
    for rwhere, fwhere in _state_wheres(layout):
        cand = _place_with(sc, rwhere, fwhere)
        if cand is not None and _fits(cand, budgets, sc.unified) and (best is None or cand.step_time < best.step_time):
            best = cand
    return best


@dataclass(frozen=True)
class _PlaceScan:
    """What :func:`place` works out once per (layout, blocks, depth) and every placement it tries
    shares: the inputs, the per-chunk tables and the gather costs of host shards."""

    profile: StepProfile
    layout: Layout
    st: Setting
    blocks: int
    depth: int
    budgets: tuple[int, int, int]
    allow_disk: bool
    gathers: np.ndarray  # per chunk, as given to place (sharded, own, frozen)
    unified: bool
    n: int  # sharded chunks the scan places (sharded tied chunks excluded)
    body_gathers: np.ndarray
    own_kinds: tuple[ChunkPlacement, ...]  # the sharded tied chunks (DD) and the ZeRO chunks
    shard: int
    base_dev: int
    cb: dict
    ct: dict
    h2d_gather: float  # the host-to-device copy of one host shard, per gather
    suffix: np.ndarray  # suffix[x]: gathers of all but the x most gathered chunks
    order: np.ndarray  # the body chunks, most gathered first (ties: plan order)
    zero: tuple[ChunkPlacement, ...]  # the ZeRO chunks' placements (zero_placements)
    solo: bool  # world size 1: device-placed chunks whole and resident
    t_gather: float
    t_rs: float
    fbytes: int  # frozen_shard_bytes


def _place_scan(profile: StepProfile, layout: Layout, st: Setting, blocks: int, depth: int,
                budgets: tuple[int, int, int], allow_disk: bool, per_chunk_gathers: np.ndarray) -> _PlaceScan:
    """The shared part of :func:`place`'s scan."""
    hw = st.hardware
    n = layout.n_sharded - layout.own
    body_gathers = per_chunk_gathers[:n]
    zero = zero_placements(st, layout)  # the search keeps ZeRO state on the device
    own_kinds = (DD,) * layout.own + zero
    shard = layout.chunk_size // st.world if n else 0
    base_dev = sum(fixed_device_bytes(profile, layout, st, blocks).values())
    base_dev += _zero_bytes(st, layout, zero)[0]
    cb = per_chunk_bytes(st, shard)
    ct = per_chunk_fixed_time(st, shard)
    g_sorted = np.sort(body_gathers)[::-1]  # most gathered first
    # host-shard gather cost if the n - x least gathered chunks have host shards
    h2d_gather = gather_h2d_seconds(st, shard * st.elem) if n else 0.0
    suffix = np.concatenate([np.cumsum(g_sorted[::-1])[::-1], [0]]) if n else np.zeros(1)
    # At world size 1 the runtime keeps device-placed chunks whole and resident (no cache block,
    # no gather, no reduction copy); only host-placed shards go through the rCache.
    solo = st.world == 1
    t_gather = hw.all_gather_time(layout.chunk_size * st.elem, 1) if (solo and n) else 0.0
    t_rs = hw.reduce_scatter_time(layout.chunk_size * st.reduce_elem, 1) if (solo and n) else 0.0
    return _PlaceScan(
        profile=profile, layout=layout, st=st, blocks=blocks, depth=depth, budgets=budgets, allow_disk=allow_disk,
        gathers=per_chunk_gathers, unified=unified_memory(hw), n=n, body_gathers=body_gathers, own_kinds=own_kinds,
        shard=shard, base_dev=base_dev, cb=cb, ct=ct, h2d_gather=h2d_gather, suffix=suffix, solo=solo,
        order=np.argsort(-body_gathers, kind="stable"), zero=zero,
        t_gather=t_gather, t_rs=t_rs, fbytes=frozen_shard_bytes(layout, st),
    )


def _state_wheres(layout: Layout) -> list[tuple[Placement, Placement]]:
    """The (replicated optimizer state, frozen shards) placements :func:`place` tries."""
    n_repl = len(layout.replicated_capacities)
    return [(r, f) for r in ((Placement.DEVICE, Placement.HOST) if n_repl else (Placement.DEVICE,))
            for f in ((Placement.DEVICE, Placement.HOST, Placement.DISK) if layout.n_frozen else (Placement.DEVICE,))]


def _fits(cand: Evaluation, budgets: tuple[int, int, int], unified: bool) -> bool:
    """Whether a priced candidate keeps to the budgets (on one pool, device and host bytes together)."""
    dev_budget, host_budget, disk_budget = budgets
    if cand.device_bytes > dev_budget or cand.host_bytes > host_budget or cand.disk_bytes > disk_budget:
        return False
    return not (unified and cand.device_bytes + cand.host_bytes > host_budget)


def _place_with(sc: _PlaceScan, rwhere: Placement, fwhere: Placement) -> Optional[Evaluation]:
    """The fastest placement of the sharded chunks with the replicated chunks' optimizer state
    ``rwhere`` and the frozen shards ``fwhere``, priced; None if the fixed part alone does not fit."""
    layout, st = sc.layout, sc.st
    dev_budget, host_budget, disk_budget = sc.budgets
    repl_kinds = (RD if rwhere is Placement.DEVICE else RH,) * len(layout.replicated_capacities)
    rd, rh = replicated_optimizer_bytes(layout, st, rwhere)
    constr = construction_staging_bytes(layout)  # the transient host bytes without disk chunks
    rh += constr
    if fwhere is Placement.DEVICE:
        rd += sc.fbytes
    elif fwhere is Placement.HOST:
        rh += sc.fbytes
    else:  # on disk: one frozen shard staged at a time, while gathered
        if not sc.allow_disk or sc.fbytes > disk_budget:
            return None
        rh += st.frozen_shard(layout)
    gathered = fwhere is not Placement.DEVICE or st.frozen_format is not None
    if sc.solo and layout.n_frozen and gathered != (sc.blocks > 0) and sc.n == 0:
        return None  # at world size 1 blocks serve host (or quantised) shards only
    dev_free = dev_budget - sc.base_dev - rd
    host_free = host_budget - rh - st.process_bytes - (sc.base_dev + rd if sc.unified else 0)
    if dev_free < 0:
        return None
    if sc.n == 0:
        return price(sc.profile, layout, st, sc.own_kinds + repl_kinds, sc.blocks, sc.depth, _gathers(sc, True),
                     fwhere) if host_free >= 0 else None
    # the scan's plain sum of the terms never counts less than the pricing's peak (timeline_peak),
    # so a count it accepts fits; one it refuses may still fit: the disk-shard scan prices
    ok = np.zeros(1, dtype=bool)
    if host_free >= 0:
        y, x, z, ok = _scan_counts(sc, fwhere, dev_free, host_free, constr)
    if not ok.any():
        # no plan keeps every shard resident: the whole of the least-gathered chunks on disk
        if not (sc.allow_disk and (sc.blocks > 0 or not sc.solo)):
            return None
        return _disk_shard_plan(sc, repl_kinds, fwhere, host_free + constr)
    codes = _cheapest_codes(sc, y, x, z, ok)
    p = _priced_codes(layout, st, codes, sc.zero, repl_kinds, _gathers(sc, not _HOST_SHARD[codes].any()), fwhere)
    return _price(sc.profile, layout, st, p, sc.blocks, sc.depth)


def _gathers(sc: _PlaceScan, resident: bool) -> np.ndarray:
    """The gathers a placement is priced with: at world size 1 with every trainable shard on the
    device (``resident``), the frozen chunks' counts without the resident chunks in the cache
    (:func:`solo_resident_gathers`); else the scan's."""
    return solo_resident_gathers(sc.layout, sc.blocks, sc.gathers) if sc.solo and resident else sc.gathers


def _scan_counts(sc: _PlaceScan, fwhere: Placement, dev_free: int,
                 host_free: int, constr: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each count ``y`` of sharded chunks with optimizer state on the device, twice: with as
    many device shards ``x`` as fit, and with none beyond the ``y`` (``x = y``); the optimizer
    states ``z`` on disk that make host memory fit, and whether that fits at all (``ok``).

    A device shard whose state is on the host (``DH``, ``DK``) saves its gathers' host-to-device
    copies and costs the updated shard's copy back after each step. Where the gathers copy
    nothing (a CPU box, at world size > 1: :func:`gather_h2d_seconds`) it only costs, so the
    most that fit is not always the fastest: the scan keeps both ends."""
    n, cb, layout, st = sc.n, sc.cb, sc.layout, sc.st
    y = np.arange(n + 1)
    dd_dev = cb[DD][0]
    s_dev = cb[DH][0]
    # shards on device: all y DD chunks, plus as many DH/DK as fit (or none)
    room = dev_free - y * dd_dev
    ok = room >= 0
    x = np.minimum(n, y + np.where(ok, room, 0) // max(1, s_dev)) if s_dev else np.full(n + 1, n)
    y, x, ok = np.concatenate([y, y]), np.concatenate([x, y]), np.concatenate([ok, ok])
    # host: (x - y) DH chunks, (n - x) HH chunks; z of them move optimizer state to disk
    host_need = (x - y) * cb[DH][1] + (n - x) * cb[HH][1]
    if sc.unified:  # the chunks' device bytes come out of the same pool
        host_need = host_need + y * dd_dev + (x - y) * s_dev
    # what moving one chunk's optimizer state to disk frees: HH -> HK (taken first) and DH -> DK
    # differ where an fp32 HH chunk's master is its shard (HK keeps the shard, its master goes)
    f_host, f_dev = cb[HH][1] - cb[HK][1], cb[DH][1] - cb[DK][1]
    over = host_need - host_free
    if sc.allow_disk and f_host > 0 and f_dev > 0:
        # one disk chunk stages one chunk's master + state; two or more stage up to DISK_STAGING
        # (priced at DISK_STAGING: two chunks stage two, a little less);
        # the staging replaces the construction's in the transient bytes (transient_host_bytes)
        extra1 = transient_host_bytes(layout, st, sc.shard, 1) - constr
        extra_n = transient_host_bytes(layout, st, sc.shard, DISK_STAGING) - constr
        z1 = _chunks_to_disk(np.where(over > 0, over + extra1, 0), n - x, f_host, f_dev)
        zn = _chunks_to_disk(np.where(over > 0, over + extra_n, 0), n - x, f_host, f_dev)
        z = np.where(z1 <= 1, z1, np.maximum(zn, 2))
    else:
        z = np.where(over > 0, n + 1, 0)
    ok &= z <= n - y
    ok &= z * cb[DK][2] <= sc.budgets[2]
    if sc.solo:  # blocks only for host shards: none iff every shard is on the device
        gathered = layout.n_frozen > 0 and (fwhere is not Placement.DEVICE or st.frozen_format is not None)
        ok &= (x == n) if sc.blocks == 0 else ((x < n) | gathered)
        if gathered and sc.blocks == 0:  # a host or quantised frozen shard is gathered into a block
            ok &= False
    return y, x, z, ok


def _chunks_to_disk(need: np.ndarray, host_shards: np.ndarray, f_host: int, f_dev: int) -> np.ndarray:
    """How many chunks must move their optimizer state to disk to free ``need`` host bytes (0
    where none): first of the ``host_shards`` chunks whose shard is on the host (``f_host`` each),
    then of those whose shard is on the device (``f_dev`` each), as :func:`_cheapest_codes` moves them."""
    from_host = -(-need // f_host)
    rest = need - host_shards * f_host
    return np.where(need <= 0, 0, np.where(rest <= 0, from_host, host_shards - (-rest // f_dev)))


# the body placements _cheapest_codes chooses from, by code, and what each is
_SCAN_KINDS = (DD, DH, DK, HH, HK)
_KIND_ARRAY = np.empty(len(_SCAN_KINDS), dtype=object)
_KIND_ARRAY[:] = _SCAN_KINDS
_HOST_SHARD = np.asarray([k.shard is not Placement.DEVICE for k in _SCAN_KINDS], dtype=bool)
_DISK_SHARD = np.asarray([k.shard_on_disk for k in _SCAN_KINDS], dtype=bool)
_SOLO_GATHERED = np.asarray([collectives(Sharding.SHARDED, 1, k.shard).gathers_per_use for k in _SCAN_KINDS], dtype=bool)


def _cheapest_codes(sc: _PlaceScan, y: np.ndarray, x: np.ndarray, z: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """The sharded chunks' placements at the fastest fitting row of :func:`_scan_counts`, as
    indices into :data:`_SCAN_KINDS`: the most gathered chunks get the device shards (in rank
    order: ``y`` ``DD``, then ``DH``, ``DK``, ``HH`` and last ``HK``)."""
    n, ct = sc.n, sc.ct
    zc = np.minimum(z, n - y)
    # z disk chunks taken from the host-shard chunks first (HK), then DK
    hk = np.minimum(zc, n - x)
    dk = zc - hk
    t_opt = y * ct[DD] + (x - y - dk) * ct[DH] + dk * ct[DK] + (n - x - hk) * ct[HH] + hk * ct[HK]
    t_h2d = sc.suffix[x] * sc.h2d_gather
    if sc.solo:
        t_h2d = t_h2d + sc.suffix[x] * sc.t_gather + (n - x) * sc.t_rs
    total = np.where(ok, t_opt + t_h2d, np.inf)
    row = int(np.argmin(total))
    yi, xi, hki, dki = int(y[row]), int(x[row]), int(hk[row]), int(dk[row])
    # the rank at which each kind starts (nondecreasing: dk <= x - y, hk <= n - x)
    by_rank = np.searchsorted(np.asarray([yi, xi - dki, xi, n - hki]), np.arange(n), side="right")
    codes = np.empty(n, dtype=np.intp)
    codes[sc.order] = by_rank
    return codes


def _disk_shard_plan(sc: _PlaceScan, repl_kinds: tuple[ChunkPlacement, ...], fwhere: Placement,
                     host_free: int) -> Optional[Evaluation]:
    """The sharded chunks with every optimizer state on disk and the fewest shards on disk too
    (``KK``, the least-gathered chunks; the rest ``HK``) that fit the budgets, priced; or None.

    Whether a count fits is the pricing's own rule (:func:`price`, then :func:`_fits`): on one
    memory pool its host peak credits the terms that are never live at once
    (``memory["not_at_once"]``), which a sum of per-chunk terms cannot see (GPT-2 124M in 1.8 GiB:
    290 MiB, so the scan left that much of the budget unused and put chunks' shards on disk that
    fit on the host): :func:`_most_host_shards`. The count is remembered per layout, blocks,
    placement of the rest and budgets: the bytes do not depend on the prefetch depth, which the
    search tries several of."""
    memo = _memo(sc.st)
    key = ("disk_shards", id(sc.layout), id(sc.profile), sc.blocks, repl_kinds[:1], fwhere, sc.budgets)
    hit = memo.get(key)
    if hit is None or hit[0] is not sc.layout or hit[1] is not sc.profile:
        hit = memo[key] = (sc.layout, sc.profile, _most_host_shards(sc, repl_kinds, fwhere, host_free))
    return None if hit[2] is None else _disk_shard_priced(sc, repl_kinds, fwhere, hit[2])


def _disk_shard_priced(sc: _PlaceScan, repl_kinds: tuple[ChunkPlacement, ...], fwhere: Placement,
                       host_shards: int) -> Evaluation:
    """:func:`price` of every body chunk's optimizer state on disk, the ``host_shards`` most
    gathered keeping their shard on the host (``HK``), the rest on disk (``KK``)."""
    kinds = [KK] * sc.n
    for c in sc.order[:host_shards].tolist():
        kinds[c] = HK
    return price(sc.profile, sc.layout, sc.st, tuple(kinds) + sc.own_kinds + repl_kinds, sc.blocks, sc.depth,
                 sc.gathers, fwhere)


def _most_host_shards(sc: _PlaceScan, repl_kinds: tuple[ChunkPlacement, ...], fwhere: Placement,
                      host_free: int) -> Optional[int]:
    """The most ``HK`` chunks of :func:`_disk_shard_plan` that fit by the pricing's rule, or None.

    The plain sum of the terms (``host_free``: host bytes left for the chunks, transient bytes
    included) is never below the pricing's peak, so the most ``HK`` chunks it admits fit, and
    only the counts above are priced (where the pricing credits anything:
    :func:`credits_below_sum`). With ``v`` of the ``n`` chunks ``HK`` the host bytes grow with
    ``v`` while one ``KK`` chunk is left (the disk bytes do not depend on ``v``), so the largest
    fitting ``v < n`` is found by bisection; ``v = n`` (no disk shard: none staged) is priced on
    its own."""
    st, layout, n, cb = sc.st, sc.layout, sc.n, sc.cb

    def fits(v: int) -> bool:
        return _fits(_disk_shard_priced(sc, repl_kinds, fwhere, v), sc.budgets, sc.unified)

    if n * cb[HK][2] > sc.budgets[2]:  # the disk bytes, the same for every v
        return None
    summed = next((v for v in range(n, -1, -1) if v * cb[HK][1] + (n - v) * cb[KK][1]
                   + transient_host_bytes(layout, st, sc.shard, n, n - v) <= host_free), -1)
    if summed == n or not credits_below_sum(st):
        return summed if summed >= 0 else None
    if fits(n):
        return n
    lo = summed
    if lo < 0:
        if not fits(0):
            return None  # not even every shard on disk fits
        lo = 0
    hi = n  # fits at lo, not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def price(
    profile: StepProfile,
    layout: Layout,
    st: Setting,
    placements: Sequence[ChunkPlacement],
    blocks: int,
    depth: int,
    gathers: np.ndarray,
    frozen_where: Placement = Placement.DEVICE,
) -> Evaluation:
    """Predicted per-rank memory and step time of ``layout`` with every chunk placed: the one
    pricing rule, used by the search (:func:`place`) and by :func:`evaluate_plan`.

    ``placements`` has one entry per chunk of ``layout``, in its order: the sharded chunks, the
    sharded tied chunks (``layout.own``, always ``DD``), then the replicated chunks (all ``RD``
    or all ``RH``). ``gathers`` counts each sharded chunk's all-gathers per step with ``blocks``
    rCache blocks (:func:`simulate_layout`), then each frozen chunk's. At world size 1 the
    runtime keeps device-placed shards whole and resident, so only host shards are gathered (a
    copy into a block) and reduced (a copy out).

    Frozen chunks (``layout.frozen``) keep their shards where ``frozen_where`` says and cost only
    those (:func:`frozen_shard_bytes`) and their gathers (plus the host-to-device copy of a host
    shard): no reduce-scatter, no gradient buffer, no master, no optimizer step, no write-back.
    """
    return _price(profile, layout, st, _priced(layout, st, placements, gathers, frozen_where), blocks, depth)


def _price(profile: StepProfile, layout: Layout, st: Setting, p: _Priced, blocks: int, depth: int) -> Evaluation:
    """:func:`price` of the placements ``p`` holds."""
    hw = st.hardware
    fixed = fixed_device_bytes(profile, layout, st, blocks)
    t_opt = _optimizer_seconds(p)
    t_h2d, t_shard_reads = _copy_seconds(p)
    dev_var, host, disk, transient = _placed_bytes(p)
    n_gathers = int(p.g.sum() + p.g_own.sum() + p.g_frozen.sum())
    comm = comm_times(profile, layout, st, n_gathers, p.g_own, int(p.g_frozen.sum()), p.zero)
    if p.solo and p.n:  # only the chunks the rCache holds are reduced (a copy out of the block)
        rs = sum(collectives(Sharding.SHARDED, 1, k.shard).reduction == "reduce_scatter" for k in p.kinds)
        comm["reduce_scatter"] = rs * hw.reduce_scatter_time(layout.chunk_size * st.reduce_elem, 1)
    fb, hidden = _step_seconds(p, comm, t_h2d, t_shard_reads, depth, n_gathers, profile)
    breakdown = dict(comm, h2d_gather=t_h2d, optimizer=t_opt, overlap_hidden=-hidden)
    if t_shard_reads:
        breakdown["disk_shard_reads"] = t_shard_reads
    fused_hidden = _fused_step_hidden(p, comm["compute"], profile.backward_share())
    if fused_hidden is not None:
        breakdown["fused_step_hidden"] = -fused_hidden
        t_opt -= fused_hidden
    memory, host, process = _memory_terms(profile, p, fixed, dev_var, host, transient)
    return Evaluation(
        chunk_size=layout.chunk_size, blocks=blocks, prefetch_depth=depth, placements=p.placements,
        device_bytes=sum(fixed.values()) + dev_var, host_bytes=host + process, disk_bytes=disk,
        step_time=fb + t_opt, breakdown=breakdown, memory=memory, gathers=n_gathers, shard_shared=layout.own > 0,
        frozen_placement=p.frozen_where, zero=layout.zero,
    )


@dataclass(frozen=True)
class _Priced:
    """What :func:`price` prices: the placements split by kind of chunk, and the gathers of
    each (at world size 1, none for a resident chunk)."""

    layout: Layout
    st: Setting
    placements: tuple[ChunkPlacement, ...]  # every chunk's, in the layout's order
    kinds: tuple[ChunkPlacement, ...]  # the sharded chunks, sharded tied chunks excluded
    # how many of ``kinds`` are each placement, in the order each first appears in ``kinds``
    kind_counts: tuple[tuple[ChunkPlacement, int], ...]
    zero: tuple[ChunkPlacement, ...]  # the ZeRO-1/2 chunks
    rwhere: Placement  # the replicated chunks' optimizer state
    frozen_where: Placement
    n: int  # len(kinds)
    solo: bool  # world size 1
    g: np.ndarray  # gathers per sharded chunk
    g_own: np.ndarray  # per sharded tied chunk
    g_frozen: np.ndarray  # per frozen chunk
    host_shard: np.ndarray  # per sharded chunk: its shard off the device
    disk_shard: np.ndarray  # per sharded chunk: its shard on disk
    shard: int  # elements of one sharded chunk's shard
    fshard: int  # bytes of one frozen chunk's shard
    h2d: float  # seconds to copy one shard to the device
    kinds_on_disk: int  # of ``kinds``, with optimizer state on disk
    zero_on_disk: bool  # a ZeRO-1/2 chunk keeps its optimizer state on disk


def _split_placements(layout: Layout,
                      placements: Sequence[ChunkPlacement]) -> tuple[tuple, tuple, Placement]:
    """The sharded chunks' placements, the ZeRO-1/2 chunks' and where the replicated chunks keep
    their optimizer state; ValueError if ``placements`` is out of the layout's order."""
    n_sh = layout.n_sharded
    n = n_sh - layout.own
    if len(placements) != len(layout.chunks):
        raise ValueError(f"{len(placements)} placements for {len(layout.chunks)} chunks")
    n_z = n_sh + layout.zero
    kinds, own, zero, repl = tuple(placements[:n]), placements[n:n_sh], tuple(placements[n_sh:n_z]), placements[n_z:]
    if (any(not k.sharded for k in kinds) or any(k != DD for k in own) or any(not k.zero for k in zero)
            or any(not k.replicated for k in repl)):
        raise ValueError("placements out of the layout's order: sharded chunks, sharded tied chunks (DD), ZeRO-1/2, "
                         "replicated")
    if len({k.optim for k in repl}) > 1:
        raise ValueError("the replicated chunks keep their optimizer state in one place (all RD or all RH)")
    return kinds, zero, repl[0].optim if repl else Placement.DEVICE


def _priced(layout: Layout, st: Setting, placements: Sequence[ChunkPlacement], gathers: np.ndarray,
            frozen_where: Placement) -> _Priced:
    """``placements`` and ``gathers`` as :func:`price` uses them."""
    kinds, zero, rwhere = _split_placements(layout, placements)
    host_shard = np.asarray([k.shard is not Placement.DEVICE for k in kinds], dtype=bool)
    counts = tuple(Counter(kinds).items())
    solo_gathered = (np.asarray([collectives(Sharding.SHARDED, 1, k.shard).gathers_per_use for k in kinds], dtype=bool)
                     if st.world == 1 else None)
    return _priced_parts(layout, st, tuple(placements), kinds, counts, zero, rwhere, gathers, frozen_where, host_shard,
                         np.asarray([k.shard_on_disk for k in kinds], dtype=bool), solo_gathered)


def _priced_codes(layout: Layout, st: Setting, codes: np.ndarray, zero: tuple[ChunkPlacement, ...],
                  repl: tuple[ChunkPlacement, ...], gathers: np.ndarray, frozen_where: Placement) -> _Priced:
    """:func:`_priced` of the placements :func:`place` chose: the sharded chunks' as indices into
    :data:`_SCAN_KINDS` (``codes``), the sharded tied chunks ``DD``, the ZeRO-1/2 chunks ``zero``
    and the replicated ones ``repl``; worked out on arrays, not chunk by chunk."""
    kinds = tuple(_KIND_ARRAY[codes])
    used, first = np.unique(codes, return_index=True)
    tally = np.bincount(codes, minlength=len(_SCAN_KINDS))
    counts = tuple((_SCAN_KINDS[c], int(tally[c])) for c in used[np.argsort(first)].tolist())
    placements = kinds + (DD,) * layout.own + zero + repl
    return _priced_parts(layout, st, placements, kinds, counts, zero, repl[0].optim if repl else Placement.DEVICE,
                         gathers, frozen_where, _HOST_SHARD[codes], _DISK_SHARD[codes],
                         _SOLO_GATHERED[codes] if st.world == 1 else None)


def _priced_parts(layout: Layout, st: Setting, placements: tuple, kinds: tuple, counts: tuple, zero: tuple,
                  rwhere: Placement, gathers: np.ndarray, frozen_where: Placement, host_shard: np.ndarray,
                  disk_shard: np.ndarray, solo_gathered: Optional[np.ndarray]) -> _Priced:
    """The :class:`_Priced` of placements split by kind of chunk (:func:`_priced`'s tail);
    ``solo_gathered`` (at world size 1): which of ``kinds`` go through the rCache."""
    n_sh = layout.n_sharded
    n = n_sh - layout.own
    solo = st.world == 1
    g = np.asarray(gathers, dtype=np.int64)
    g_own, g_frozen, g = g[n:n_sh], g[n_sh:], g[:n]
    # the runtime's rule (footprint.resident_sharding): at world size 1 a device shard is kept
    # whole and resident, never gathered; an off-device one still goes through the rCache
    if not collectives(Sharding.SHARDED, st.world, frozen_where, frozen=True, quantised=st.frozen_format is not None).gathers_per_use:
        g_frozen = np.zeros_like(g_frozen)
    if solo and n:
        g = np.where(solo_gathered, g, 0)
    shard = layout.chunk_size // st.world if n else 0
    return _Priced(
        layout=layout, st=st, placements=placements, kinds=kinds, kind_counts=counts, zero=zero, rwhere=rwhere,
        frozen_where=frozen_where, n=n, solo=solo,
        g=g, g_own=g_own, g_frozen=g_frozen, host_shard=host_shard, disk_shard=disk_shard, shard=shard,
        fshard=st.frozen_shard(layout),
        h2d=gather_h2d_seconds(st, shard * st.elem) if n else 0.0,
        kinds_on_disk=sum(m for k, m in counts if k.on_disk), zero_on_disk=any(k.on_disk for k in zero),
    )


def _optimizer_seconds(p: _Priced) -> float:
    """Seconds of the optimizer step: replicated, sharded tied, sharded and ZeRO-1/2 chunks."""
    st, layout = p.st, p.layout
    ct = per_chunk_fixed_time(st, p.shard)
    repl_numel = sum(layout.replicated_capacities)
    return (replicated_optimizer_time(st, repl_numel, p.rwhere)
            + sum(st.optimizer_time(c // st.world, "device") for c in layout.own_capacities)
            + sum(ct[k] * m for k, m in p.kind_counts)
            + _per_layout(st, "zero_time", layout, lambda: sum(
                zero_chunk_optimizer_time(st, c, k.optim) for c, k in zip(layout.zero_capacities, p.zero)), p.zero))


def _copy_seconds(p: _Priced) -> tuple[float, float]:
    """Seconds of the host-to-device copies of gathered host shards, and of the disk reads of
    gathered disk shards."""
    st, layout, hw = p.st, p.layout, p.st.hardware
    t_h2d = float(p.g[p.host_shard].sum() * p.h2d) if p.n else 0.0
    if p.frozen_where is not Placement.DEVICE and layout.n_frozen:
        t_h2d += float(p.g_frozen.sum()) * _frozen_h2d(p)
    # a disk shard is derived from its master (and Kahan compensation), read before each of its gathers
    # (synchronously: nothing hides it)
    t_shard_reads = float(p.g[p.disk_shard].sum() * hw.disk_time(p.shard * st.derived_read_elem, 0)) if p.n else 0.0
    if p.frozen_where is Placement.DISK and layout.n_frozen:  # read for each gather, never written back
        t_shard_reads += float(p.g_frozen.sum()) * hw.disk_time(p.fshard, 0)
    return t_h2d, t_shard_reads


def gather_h2d_seconds(st: Setting, nbytes: int) -> float:
    """Seconds to bring one off-device shard of ``nbytes`` to the device for its gather (trainable
    or frozen): none on a CPU-only profile, where host and device are one memory and the runtime
    gathers (or decodes) from the host shard itself (``Chunk.gather`` copies only to an accelerator)."""
    return 0.0 if unified_memory(st.hardware) else st.hardware.h2d_time(nbytes, st.pin)


def _frozen_h2d(p: _Priced) -> float:
    """:func:`gather_h2d_seconds` of one off-device frozen shard."""
    return gather_h2d_seconds(p.st, p.fshard)


def _placed_bytes(p: _Priced) -> tuple[int, int, int, int]:
    """The placed chunks' device, host and disk bytes, and the transient host bytes (included
    in the host bytes)."""
    st, layout, fw = p.st, p.layout, p.frozen_where
    cb = per_chunk_bytes(st, p.shard)
    rd, rh = replicated_optimizer_bytes(layout, st, p.rwhere)
    n_disk = sum(m for k, m in p.kind_counts if k.on_disk)
    fbytes = frozen_shard_bytes(layout, st)
    dev_var = rd + sum(cb[k][0] * m for k, m in p.kind_counts) + (fbytes if fw is Placement.DEVICE else 0)
    transient = transient_host_bytes(layout, st, p.shard, n_disk, int(p.disk_shard.sum()))
    host = rh + sum(cb[k][1] * m for k, m in p.kind_counts) + transient
    host += fbytes if fw is Placement.HOST else 0
    host += p.fshard if fw is Placement.DISK and layout.n_frozen else 0  # the one being gathered
    disk = sum(cb[k][2] * m for k, m in p.kind_counts) + (fbytes if fw is Placement.DISK else 0)
    zd, zh, zk = _zero_bytes(st, layout, p.zero)
    return dev_var + zd, host + zh, disk + zk, transient


def _zero_bytes(st: Setting, layout: Layout, zero: tuple[ChunkPlacement, ...]) -> tuple[int, int, int]:
    """(device, host, disk) bytes of ``layout``'s ZeRO-1/2 chunks placed ``zero`` (remembered)."""
    def make() -> tuple[int, int, int]:
        per = [zero_chunk_bytes(st, c, k.optim) for c, k in zip(layout.zero_capacities, zero)]
        return sum(b[0] for b in per), sum(b[1] for b in per), sum(b[2] for b in per)
    return _per_layout(st, "zero_bytes", layout, make, zero)


def _step_seconds(p: _Priced, comm: dict[str, float], t_h2d: float, t_shard_reads: float, depth: int,
                  n_gathers: int, profile: StepProfile) -> tuple[float, float]:
    """Seconds of forward and backward with their communication (all but the optimizer step),
    and how much of the communication hides under compute."""
    st, layout, hw = p.st, p.layout, p.st.hardware
    n_sh = layout.n_sharded
    # A disk shard's gather is finished before Chunk.gather returns (even a prefetch), so that its
    # staged copy is dropped at once (DISK_SHARD_STAGING): its all-gather and host-to-device copy
    # hide under nothing, like its read.
    n_sync = int(p.g[p.disk_shard].sum()) if p.n else 0
    t_sync = n_sync * (hw.all_gather_time(layout.chunk_size * st.elem, st.world) + p.h2d)
    if p.frozen_where is Placement.DISK and layout.n_frozen:
        n_sync += int(p.g_frozen.sum())
        t_sync += float(p.g_frozen.sum()) * (_layout_collectives(layout, st, p.zero).gather_frozen + _frozen_h2d(p))
    fb_comm = comm["all_gather"] + comm["reduce_scatter"] + comm["all_reduce"] + t_h2d - t_sync
    n_async = n_gathers - n_sync
    if hw.overlap and depth >= 1 and (n_sh or layout.n_frozen):
        first_gather = hw.all_gather_time(layout.chunk_size * st.elem, st.world)
        fb = max(comm["compute"], fb_comm) + first_gather
        hidden = comm["compute"] + fb_comm - fb
    elif hw.overlap_fraction > 0 and depth >= 1 and (n_sh or layout.n_frozen) and n_async > 1:
        # no copy engine, but gathers issued ahead still partly run while the rank computes; the
        # first gather of the step has nothing to hide under. Reductions also run on gloo's
        # thread now (one in flight, grad_sync.REDUCTIONS_IN_FLIGHT), but on a CPU box they compete
        # with compute for the same cores and measured steps still exceed the predictions, so
        # none of their time is counted hidden
        per_gather = (comm["all_gather"] + t_h2d - t_sync) / n_async
        # each gather hides under the compute between its issue and its use, at most
        # (gather_windows); never more than all but the first gather
        hideable = min(per_gather * (n_async - 1), _windowed_gathers(p, profile, depth, comm["compute"]))
        hidden = hw.overlap_fraction * min(comm["compute"], hideable)
        fb = comm["compute"] + fb_comm - hidden
    else:
        fb = comm["compute"] + fb_comm
        hidden = 0.0
    fb += t_sync + t_shard_reads
    fb += comm.get("publish", 0.0)  # the ZeRO chunks' updated parameters, after the step: nothing hides it
    return fb, hidden


def _windowed_gathers(p: _Priced, profile: StepProfile, depth: int, compute: float) -> float:
    """Seconds of the step's asynchronous gathers (each at its own chunk's all-gather and
    host-to-device copy) that fit in their windows of ``compute``
    (:func:`~elixir.search.gather_windows.gather_windows`); a disk shard's gather is synchronous
    and not counted."""
    layout, st = p.layout, p.st
    ids, windows = gather_windows(profile, layout.trace, np.concatenate([p.g, p.g_own, p.g_frozen]), depth,
                                  layout.figures)
    per = _layout_collectives(layout, st, p.zero)
    n_frozen = layout.trace.n_chunks - layout.n_sharded
    seconds = np.concatenate([np.full(p.n, per.gather_full), np.asarray(per.gather_own, dtype=np.float64),
                              np.full(n_frozen, per.gather_frozen)])
    sync = np.zeros(layout.trace.n_chunks, dtype=bool)
    if p.n:
        seconds[: p.n] += np.where(p.host_shard, p.h2d, 0.0)
        sync[: p.n] = p.disk_shard
    if p.frozen_where is Placement.DISK:
        sync[layout.n_sharded:] = True
    elif p.frozen_where is Placement.HOST and n_frozen:
        seconds[layout.n_sharded:] += _frozen_h2d(p)
    keep = ~sync[ids]
    return float(np.minimum(seconds[ids[keep]], windows[keep] * compute).sum())


def _fused_step_hidden(p: _Priced, compute: float, backward_share: float) -> Optional[float]:
    """Seconds of the disk chunks' step that the fused step hides under backward
    (``backward_share`` of ``compute``: :meth:`StepProfile.backward_share`), or None when the
    plan has no fused step over disk chunks."""
    st, layout = p.st, p.layout
    n_disk = p.kinds_on_disk
    if not (st.fused_step and n_disk and layout.n_sharded):
        return None
    # the backward stager reads and writes disk chunks while backward computes; the first
    # chunk's read has nothing before it to hide under
    nbytes = layout.chunk_size // st.world * st.disk_elem
    t_disk = n_disk * st.hardware.disk_time(nbytes, nbytes)  # a KK chunk's step moves no shard either
    return min(t_disk - st.hardware.disk_time(nbytes, 0), backward_share * compute)


def credits_below_sum(st: Setting) -> bool:
    """Whether :func:`price` may count a plan's host bytes below the sum of its terms at their own
    peaks (:func:`_memory_terms`): on one memory pool (the terms never live at once,
    ``not_at_once``), or where a disk plan's process holds less heap slack than
    ``st.process_bytes``. Elsewhere the sum is the pricing's count, and a scan on it is exact."""
    return unified_memory(st.hardware) or st.heap_slack_bytes > 0


def _memory_terms(profile: StepProfile, p: _Priced, fixed: dict, dev_var: int, host: int,
                  transient: int) -> tuple[dict, int, int]:
    """The memory breakdown, the host bytes (on one pool, with the terms' not-at-once
    difference) and the process's own bytes."""
    st, layout = p.st, p.layout
    fbytes = frozen_shard_bytes(layout, st)
    # every term once, device then host: they add up to device_bytes + host_bytes
    # a plan that streams from disk (optimizer state, or frozen shards: the runtime's rule,
    # ElixirModule.streams_from_disk) runs under return_host_memory and trims after backward
    on_disk = p.kinds_on_disk > 0 or p.zero_on_disk  # trainable disk chunks
    streams = on_disk or (p.frozen_where is Placement.DISK and layout.n_frozen > 0)
    process = st.process_bytes - (st.heap_slack_bytes if streams else 0)
    if streams and st.heap_slack_bytes and on_disk:
        # trainable disk chunks: what their step leaves in the heap even so
        # (HardwareProfile.disk_plan_heap_slack_per_activation_byte)
        hw = st.hardware
        kept = hw.step_extra_bytes(int(profile.activation_bytes), True, streams_from_disk=True) - hw.step_untracked_bytes
        process += min(st.heap_slack_bytes, kept)
    memory = dict(fixed, placed_device=dev_var, process=process, placed_host=host - transient, staging=transient)
    if layout.n_frozen:  # included in placed_device, or in the host (or disk) bytes
        memory["frozen_shards"] = fbytes
    if unified_memory(st.hardware):
        # one pool: the terms peak at different moments of the step, so the pool's peak is the
        # most live at once (timeline_peak), less than their sum; the difference is a host term
        # of its own, so that the terms still add up to device_bytes + host_bytes
        # (at most the host terms themselves, so that host_bytes stays a byte count)
        apart = max(timeline_peak(profile, layout, st, p.kinds, memory, pooled_grads=not streams) - sum(
            v for k, v in memory.items() if k != "frozen_shards"), -(host + process))
        memory["not_at_once"] = apart
        host += apart
    return memory, host, process


def frozen_shard_bytes(layout: Layout, st: Setting) -> int:
    """Bytes of this rank's frozen-chunk shards: all a frozen chunk keeps between uses (its
    weights, ``chunk_size / world`` elements, in the compute dtype or quantised; no gradient,
    master or state)."""
    return layout.n_frozen * st.frozen_shard(layout)


def simulate_layout(layout: Layout, blocks: int) -> np.ndarray:
    """Gather counts under Belady with ``blocks`` blocks, per sharded chunk then per frozen chunk.
    Remembered per (layout, blocks): the search asks again for each configuration it prices
    (fp32 gradients, then the lean one) and each bound; the array is read-only."""
    if layout.n_sharded + layout.n_frozen == 0:
        return np.zeros(0, dtype=np.int64)
    blocks = max(blocks, layout.min_blocks)
    g = layout.gathers_by_blocks.get(blocks)
    if g is None:
        g = simulate(layout.trace, blocks, "belady").per_chunk
        g.flags.writeable = False
        layout.gathers_by_blocks[blocks] = g
    return g


def solo_resident_gathers(layout: Layout, blocks: int, gathers: np.ndarray) -> np.ndarray:
    """``gathers`` (:func:`simulate_layout`'s) for a world-size-1 placement that keeps every
    trainable chunk's shard on the device: the runtime keeps those whole and resident, in no
    rCache block, so only the frozen chunks (quantised, or off the device) take the blocks, and
    their counts come from a Belady simulation of their accesses alone. With the whole trace an
    adapter's access between two base-weight ops evicted the frozen chunk in use (one block: a
    LoRA step's frozen chunks priced ~15 gathers a step each for their two uses)."""
    n_sh = layout.n_sharded
    if not layout.n_frozen or not n_sh:
        return gathers
    blocks = max(blocks, layout.min_blocks)
    g = layout.solo_frozen_gathers_by_blocks.get(blocks)
    if g is None:
        t = layout.trace
        step_of = np.repeat(np.arange(t.n_steps), np.diff(t.offsets))
        keep = t.chunks >= n_sh
        counts = np.bincount(step_of[keep], minlength=t.n_steps)
        offsets = np.concatenate([[0], np.cumsum(counts[counts > 0])]).astype(np.int64)
        sub = AccessTrace(offsets, t.chunks[keep].astype(np.int32), t.n_chunks)
        g = layout.solo_frozen_gathers_by_blocks[blocks] = simulate(sub, blocks, "belady").per_chunk
    out = np.array(gathers, dtype=np.int64)
    out[n_sh:] = g[n_sh:]
    return out


def collective_counts(ev: Evaluation, world: int) -> dict[str, int]:
    """The collectives a priced plan issues per training step, by the kinds
    :class:`~elixir.chunk.ChunkComm` counts (``issued``): ``all_gather`` the simulated gathers
    for use (``ev.gathers``), and per chunk of ``ev.placements`` its reduction and its
    ``publish``, by the footprint rule (:func:`~elixir.plan.footprint.collectives`)."""
    out = {"all_gather": int(ev.gathers), "publish": 0, "reduce_scatter": 0, "all_reduce": 0}
    for k in ev.placements:
        c = collectives(k.sharding, world, k.shard)
        if c.reduction is not None:
            out[c.reduction] += 1
        out["publish"] += int(c.publishes)
    return out


def layout_from_plan(profile: StepProfile, plan) -> Layout:
    """The :class:`Layout` of an existing plan (``SearchResult``), e.g. from another search."""
    ctx = _context(profile)
    shared = {n for n, _ in ctx.shared}
    index = {n: i for i, n in enumerate(ctx.sh_names + tuple(shared_name for shared_name, _ in ctx.shared)
                                        + tuple(f for f, _ in ctx.frozen))}
    param_chunk = np.full(len(index), -1, dtype=np.int64)
    order = _plan_order(plan, shared)
    own = sum(c.sharded and set(c.params) <= shared for c in order)
    zero = sum(_is_zero(plan, c) for c in order)
    body = [c.chunk_size for c in order if (c.sharded and not set(c.params) <= shared) or _is_zero(plan, c)]
    for ci, c in enumerate(order):
        if c.sharded or _is_zero(plan, c):
            for n in c.params:
                if n in index:
                    param_chunk[index[n]] = ci
    n_tr = sum(c.sharded for c in order)
    zero_buffers = _grad_buffer_peak(ctx, param_chunk, n_tr + zero) if zero else 0
    zero_used = sum(k for k, c in zip(ctx.sh_numel, param_chunk) if c >= n_tr) if zero else 0
    param_chunk = np.where(param_chunk >= n_tr, -1, param_chunk)  # ZeRO chunks: in no trace
    for j, c in enumerate(plan.frozen_chunks):
        for n in c.params:
            param_chunk[index[n]] = n_tr + j
    return _layout(ctx, max(body, default=plan.chunk_size), [list(c.params) for c in order],
                   [c.chunk_size for c in order], [c.sharded for c in order], param_chunk, own,
                   [list(c.params) for c in plan.frozen_chunks], max((c.chunk_size for c in plan.frozen_chunks), default=0),
                   zero, zero_buffers, zero_used)


def _is_zero(plan, chunk) -> bool:
    """A ZeRO-1/2 chunk, as the runtime runs it (at world size 1 it is replicated:
    :func:`~elixir.plan.footprint.resident_sharding`)."""
    return resident_sharding(chunk.sharding, chunk.shard_placement, plan.world_size) in (Sharding.ZERO1, Sharding.ZERO2)


def _plan_order(plan, shared: set) -> list:
    """A plan's chunks as a Layout orders them: sharded, then sharded tied ones, then ZeRO-1/2,
    then replicated."""
    tied = [c for c in plan.chunks if c.sharded and set(c.params) <= shared]
    zero = [c for c in plan.chunks if _is_zero(plan, c)]
    return ([c for c in plan.chunks if c.sharded and c not in tied] + tied + zero
            + [c for c in plan.chunks if not c.sharded and not _is_zero(plan, c)])


def evaluate_plan(profile: StepProfile, plan, st: Setting) -> Evaluation:
    """Predicted memory and step time of an existing plan, priced by :func:`price` as the search
    prices its candidates (so a searched plan evaluates to exactly its own prediction). The state
    and frozen formats a plan records replace ``st``'s (a plan that records none keeps ``st``'s)."""
    formats = {} if plan.master_format is None else {"master_format": plan.master_format,
                                                      "moments_format": plan.moments_format}
    if plan.frozen_format is not None:
        formats["frozen_format"] = plan.frozen_format
    st = dataclasses.replace(st, grad_elem=2 if plan.grad_dtype in ("bfloat16", "float16") else 4,
                             fused_step=bool(plan.fused_step), **formats)
    lay = layout_from_plan(profile, plan)
    order = _plan_order(plan, set(profile.shared))
    n_sh = lay.n_sharded
    n = n_sh - lay.own
    kinds = tuple(ChunkPlacement.of(c) for c in order[:n])
    zero = tuple(ChunkPlacement.of(c) for c in order[n_sh : n_sh + lay.zero])
    repl = order[n_sh + lay.zero :]
    # the replicated chunks' state is priced in one place: the device only if all of it is there
    r = RD if all(c.optim_placement is Placement.DEVICE for c in repl) else RH
    blocks = plan.cache_blocks
    fwhere = plan.frozen_chunks[0].shard_placement if plan.frozen_chunks else Placement.DEVICE
    quantised = st.frozen_format is not None and lay.n_frozen > 0  # gathered at each use even at world size 1
    if (st.world == 1 and all(k.shard is Placement.DEVICE for k in kinds) and fwhere is Placement.DEVICE
            and not quantised):
        g, blocks = np.zeros(n_sh + lay.n_frozen, dtype=np.int64), 0  # nothing goes through the cache
    else:
        g = simulate_layout(lay, blocks)
        if st.world == 1 and all(k.shard is Placement.DEVICE for k in kinds):
            g = solo_resident_gathers(lay, blocks, g)
    # sharded tied chunks are priced as DD, like the search does
    return price(profile, lay, st, kinds + (DD,) * lay.own + zero + (r,) * len(repl), blocks, plan.prefetch_depth, g,
                 fwhere)
