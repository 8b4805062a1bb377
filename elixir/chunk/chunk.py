"""One chunk: a flat buffer of packed parameters, its shard, its fp32 master and its gradients.

A chunk knows nothing about models. It owns:

- ``payload``: the full flat compute-dtype tensor that parameter views point into. For a sharded
  chunk its storage is resized to 0 when released and back when gathered, so any view of it (also
  the views autograd saved for backward) sees the re-gathered values;
- ``shard``: this rank's compute-dtype slice (the whole chunk when replicated), on the device or in
  host memory; for a chunk whose parameters are whole but whose state is split (ZeRO-1/2) it is
  this rank's slice *of the payload* (a view), and :meth:`publish` all-gathers the updated slices
  into the payload after a step;
- ``master``: the fp32 slice the optimizer updates (the same tensor as ``shard`` when the compute
  dtype is fp32 and both live in the same place);
- ``grad_buffer``: the full-size gradient buffer filled during backward, freed once reduced;
- ``shard_grad``: this rank's reduced gradient in ``spec.grad_dtype`` (fp32 by default; bf16/fp16
  halve it, and the fused CPU Adam kernel reads them as they are); ``grad_valid`` says if it holds
  data. It lives until :meth:`drop_grad` (the fused backward-and-step frees it once the chunk is
  stepped, so that the shard gradients of all chunks never exist at once).

A ``FROZEN`` chunk (:class:`~elixir.chunk.state.ChunkKind`) owns only ``payload`` and ``shard``
(booked as ``frozen_shard``): no master, no gradient buffer, no shard gradient. Asking it for a
gradient is a runtime bug and raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from elixir import device as dev
from elixir import distributed as edist
from elixir.chunk.accounting import MemoryLedger
from elixir.chunk.buffers import GradBufferPool
from elixir.chunk.state import ChunkKind, ChunkState, GradState, check_chunk_move, check_grad_move
from elixir.plan import MeshLayout, ShardedBy, Sharding


@dataclass(frozen=True)
class ChunkSpec(ShardedBy):
    """Static description of one chunk on one rank.

    Attributes:
        index: position of the chunk in the plan.
        capacity: elements, padding included (a multiple of :attr:`shard_world` when any state is split).
        sharding: what is split across ranks (:class:`~elixir.plan.Sharding`: the payload
            for ``SHARDED``; master, gradient and optimizer state for every sharding but ``REPLICATED``);
            a bool is read as the older ``sharded`` flag.
        layout: the mesh layout of the run (:class:`~elixir.plan.mesh.MeshLayout`; an int is read as
            plain data parallelism over that many ranks). A chunk is split over its ``dp_shard``
            axis only (:attr:`shard_world`).
        rank: this rank's index on the ``dp_shard`` axis.
        dtype: compute dtype of payload and shard.
        reduce_dtype: dtype gradients are reduced in.
        grad_dtype: dtype of the reduced shard gradient kept until the optimizer step (fp32, or
            bf16/fp16 to halve its bytes: exact when it equals ``reduce_dtype`` and nothing is
            accumulated across backwards; otherwise the fp32 sum is rounded once per backward).
        device: the compute device.
        shard_on_host: keep the compute shard in host memory between uses.
        master_on_host: keep the fp32 master shard in host memory.
        master_on_disk: the fp32 master (and the optimizer state) live in an offload file and are
            staged in host memory only while used (:mod:`elixir.offload`); implies a master
            separate from the shard, in a resizable host tensor of its own.
        shard_on_disk: the compute shard lives in an offload file too (:attr:`Chunk.shard_store`),
            read into host memory only while it is gathered or written (the optimizer step, a
            load) and dropped after: the chunk then holds no resident bytes between uses. Implies
            ``shard_on_host`` and ``master_on_disk`` (the step that rewrites the shard has the
            master staged).
        pin_memory: page-lock host tensors (only matters with an accelerator).
        kind: trainable, or frozen (weights only; the master and gradient fields are unused).
    """

    index: int
    capacity: int
    sharding: Sharding
    layout: MeshLayout
    rank: int
    dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    shard_on_host: bool = False
    master_on_host: bool = False
    master_on_disk: bool = False
    shard_on_disk: bool = False
    pin_memory: bool = True
    kind: ChunkKind = ChunkKind.TRAINABLE

    @property
    def frozen(self) -> bool:
        return self.kind is ChunkKind.FROZEN

    @property
    def shard_category(self) -> str:
        """The ledger category of this chunk's shard."""
        return "frozen_shard" if self.frozen else "shard"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding", Sharding.of(self.sharding))
        object.__setattr__(self, "layout", MeshLayout.of(self.layout))
        if self.shard_on_disk and not (self.sharded and self.shard_on_host and (self.master_on_disk or self.frozen)):
            raise ValueError(f"chunk {self.index}: a disk shard needs a sharded chunk with its shard on the host "
                             "and (unless frozen: read-only, never rewritten) its master on disk")

    @property
    def shard_world(self) -> int:
        """Ranks this chunk is split over (the layout's ``dp_shard`` axis)."""
        return self.layout.dp_shard

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's master and reduced gradient (and of its payload shard when sharded)."""
        return self.capacity // self.shard_world if self.state_sharded else self.capacity

    @property
    def shard_offset(self) -> int:
        """Offset of this rank's shard in the flat chunk."""
        return self.rank * self.shard_numel if self.state_sharded else 0

    @property
    def publishes(self) -> bool:
        """Whole parameters but a split master (ZeRO-1/2): after a step every rank's updated slice
        is all-gathered into every payload (:meth:`Chunk.publish`)."""
        return self.state_sharded and not self.sharded and self.shard_world > 1


