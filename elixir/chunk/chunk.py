"""One chunk: a flat buffer of packed parameters, and what this rank keeps of it.

A chunk knows nothing about models. It is a state machine (:class:`~elixir.chunk.state.ChunkState`:
released, gathering, held, in compute) composing three parts, one concern each:

- :class:`~elixir.chunk.storage.ChunkStorage`: where its bytes live (the gathered ``payload``
  parameter views point into, this rank's ``shard``, the fp32 ``master``) and their ledger bookings;
- :class:`~elixir.chunk.comm.ChunkComm`: the collectives, per device and backend (shared by every
  chunk of one group);
- :class:`~elixir.chunk.grads.ChunkGrads`: the gradient buffer backward fills, its reduction, and
  the shard gradient kept for the optimizer.

A ``FROZEN`` chunk (:class:`~elixir.chunk.state.ChunkKind`) owns only ``payload`` and ``shard``
(booked as ``frozen_shard``): no master, no gradient buffer, no shard gradient. Asking it for a
gradient is a runtime bug and raises.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from elixir import device as dev
from elixir import distributed as edist
from elixir.chunk.accounting import MemoryLedger
from elixir.chunk.buffers import GradBufferPool
from elixir.chunk.comm import ChunkComm
from elixir.chunk.grads import ChunkGrads
from elixir.chunk.spec import ChunkSpec
from elixir.chunk.state import ChunkState, GradState, check_chunk_move
from elixir.chunk.storage import ChunkStorage


class Chunk:
    """Runtime state of one chunk on this rank (see the module docstring)."""

    def __init__(self, spec: ChunkSpec, ledger: MemoryLedger, group=None, streams: Optional[dev.SideStreams] = None,
                 buffers: Optional[GradBufferPool] = None, comm: Optional[ChunkComm] = None) -> None:
        if spec.state_sharded and spec.capacity % spec.shard_world:
            raise ValueError(f"chunk {spec.index}: capacity {spec.capacity} is not a multiple of its {spec.shard_world} shards")
        self.spec = spec
        self.index = spec.index
        self.ledger = ledger
        # gathers, reductions and refreshes run on these side streams (null stand-ins on CPU)
        self.streams = streams if streams is not None else dev.SideStreams(spec.device)
        # gradient buffers and shard gradients are taken from, and given back to, this pool
        self.buffers = buffers if buffers is not None else GradBufferPool(enabled=False)
        self.comm = comm if comm is not None else ChunkComm(group, spec.shard_world, spec.device)
        self.storage = ChunkStorage(spec, ledger)
        self.grads = ChunkGrads(spec, ledger, self.storage, self.comm, self.streams, self.buffers)
        self.state = ChunkState.RELEASED
        self.pins = 0
        self._ready = None  # event: the last gather's data is in the payload
        self._work = None
        self._publishing = None  # (work, input) of an asynchronous publish
        # told ``gathered(chunk)`` / ``released(chunk)`` as the payload gets or loses its bytes
        # (the wrapper's parameter views: elixir/wrapper/released.py)
        self.observers: list = []

    # ---- what the parts hold (read by the wrapper, the optimizer and the offload store) ----

    @property
    def payload(self) -> torch.Tensor:
        return self.storage.payload

    @property
    def payload_bytes(self) -> int:
        return self.storage.payload_bytes

    @property
    def shard(self) -> Optional[torch.Tensor]:
        return self.storage.shard

    @property
    def master(self) -> Optional[torch.Tensor]:
        return self.storage.master

    @property
    def comp(self) -> Optional[torch.Tensor]:
        """A bf16-kahan master's compensation beside it (None for other formats)."""
        return self.storage.comp

    @property
    def shard_store(self):
        return self.storage.shard_store

    @shard_store.setter
    def shard_store(self, store) -> None:
        self.storage.shard_store = store

    @property
    def group(self):
        return self.comm.group

    @property
    def grad_state(self) -> GradState:
        return self.grads.state

    @property
    def grad_buffer(self) -> Optional[torch.Tensor]:
        return self.grads.buffer

    @property
    def shard_grad(self) -> Optional[torch.Tensor]:
        return self.grads.shard_grad

    @property
    def shard_grad_bytes(self) -> int:
        return self.grads.shard_grad_bytes

    @property
    def grad_valid(self) -> bool:
        return self.grads.valid

    @property
    def narrow_grads_ok(self) -> bool:
        """The shard gradient's consumer reads any dtype (see :attr:`ChunkGrads.narrow_ok`)."""
        return self.grads.narrow_ok

    @narrow_grads_ok.setter
    def narrow_grads_ok(self, ok: bool) -> None:
        self.grads.narrow_ok = ok

    @property
    def defers_reduction(self) -> bool:
        """Whether :meth:`reduce` may leave its collective running (``defer=True``): on a CPU
        device at world size > 1 (:attr:`ChunkComm.defers_reductions`)."""
        return self.comm.defers_reductions

    # ---- initialisation -------------------------------------------------------------------

    def init_from(self, flat: torch.Tensor, compensated: bool = False) -> torch.Tensor:
        """Build payload, shard and master from the full flat values ``flat`` (any float dtype,
        ``capacity`` elements, identical on every rank; ``compensated``: a bf16-kahan master and its
        compensation, :meth:`ChunkStorage.init_from`). Returns the payload (gathered, HOLD) so
        the caller can point parameter views into it, then call :meth:`release` for sharded chunks."""
        payload = self.storage.init_from(flat, compensated)
        self.state = ChunkState.HOLD
        return payload

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
        # The payload is allocated on the compute stream; the gather stream waits for it (and for
        # the compute work that last used the memory), copies and gathers, and records `_ready`.
        self.storage.allocate_payload(f"gathering chunk {self.index}")
        streams = self.streams
        # world size 1 on a CPU with a derived (KK) shard: the shard is the whole payload, so its
        # values go straight into it (one copy of the master, not master -> shard -> payload)
        in_place = (self.spec.shard_on_disk and edist.get_world_size(self.group) == 1
                    and not dev.is_accelerator(self.spec.device) and self.storage.can_stage_into_payload())
        if self.spec.shard_on_disk:
            self._stage_shard_on_every_rank(in_place)  # read it in; dropped once the gather is done (wait)
        # Host shard on an accelerator: brought in non-blocking from pinned memory. At world size
        # 1 that copy is the gather itself (straight into the payload: no staging copy and then
        # a device-to-device one); else it goes through a staging buffer allocated here, on the
        # compute stream like the payload, so every chunk buffer comes from one stream's pool.
        # On CPU host and device are one memory: gather from the shard itself (a copy here was a
        # transient chunk's worth of RSS that no prediction counted).
        h2d = self.spec.shard_on_host and dev.is_accelerator(self.spec.device)
        direct = h2d and edist.get_world_size(self.group) == 1
        quantised = self.storage.codec is not None  # dequantised into the payload (synchronously)
        staging = torch.empty_like(self.shard, device=self.spec.device) if h2d and not (direct or quantised) else None
        with streams.issue(streams.gather) as ready:
            if quantised:
                self.storage.decode_gather(self.comm)
                self._work = None
            elif direct:
                self.payload.copy_(self.shard, non_blocking=dev.non_blocking_ok(self.shard, self.spec.device))
                self._work = None
            elif in_place:
                self._work = None
            else:
                self._work = self.comm.all_gather(self.payload, self.storage.gather_source(staging), async_op=True)
        self._ready = ready
        self.state = ChunkState.GATHERING
        for o in self.observers:
            o.gathered(self)
        if not async_op or self.spec.shard_on_disk:
            # A disk shard's gather is finished now, even a prefetch, so that its staged copy is
            # dropped before this returns: a prefetched chunk would otherwise hold it until used,
            # beside the one a step stages (its read is synchronous anyway; the search prices the
            # rest of its gather as not hidden either, search/cost_model.py:DISK_SHARD_STAGING).
            self.wait()

    def _stage_shard_on_every_rank(self, in_place: bool = False) -> None:
        """Read the disk shard in for a gather (``in_place``: straight into the payload, nothing
        staged); if any rank's read failed, every rank raises
        :class:`~elixir.distributed.DiskFault` here (one one-element all-reduce per disk-shard
        gather at world size > 1), not only the rank whose disk failed while the others wait in
        the gather. The payload allocated for the gather is given back first."""
        error = None
        try:
            self.storage.stage_shard(into_payload=in_place)
        except OSError as e:
            error = e
        try:
            self.comm.agree_on_disk_fault(
                error, f"{edist.where_now() or 'a gather'}: reading chunk {self.index}'s compute shard",
                "; the read changed nothing. Fix the disk, then restart from the last checkpoint (in "
                "forward, or in backward without fused_step, the model and optimizer are as after the "
                "last step, so a checkpoint saved now resumes exactly)")
        except OSError:
            self.storage.drop_staged_shard(write=False)  # staged on a rank whose read worked
            self.storage.free_payload()
            raise

    def wait(self) -> None:
        """Finish an asynchronous gather (GATHERING -> HOLD); no-op otherwise."""
        if self.state is ChunkState.GATHERING:
            streams = self.streams
            if self._work is not None:  # an async collective (a gloo thread, or the NCCL stream)
                work, self._work = self._work, None
                self._ready = streams.after(streams.gather, lambda: self.comm.wait(work))
            streams.wait(self._ready)  # the compute stream waits for this chunk only
            self._ready = None
            if self.spec.shard_on_disk:
                if dev.is_accelerator(self.spec.device):
                    streams.synchronize()  # the host-to-device copy of the staged shard is done
                self.storage.discard_staged_shard()  # the disk copy is current
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
        self.storage.free_payload()
        for o in self.observers:
            o.released(self)

    def shard_access(self, write: bool) -> contextlib.AbstractContextManager[torch.Tensor]:
        """The compute shard, resident for the block (:meth:`ChunkStorage.shard_access`)."""
        return self.storage.shard_access(write)

    def refresh_from_master(self) -> None:
        """After an optimizer step: copy the fp32 master into the compute shard when they differ."""
        self.storage.refresh_from_master(self.streams)

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
        async_op = async_op and self.comm.defers_reductions
        with torch.no_grad(), streams.issue(streams.copy) as ready:
            # the gather's input must not alias its output (gloo): a copy, from the recycled buffers
            mine = self.buffers.take(self.shard.numel(), self.shard.dtype, self.shard.device)
            mine.copy_(self.shard)
            work = self.comm.publish(self.payload, mine, async_op=async_op)
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
            self.comm.wait(work)
            self.buffers.give(mine)

    # ---- gradients (ChunkGrads) -------------------------------------------------------------

    def open_grad(self) -> torch.Tensor:
        """A gradient buffer ready to accumulate into (:meth:`ChunkGrads.open`)."""
        return self.grads.open()

    def add_grad(self, offset: int, grad: torch.Tensor) -> None:
        """Add a gradient into the buffer at ``offset`` (:meth:`ChunkGrads.add`)."""
        self.grads.add(offset, grad)

    def reduce(self, defer: bool = False) -> None:
        """Reduce the gradient buffer into this rank's shard gradient (:meth:`ChunkGrads.reduce`)."""
        self.grads.reduce(defer)

    def finish_reduction(self) -> None:
        self.grads.finish_reduction()

    def drop_grad(self) -> None:
        """Free the shard gradient (:meth:`ChunkGrads.drop`)."""
        self.grads.drop()

    def abandon_grad(self) -> None:
        """Forget a gradient still accumulating (or being reduced) when its backward raised, and
        wait for an asynchronous publish still in flight (its error, if any, is not raised again)."""
        self.grads.abandon()
        with contextlib.suppress(Exception):
            self.finish_publish()
        self.grads.zero()

    def end_backward(self) -> None:
        """Reset the per-backward gradient state (after finalisation)."""
        self.grads.end_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the shard gradient (:meth:`ChunkGrads.zero`)."""
        self.grads.zero(set_to_none)

    def __repr__(self) -> str:
        kind = self.spec.sharding.value + (" frozen" if self.spec.frozen else "")
        return f"Chunk({self.index}, {kind}, {self.spec.capacity} el, {self.state.name}, pins={self.pins})"
