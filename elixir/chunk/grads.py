"""One chunk's gradients: the buffer backward fills, its reduction, and the shard gradient kept after.

- ``grad_buffer``: the full-size gradient buffer filled during backward, freed once reduced;
- ``shard_grad``: this rank's reduced gradient in ``spec.grad_dtype`` (fp32 by default; bf16/fp16
  halve it, and the fused CPU Adam kernel reads them as they are); ``grad_valid`` says if it holds
  data. It lives until :meth:`ChunkGrads.drop` (the fused backward-and-step frees it once the
  chunk is stepped, so that the shard gradients of all chunks never exist at once).

The moves of :class:`~elixir.chunk.state.GradState` (EMPTY -> ACCUMULATING -> [REDUCING ->]
REDUCED -> EMPTY) are checked at each step. The collectives are the
:class:`~elixir.chunk.comm.ChunkComm`'s; the master and shard the :class:`~elixir.chunk.storage.ChunkStorage`'s.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from elixir import device as dev
from elixir.chunk.accounting import MemoryLedger
from elixir.chunk.buffers import GradBufferPool
from elixir.chunk.comm import ChunkComm
from elixir.chunk.spec import ChunkSpec
from elixir.chunk.state import GradState, check_grad_move
from elixir.chunk.storage import ChunkStorage, location, nbytes


class ChunkGrads:
    """The gradient buffer, the reduction and the shard gradient of one chunk (see the module docstring)."""

    def __init__(self, spec: ChunkSpec, ledger: MemoryLedger, storage: ChunkStorage, comm: ChunkComm,
                 streams: dev.SideStreams, buffers: GradBufferPool) -> None:
        self.spec = spec
        self.ledger = ledger
        self.storage = storage
        self.comm = comm
        self.streams = streams
        self.buffers = buffers  # gradient buffers and shard gradients are taken from, and given back to, it
        self.state = GradState.EMPTY
        self.buffer: Optional[torch.Tensor] = None
        self.shard_grad: Optional[torch.Tensor] = None
        self.valid = False
        # Whether the consumer of the shard gradient reads it in any dtype (the fused Adam kernel
        # does; set by ElixirOptimizer): then a whole-chunk gradient reduced in a narrower dtype
        # than ``spec.grad_dtype`` is kept as reduced (see adopts) instead of widened by a copy.
        self.narrow_ok = False
        self._written: dict[int, int] = {}
        self._reduction: Optional[tuple[Any, Callable[[], None]]] = None  # (work, then) while REDUCING

    @property
    def where(self) -> str:
        """The ledger location of the shard gradient: beside the master."""
        return location(self.spec.optim_placement)

    def _move(self, new: GradState) -> None:
        check_grad_move(self.spec.index, self.state, new)
        self.state = new

    # ---- backward: accumulate ---------------------------------------------------------------

    def open(self) -> torch.Tensor:
        """Make sure a gradient buffer is ready (EMPTY/REDUCED -> ACCUMULATING); return it.

        The buffer is not zero-filled: the first gradient of a parameter is copied in, later ones
        are added, and :meth:`reduce` zeroes only the ranges nothing was written to (padding,
        parameters without a gradient). That saves a fill and an add over the whole chunk.
        """
        spec = self.spec
        if spec.frozen:
            raise RuntimeError(f"chunk {spec.index} is frozen: it takes no gradients (a runtime bug)")
        self.finish_reduction()  # a late gradient: the deferred reduction completes first
        if self.state is not GradState.ACCUMULATING:
            self.ledger.alloc("grad_buffer", "device", nbytes(spec.capacity, spec.reduce_dtype))
            if self.reusable_as_buffer and not self.valid:
                # last step's shard gradient, kept by zero_grad: no allocation, no page faults
                self.ledger.free("shard_grad", self.where, self.shard_grad_bytes)
                self.buffer, self.shard_grad = self.shard_grad, None
            else:
                self.buffer = self.buffers.take(spec.capacity, spec.reduce_dtype, torch.device(spec.device))
            self._written = {}
            self._move(GradState.ACCUMULATING)
        return self.buffer

    def add(self, offset: int, grad: torch.Tensor) -> None:
        """Add a gradient (any shape, ``grad.numel()`` elements) into the buffer at ``offset``."""
        buf = self.open()
        n = grad.numel()
        region = buf[offset : offset + n]
        if offset in self._written:
            region.add_(grad.reshape(-1))
        else:
            region.copy_(grad.reshape(-1))
            self._written[offset] = n

    def _zero_unwritten(self) -> None:
        """Zero every range of the gradient buffer that no gradient was written to."""
        buf, pos = self.buffer, 0
        for offset in sorted(self._written):
            if offset > pos:
                buf[pos:offset].zero_()
            pos = max(pos, offset + self._written[offset])
        if pos < buf.numel():
            buf[pos:].zero_()

    # ---- the reduction ----------------------------------------------------------------------

    def reduce(self, defer: bool = False) -> None:
        """Reduce the gradient buffer (mean over ranks) into this rank's shard gradient.

        With ``defer`` (and the comm's :attr:`~ChunkComm.defers_reductions`), only issue the
        collective: the gradients are ``REDUCING`` until :meth:`finish_reduction`, and the
        buffer stays allocated (and booked) until then."""
        if self.state is not GradState.ACCUMULATING:
            return
        buf = self.buffer
        streams = self.streams
        defer = defer and self.comm.defers_reductions
        with streams.issue(streams.reduce):  # ordered after the compute that filled the buffer
            work, then = self._issue_reduction(buf, async_op=defer)
            if not defer:
                then()
        dev.record_stream(buf, streams.reduce)  # the allocator must not hand it out before the reduce ran
        if defer:
            self._reduction = (work, then)
            self._move(GradState.REDUCING)
            return
        self._reduced()

    def finish_reduction(self) -> None:
        """Wait for a deferred reduction (REDUCING -> REDUCED) and keep its result; no-op otherwise."""
        if self.state is not GradState.REDUCING:
            return
        (work, then), self._reduction = self._reduction, None
        try:
            if work is not None:
                self.comm.wait(work)
        except BaseException:
            self._forget_buffer()
            self._move(GradState.EMPTY)
            raise
        then()
        self._reduced()

    def _reduced(self) -> None:
        self._forget_buffer()
        self._move(GradState.REDUCED)

    def _forget_buffer(self) -> None:
        buf = self.buffer
        if buf is not None:
            self.buffer = None
            self.ledger.free("grad_buffer", "device", nbytes(self.spec.capacity, self.spec.reduce_dtype))
            g = self.shard_grad
            if g is None or g.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
                self.buffers.give(buf)  # not adopted as the shard gradient: free for the next one

    def _issue_reduction(self, buf: torch.Tensor, async_op: bool) -> tuple[Any, Callable[[], None]]:
        """Issue the collective that reduces ``buf``; return its work handle (None when it ran
        synchronously) and the step that keeps its result (divide by the world size, then adopt
        or accumulate into the shard gradient), to run once it finished."""
        spec = self.spec
        world = spec.shard_world
        self._zero_unwritten()
        master = self.storage.master
        direct = (
            spec.sharding.reduce_scatters and world > 1 and not self.valid
            and spec.grad_dtype == buf.dtype and master.device == buf.device
        )
        if direct:
            self._alloc_shard_grad()  # reduce-scatter straight into the (empty) shard gradient
            out = self.shard_grad
            work = self.comm.reduce_scatter(out, buf, async_op=async_op)

            def then() -> None:
                out.div_(world)
                self.valid = True

            return work, then
        if spec.sharding.reduce_scatters:
            out = buf[spec.shard_offset : spec.shard_offset + spec.shard_numel] if world == 1 else torch.empty(
                spec.shard_numel, dtype=buf.dtype, device=buf.device
            )
            work = self.comm.reduce_scatter(out, buf, async_op=async_op)
        else:  # all-reduced; ZeRO-1 keeps this rank's slice
            work = self.comm.all_reduce(buf, async_op=async_op)
            out = buf[spec.shard_offset : spec.shard_offset + spec.shard_numel]

        def then() -> None:
            if world > 1:
                out.div_(world)
            if self.adopts and not self.valid:
                self._adopt(out)
            else:
                self._accumulate(out)

        return work, then

    # ---- the shard gradient -----------------------------------------------------------------

    @property
    def is_whole_chunk(self) -> bool:
        """Whether the shard gradient can be the reduced gradient buffer itself (and back): the
        shard is the whole chunk (a replicated chunk, or any chunk at world size 1), beside a
        master that is not on the host."""
        spec, master = self.spec, self.storage.master
        return (spec.shard_numel == spec.capacity and not spec.master_on_host and master is not None
                and master.device == torch.device(spec.device))

    @property
    def adopts(self) -> bool:
        """Whether a backward's reduced buffer becomes the shard gradient as it is: a whole-chunk
        gradient in ``spec.grad_dtype``, or reduced in a narrower dtype (bf16 chunks reduce in bf16)
        for a consumer that reads any dtype (:attr:`narrow_ok`). Kept narrow, it holds exactly
        the values the wider copy would (a widening cast is exact) without the copy, its page
        faults or its bytes; a second backward that accumulates into it widens it first
        (:meth:`_accumulate`), so sums are still taken in ``spec.grad_dtype``."""
        spec = self.spec
        if not self.is_whole_chunk:
            return False
        if spec.reduce_dtype == spec.grad_dtype:
            return True
        return self.narrow_ok and torch.finfo(spec.reduce_dtype).bits < torch.finfo(spec.grad_dtype).bits

    @property
    def reusable_as_buffer(self) -> bool:
        """Whether the kept shard gradient can be the next backward's gradient buffer."""
        g = self.shard_grad
        return g is not None and self.is_whole_chunk and g.dtype == self.spec.reduce_dtype and g.numel() == self.spec.capacity

    @property
    def shard_grad_bytes(self) -> int:
        """Bytes of the shard gradient: in its own dtype when it exists (a kept narrow one, see
        :attr:`adopts`), else in ``spec.grad_dtype``."""
        g = self.shard_grad
        return nbytes(self.spec.shard_numel, g.dtype if g is not None else self.spec.grad_dtype)

    def _adopt(self, reduced: torch.Tensor) -> None:
        """Keep the reduced buffer as the shard gradient instead of copying it into one: saves a
        copy of the chunk and, at the peak of backward, one chunk's gradient bytes (the buffer and
        the shard gradient no longer coexist)."""
        self.drop()
        self.shard_grad = reduced
        self.ledger.alloc("shard_grad", self.where, self.shard_grad_bytes)
        self.valid = True

    def _alloc_shard_grad(self) -> None:
        if self.shard_grad is None:
            n, dt = self.spec.shard_numel, self.spec.grad_dtype
            # from the pool that drop() gives it back to. Allocated outside it, each step's shard
            # gradients were new and the last step's stayed in the pool: one more fp32 copy of the
            # chunks per step, unbooked (GPT-2 354M, replicated with its optimizer state on the
            # host: OOM-killed at 12 GB per rank for a predicted 8.5 GiB). With the master on the
            # host it is page-locked (with an accelerator), so the device-to-host copy is non-blocking
            if self.spec.master_on_host:
                self.shard_grad = self.buffers.take(n, dt, torch.device("cpu"), pin=self.spec.pin_memory)
            else:
                self.shard_grad = self.buffers.take(n, dt, self.storage.master.device)
            self.ledger.alloc("shard_grad", self.where, self.shard_grad_bytes)
            self.valid = False

    def _accumulate(self, reduced: torch.Tensor) -> None:
        n = self.spec.shard_numel
        g = self.shard_grad
        if g is not None and g.dtype != self.spec.grad_dtype:  # a kept narrow one (see adopts)
            if self.valid:  # accumulated in spec.grad_dtype from here on: widen it (exact)
                self.ledger.free("shard_grad", self.where, self.shard_grad_bytes)
                self.shard_grad = g.to(self.spec.grad_dtype)
                self.ledger.alloc("shard_grad", self.where, self.shard_grad_bytes)
            else:
                self.drop()
        self._alloc_shard_grad()
        if self.valid:
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
            self.valid = True

    def drop(self) -> None:
        """Free the shard gradient (after the fused backward-and-step consumed it); the next
        reduction allocates a fresh one."""
        if self.shard_grad is not None:
            self.ledger.free("shard_grad", self.where, self.shard_grad_bytes)
            self.buffers.give(self.shard_grad)
            self.shard_grad = None
        self.valid = False

    def abandon(self) -> None:
        """Forget a gradient still accumulating (or being reduced) when its backward raised
        (ACCUMULATING / REDUCING -> EMPTY). A deferred reduction is waited for first (its
        collective still writes the buffer); its error, if any, is not raised again here."""
        if self.state is GradState.REDUCING:
            work, self._reduction = self._reduction[0], None
            if work is not None:
                with contextlib.suppress(Exception):
                    self.comm.wait(work)
        if self.state in (GradState.ACCUMULATING, GradState.REDUCING):
            self._forget_buffer()
            self._move(GradState.EMPTY)

    def end_backward(self) -> None:
        """Reset the per-backward gradient state (after finalisation)."""
        if self.state in (GradState.ACCUMULATING, GradState.REDUCING):
            raise RuntimeError(f"chunk {self.spec.index}: backward ended with unreduced gradients")
        if self.state is GradState.REDUCED:
            self._move(GradState.EMPTY)

    def zero(self, set_to_none: bool = True) -> None:
        """Forget the shard gradient; with ``set_to_none`` (torch's default) also free it, so
        that no gradient bytes are held between the step and the next backward. A shard gradient
        that is the whole chunk's reduced buffer is kept instead, to be the next backward's
        gradient buffer (as DDP keeps its buckets): freed, it came back from ``mmap`` and was
        page-faulted in on every step (GPT-2 81.9M at world size 2, every chunk replicated: a step
        1.2x as long for the same peak)."""
        if set_to_none and not self.reusable_as_buffer:
            self.drop()
        self.valid = False