def _loc(on_host: bool) -> str:
    return "host" if on_host else "device"


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()



def _copy_of(src: torch.Tensor, dtype: torch.dtype, on_host: bool, spec: ChunkSpec) -> torch.Tensor:
    """A copy of ``src`` in ``dtype``: in (pinned, as the spec says) host memory or on the spec's device."""
    if on_host:
        out = dev.empty_host(src.numel(), dtype, pin=spec.pin_memory)
        out.copy_(src)
        return out
    return src.to(device=spec.device, dtype=dtype, copy=True)

class Chunk:
    """Runtime state of one chunk on this rank (see the module docstring)."""

    def __init__(self, spec: ChunkSpec, ledger: MemoryLedger, group=None, streams: Optional[dev.SideStreams] = None,
                 buffers: Optional[GradBufferPool] = None) -> None:
        if spec.state_sharded and spec.capacity % spec.shard_world:
            raise ValueError(f"chunk {spec.index}: capacity {spec.capacity} is not a multiple of its {spec.shard_world} shards")
        self.spec = spec
        self.index = spec.index
        self.ledger = ledger
        self.group = group
        # gathers, reductions and refreshes run on these side streams (null stand-ins on CPU)
        self.streams = streams if streams is not None else dev.SideStreams(spec.device)
        # gradient buffers and shard gradients are taken from, and given back to, this pool
        self.buffers = buffers if buffers is not None else GradBufferPool(enabled=False)
        self._ready = None  # event: the last gather's data is in the payload
        self.payload_bytes = _nbytes(spec.capacity, spec.dtype)
        self.payload = torch.empty(0, dtype=spec.dtype, device=spec.device)
        self.state = ChunkState.RELEASED
        self.pins = 0
        self.grad_state = GradState.EMPTY
        self.grad_buffer: Optional[torch.Tensor] = None
        self.shard_grad: Optional[torch.Tensor] = None
        self.grad_valid = False
        # Whether the consumer of the shard gradient reads it in any dtype (the fused Adam kernel
        # does; set by ElixirOptimizer): then a whole-chunk gradient reduced in a narrower dtype
        # than ``spec.grad_dtype`` is kept as reduced (see _adopts) instead of widened by a copy.
        self.narrow_grads_ok = False
        self._work = None
        self._reduction = None  # (work, then) of a deferred reduction (GradState.REDUCING)
        self._publishing = None  # (work, input) of an asynchronous publish
        self.shard: Optional[torch.Tensor] = None
        self.master: Optional[torch.Tensor] = None
        self.shard_store = None  # the DiskStore holding the shard (spec.shard_on_disk), set by its owner

    # ---- initialisation -------------------------------------------------------------------

    def init_from(self, flat: torch.Tensor) -> torch.Tensor:
        """Build payload, shard and master from the full flat values ``flat`` (any float dtype,
        ``capacity`` elements, identical on every rank). Returns the payload (gathered, HOLD) so
        the caller can point parameter views into it, then call :meth:`release` for sharded chunks."""
        spec = self.spec
        if flat.numel() != spec.capacity:
            raise ValueError(f"chunk {self.index}: expected {spec.capacity} elements, got {flat.numel()}")
        lo, n = spec.shard_offset, spec.shard_numel
        self.ledger.alloc("gathered" if spec.sharded else spec.shard_category, "device", self.payload_bytes, f"chunk {self.index}")
        self.payload = flat.to(device=spec.device, dtype=spec.dtype, copy=True)
        self.state = ChunkState.HOLD
        src = flat[lo : lo + n]
        if spec.shard_on_disk:  # plain (resizable) host memory: the store frees it once written
            self.shard = src.to(device="cpu", dtype=spec.dtype, copy=True)
            self.ledger.alloc(spec.shard_category, "host", _nbytes(n, spec.dtype))
        elif spec.sharded:
            self.shard = _copy_of(src, spec.dtype, spec.shard_on_host, spec)
            self.ledger.alloc(spec.shard_category, _loc(spec.shard_on_host), _nbytes(n, spec.dtype))
        else:  # parameters whole: the payload is always resident, this rank's shard a view of it
            self.shard = self.payload[lo : lo + n] if spec.state_sharded else self.payload
        if spec.frozen:
            return self.payload  # weights only: no master
        same_place = spec.master_on_host == (spec.shard_on_host and spec.sharded)
        if spec.dtype == torch.float32 and same_place and not spec.master_on_disk:
            self.master = self.shard
        else:
            if spec.master_on_disk:  # plain (resizable) host memory: elixir.offload frees it
                self.master = src.to(device="cpu", dtype=torch.float32, copy=True)
            else:
                self.master = _copy_of(src, torch.float32, spec.master_on_host, spec)
            self.ledger.alloc("master", _loc(spec.master_on_host), _nbytes(n, torch.float32))
        return self.payload

    # ---- payload ---------------------------------------------------------------------------

    @property
    def is_gathered(self) -> bool:
        return self.state in (ChunkState.HOLD, ChunkState.COMPUTE)

    def _move(self, new: ChunkState) -> None:
        check_chunk_move(self.index, self.state, new)
        self.state = new

    def gather(self, async_op: bool = False) -> None:
        """All-gather the shards into the payload (RELEASED -> HOLD, or -> GATHERING if async)."""
        if not self.spec.sharded:
            return
        check_chunk_move(self.index, self.state, ChunkState.GATHERING if async_op else ChunkState.HOLD)
        self.ledger.alloc("gathered", "device", self.payload_bytes, f"gathering chunk {self.index}")
        # The payload is allocated on the compute stream; the gather stream waits for it (and for
        # the compute work that last used the memory), copies and gathers, and records `_ready`.
        self.payload.untyped_storage().resize_(self.payload_bytes)
        streams = self.streams
        if self.spec.shard_on_disk:
            self._stage_shard_on_every_rank()  # read it in; dropped once the gather is done (wait)
        with streams.issue(streams.gather) as ready:
            src = self.shard
            if self.spec.shard_on_host:
                # Host shard: bring it in first on an accelerator (non-blocking from pinned memory).
                # On CPU host and device are one memory: gather from the shard itself (a copy here
                # was a transient chunk's worth of RSS that no prediction counted).
                if dev.is_accelerator(self.spec.device):
                    src = src.to(self.spec.device, non_blocking=dev.non_blocking_ok(src, self.spec.device), copy=True)
            self._work = edist.all_gather_into(self.payload, src, self.group, async_op=True)
        self._ready = ready
        self.state = ChunkState.GATHERING
        if not async_op or self.spec.shard_on_disk:
            # A disk shard's gather is finished now, even a prefetch, so that its staged copy is
            # dropped before this returns: a prefetched chunk would otherwise hold it until used,
            # beside the one a step stages (its read is synchronous anyway; the search prices the
            # rest of its gather as not hidden either, search/cost_model.py:DISK_SHARD_STAGING).
            self.wait()

    def _stage_shard_on_every_rank(self) -> None:
        """Read the disk shard in for a gather; if any rank's read failed, every rank raises
        :class:`~elixir.distributed.DiskFault` here (one one-element all-reduce per disk-shard
        gather at world size > 1), not only the rank whose disk failed while the others wait in
        the gather. The payload allocated for the gather is given back first."""
        error = None
        try:
            self.shard_store.stage(self.index)
        except OSError as e:
            error = e
        try:
            edist.agree_on_disk_fault(
                error, self.group, f"{edist.where_now() or 'a gather'}: reading chunk {self.index}'s compute shard",
                "; the read changed nothing. Fix the disk, then restart from the last checkpoint (in "
                "forward, or in backward without fused_step, the model and optimizer are as after the "
                "last step, so a checkpoint saved now resumes exactly)")
        except OSError:
            self.shard_store.offload(self.index, write=False)  # staged on a rank whose read worked
            self.payload.untyped_storage().resize_(0)
            self.ledger.free("gathered", "device", self.payload_bytes)
            raise

    def wait(self) -> None:
        """Finish an asynchronous gather (GATHERING -> HOLD); no-op otherwise."""
        if self.state is ChunkState.GATHERING:
            streams = self.streams
            if self._work is not None:  # an async collective (a gloo thread, or the NCCL stream)
                work, self._work = self._work, None
                self._ready = streams.after(streams.gather, lambda: edist.wait_work(work))
            streams.wait(self._ready)  # the compute stream waits for this chunk only
            self._ready = None
            if self.spec.shard_on_disk:
                if dev.is_accelerator(self.spec.device):
                    streams.synchronize()  # the host-to-device copy of the staged shard is done
                self.shard_store.discard(self.index)  # the disk copy is current
            self._move(ChunkState.HOLD)

    def pin(self) -> None:
        """Mark the payload in use (HOLD -> COMPUTE); pins nest."""
        self.wait()
        if self.state is ChunkState.HOLD:
            self._move(ChunkState.COMPUTE)
        elif self.state is not ChunkState.COMPUTE:
            raise RuntimeError(f"chunk {self.index}: pin while {self.state.name}")
        self.pins += 1

    def unpin(self, all_pins: bool = False) -> None:
        if self.pins <= 0:
            return
        self.pins = 0 if all_pins else self.pins - 1
        if self.pins == 0:
            self._move(ChunkState.HOLD)

    def release(self) -> None:
        """Free the payload storage of a sharded chunk (HOLD -> RELEASED)."""
        if not self.spec.sharded or self.state is ChunkState.RELEASED:
            return
        self.wait()
        self._move(ChunkState.RELEASED)
        self.payload.untyped_storage().resize_(0)
        self.ledger.free("gathered", "device", self.payload_bytes)

    @contextlib.contextmanager
    def shard_access(self, write: bool) -> Iterator[torch.Tensor]:
        """The compute shard, resident for the block: a disk shard is read in and, with ``write``,
        written back after (else dropped); other shards are resident already."""
        if not self.spec.shard_on_disk:
            yield self.shard
            return
        store = self.shard_store
        store.stage(self.index)
        try:
            yield self.shard
        finally:
            store.offload(self.index, write=write)

    def refresh_from_master(self) -> None:
        """After an optimizer step: copy the fp32 master into the compute shard when they differ.
        A disk master is not resident here: the disk path refreshed the shard while it was staged."""
        if self.master is not None and self.master is not self.shard and not self.spec.master_on_disk:
            streams = self.streams
            with torch.no_grad(), streams.issue(streams.copy):
                self.shard.copy_(self.master, non_blocking=dev.non_blocking_ok(self.master, self.shard.device))

    def publish(self, async_op: bool = False) -> None:
        """ZeRO-1/2 after a step (or a load): all-gather every rank's updated slice of the payload
        into the whole payload, so each rank computes with every update. A no-op for the other
        kinds. Collective: every rank publishes the same chunks in the same order. With
        ``async_op`` on a CPU device the all-gather runs on the backend's thread until
        :meth:`finish_publish` (nothing may read the payload before that)."""
        if not self.spec.publishes:
            return
        self.finish_publish()
        streams = self.streams
        async_op = async_op and self.defers_reduction
        with torch.no_grad(), streams.issue(streams.copy) as ready:
            # the gather's input must not alias its output (gloo): a copy, from the recycled buffers
            mine = self.buffers.take(self.shard.numel(), self.shard.dtype, self.shard.device)
            mine.copy_(self.shard)
            work = edist.all_gather_into(self.payload, mine, self.group, async_op=async_op)
        if async_op:
            self._publishing = (work, mine)
            return
        streams.wait(ready)
        self.buffers.give(mine)

    @property
    def publishing(self) -> bool:
        """An asynchronous :meth:`publish` is in flight."""
        return self._publishing is not None

    def finish_publish(self) -> None:
        """Wait for an asynchronous :meth:`publish`; no-op otherwise."""
        if self._publishing is not None:
            (work, mine), self._publishing = self._publishing, None
            edist.wait_work(work)
            self.buffers.give(mine)

    # ---- gradients -------------------------------------------------------------------------

    def _grad_move(self, new: GradState) -> None:
        check_grad_move(self.index, self.grad_state, new)
        self.grad_state = new

    def open_grad(self) -> torch.Tensor:
        """Make sure a gradient buffer is ready (EMPTY/REDUCED -> ACCUMULATING); return it.

        The buffer is not zero-filled: the first gradient of a parameter is copied in, later ones
        are added, and :meth:`reduce` zeroes only the ranges nothing was written to (padding,
        parameters without a gradient). That saves a fill and an add over the whole chunk.
        """
        if self.spec.frozen:
            raise RuntimeError(f"chunk {self.index} is frozen: it takes no gradients (a runtime bug)")
        self.finish_reduction()  # a late gradient: the deferred reduction completes first
        if self.grad_state is not GradState.ACCUMULATING:
            self.ledger.alloc("grad_buffer", "device", _nbytes(self.spec.capacity, self.spec.reduce_dtype))
            if self._reusable_as_buffer and not self.grad_valid:
                # last step's shard gradient, kept by zero_grad: no allocation, no page faults
                self.ledger.free("shard_grad", _loc(self.spec.master_on_host), self.shard_grad_bytes)
                self.grad_buffer, self.shard_grad = self.shard_grad, None
            else:
                self.grad_buffer = self.buffers.take(self.spec.capacity, self.spec.reduce_dtype, torch.device(self.spec.device))
            self._written: dict[int, int] = {}
            self._grad_move(GradState.ACCUMULATING)
        return self.grad_buffer

    def add_grad(self, offset: int, grad: torch.Tensor) -> None:
        """Add a gradient (any shape, ``grad.numel()`` elements) into the buffer at ``offset``."""
        buf = self.open_grad()
        n = grad.numel()
        region = buf[offset : offset + n]
        if offset in self._written:
            region.add_(grad.reshape(-1))
        else:
            region.copy_(grad.reshape(-1))
            self._written[offset] = n

    def _zero_unwritten(self) -> None:
        """Zero every range of the gradient buffer that no gradient was written to."""
        buf, pos = self.grad_buffer, 0
        for offset in sorted(self._written):
            if offset > pos:
                buf[pos:offset].zero_()
            pos = max(pos, offset + self._written[offset])
        if pos < buf.numel():
            buf[pos:].zero_()

    @property
    def defers_reduction(self) -> bool:
        """Whether :meth:`reduce` may leave its collective running (``defer=True``): on a CPU
        device at world size > 1, where the collective runs on the backend's own thread (gloo)
        while this rank goes on with backward; :meth:`finish_reduction` completes it. On an
        accelerator the reduction is already asynchronous on the reduce stream."""
        return self.spec.shard_world > 1 and not dev.is_accelerator(self.spec.device)

    def reduce(self, defer: bool = False) -> None:
        """Reduce the gradient buffer (mean over ranks) into this rank's shard gradient.

        With ``defer`` (and :attr:`defers_reduction`), only issue the collective: the chunk is
        ``REDUCING`` until :meth:`finish_reduction`, and its gradient buffer stays allocated (and
        booked) until then."""
        if self.grad_state is not GradState.ACCUMULATING:
            return
        buf = self.grad_buffer
        streams = self.streams
        defer = defer and self.defers_reduction
        with streams.issue(streams.reduce):  # ordered after the compute that filled the buffer
            work, then = self._issue_reduction(buf, async_op=defer)
            if not defer:
                then()
        dev.record_stream(buf, streams.reduce)  # the allocator must not hand it out before the reduce ran
        if defer:
            self._reduction = (work, then)
            self._grad_move(GradState.REDUCING)
            return
        self._reduced()

    def finish_reduction(self) -> None:
        """Wait for a deferred reduction (REDUCING -> REDUCED) and keep its result; no-op otherwise."""
        if self.grad_state is not GradState.REDUCING:
            return
        (work, then), self._reduction = self._reduction, None
        try:
            if work is not None:
                edist.wait_work(work)
        except BaseException:
            self._forget_buffer()
            self._grad_move(GradState.EMPTY)
            raise
        then()
        self._reduced()

    def _reduced(self) -> None:
        self._forget_buffer()
        self._grad_move(GradState.REDUCED)

    def _forget_buffer(self) -> None:
        buf = self.grad_buffer
        if buf is not None:
            self.grad_buffer = None
            self.ledger.free("grad_buffer", "device", _nbytes(self.spec.capacity, self.spec.reduce_dtype))
            g = self.shard_grad
            if g is None or g.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
                self.buffers.give(buf)  # not adopted as the shard gradient: free for the next one

    def _issue_reduction(self, buf: torch.Tensor, async_op: bool):
        """Issue the collective that reduces ``buf``; return its work handle (None when it ran
        synchronously) and the step that keeps its result (divide by the world size, then adopt
        or accumulate into the shard gradient), to run once it finished."""
        spec = self.spec
        world = spec.shard_world
        self._zero_unwritten()
        direct = (
            spec.sharding.reduce_scatters and world > 1 and not self.grad_valid
            and spec.grad_dtype == buf.dtype and self.master.device == buf.device
        )
        if direct:
            self._alloc_shard_grad()  # reduce-scatter straight into the (empty) shard gradient
            out = self.shard_grad
            work = edist.reduce_scatter_into(out, buf, self.group, async_op=async_op)

            def then() -> None:
                out.div_(world)
                self.grad_valid = True

            return work, then
        if spec.sharding.reduce_scatters:
            out = buf[spec.shard_offset : spec.shard_offset + spec.shard_numel] if world == 1 else torch.empty(
                spec.shard_numel, dtype=buf.dtype, device=buf.device
            )
            work = edist.reduce_scatter_into(out, buf, self.group, async_op=async_op)
        else:  # all-reduced; ZeRO-1 keeps this rank's slice
            work = edist.all_reduce(buf, self.group, async_op=async_op)
            out = buf[spec.shard_offset : spec.shard_offset + spec.shard_numel]

        def then() -> None:
            if world > 1:
                out.div_(world)
            if self._adopts and not self.grad_valid:
                self._adopt_shard_grad(out)
            else:
                self._accumulate_shard_grad(out)

        return work, then

    @property
    def _grad_is_whole_chunk(self) -> bool:
        """Whether the shard gradient can be the reduced gradient buffer itself (and back): the
        shard is the whole chunk (a replicated chunk, or any chunk at world size 1), beside a
        master that is not on the host."""
        spec = self.spec
        return (spec.shard_numel == spec.capacity and not spec.master_on_host and self.master is not None
                and self.master.device == torch.device(spec.device))

    @property
    def _adopts(self) -> bool:
        """Whether a backward's reduced buffer becomes the shard gradient as it is: a whole-chunk
        gradient in ``spec.grad_dtype``, or reduced in a narrower dtype (bf16 chunks reduce in bf16)
        for a consumer that reads any dtype (:attr:`narrow_grads_ok`). Kept narrow, it holds exactly
        the values the wider copy would (a widening cast is exact) without the copy, its page
        faults or its bytes; a second backward that accumulates into it widens it first
        (:meth:`_accumulate_shard_grad`), so sums are still taken in ``spec.grad_dtype``."""
        spec = self.spec
        if not self._grad_is_whole_chunk:
            return False
        if spec.reduce_dtype == spec.grad_dtype:
            return True
        return self.narrow_grads_ok and torch.finfo(spec.reduce_dtype).bits < torch.finfo(spec.grad_dtype).bits

    @property
    def _reusable_as_buffer(self) -> bool:
        """Whether the kept shard gradient can be the next backward's gradient buffer."""
        g = self.shard_grad
        return g is not None and self._grad_is_whole_chunk and g.dtype == self.spec.reduce_dtype and g.numel() == self.spec.capacity

    def _adopt_shard_grad(self, reduced: torch.Tensor) -> None:
        """Keep the reduced buffer as the shard gradient instead of copying it into one: saves a
        copy of the chunk and, at the peak of backward, one chunk's gradient bytes (the buffer and
        the shard gradient no longer coexist)."""
        self.drop_grad()
        self.shard_grad = reduced
        self.ledger.alloc("shard_grad", _loc(self.spec.master_on_host), self.shard_grad_bytes)
        self.grad_valid = True

    @property
    def shard_grad_bytes(self) -> int:
        """Bytes of the shard gradient: in its own dtype when it exists (a kept narrow one, see
        :attr:`_adopts`), else in ``spec.grad_dtype``."""
        g = self.shard_grad
        return _nbytes(self.spec.shard_numel, g.dtype if g is not None else self.spec.grad_dtype)

    def _alloc_shard_grad(self) -> None:
        if self.shard_grad is None:
            n, dt = self.spec.shard_numel, self.spec.grad_dtype
            if self.spec.master_on_host:  # page-locked, so the device-to-host copy is non-blocking
                self.shard_grad = dev.empty_host(n, dt, pin=self.spec.pin_memory)
            else:
                self.shard_grad = self.buffers.take(n, dt, self.master.device)
            self.ledger.alloc("shard_grad", _loc(self.spec.master_on_host), self.shard_grad_bytes)
            self.grad_valid = False

    def _accumulate_shard_grad(self, reduced: torch.Tensor) -> None:
        n = self.spec.shard_numel
        g = self.shard_grad
        if g is not None and g.dtype != self.spec.grad_dtype:  # a kept narrow one (see _adopts)
            if self.grad_valid:  # accumulated in spec.grad_dtype from here on: widen it (exact)
                self.ledger.free("shard_grad", _loc(self.spec.master_on_host), self.shard_grad_bytes)
                self.shard_grad = g.to(self.spec.grad_dtype)
                self.ledger.alloc("shard_grad", _loc(self.spec.master_on_host), self.shard_grad_bytes)
            else:
                self.drop_grad()
        self._alloc_shard_grad()
        if self.grad_valid:
            if self.spec.master_on_host:  # from the device: staged through a reused host buffer
                stage = dev.host_pool().take(n, self.shard_grad.dtype)
                stage.copy_(reduced, non_blocking=dev.non_blocking_ok(reduced, stage.device))
                dev.current_stream(reduced.device).synchronize()  # the host adds it next
                self.shard_grad.add_(stage)
                dev.host_pool().give(stage)
            else:
                self.shard_grad.add_(reduced.to(self.shard_grad.dtype))
        else:
            self.shard_grad.copy_(reduced, non_blocking=dev.non_blocking_ok(reduced, self.shard_grad.device))
            self.grad_valid = True

    def drop_grad(self) -> None:
        """Free the shard gradient (after the fused backward-and-step consumed it); the next
        reduction allocates a fresh one."""
        if self.shard_grad is not None:
            self.ledger.free("shard_grad", _loc(self.spec.master_on_host), self.shard_grad_bytes)
            self.buffers.give(self.shard_grad)
            self.shard_grad = None
        self.grad_valid = False

    def abandon_grad(self) -> None:
        """Forget a gradient still accumulating (or being reduced) when its backward raised
        (ACCUMULATING / REDUCING -> EMPTY). A deferred reduction is waited for first (its
        collective still writes the buffer); its error, if any, is not raised again here. An
        asynchronous publish still in flight is waited for as well."""
        if self.grad_state is GradState.REDUCING:
            work, self._reduction = self._reduction[0], None
            if work is not None:
                with contextlib.suppress(Exception):
                    edist.wait_work(work)
        if self.grad_state in (GradState.ACCUMULATING, GradState.REDUCING):
            self._forget_buffer()
            self._grad_move(GradState.EMPTY)
        with contextlib.suppress(Exception):
            self.finish_publish()
        self.zero_grad()

    def end_backward(self) -> None:
        """Reset the per-backward gradient state (after finalisation)."""
        if self.grad_state in (GradState.ACCUMULATING, GradState.REDUCING):
            raise RuntimeError(f"chunk {self.index}: backward ended with unreduced gradients")
        if self.grad_state is GradState.REDUCED:
            self._grad_move(GradState.EMPTY)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the shard gradient; with ``set_to_none`` (torch's default) also free it, so
        that no gradient bytes are held between the step and the next backward. A shard gradient
        that is the whole chunk's reduced buffer is kept instead, to be the next backward's
        gradient buffer (as DDP keeps its buckets): freed, it came back from ``mmap`` and was
        page-faulted in on every step (GPT-2 81.9M at world size 2, every chunk replicated: a step
        1.2x as long for the same peak)."""
        if set_to_none and not self._reusable_as_buffer:
            self.drop_grad()
        self.grad_valid = False

    def __repr__(self) -> str:
        kind = self.spec.sharding.value + (" frozen" if self.spec.frozen else "")
        return f"Chunk({self.index}, {kind}, {self.spec.capacity} el, {self.state.name}, pins={self.pins})"
