"""Gradients of an ElixirModule's trainable chunks: accumulation, reduction, and when each is final.

A post-accumulate-grad hook per parameter adds ``p.grad`` into its chunk's gradient buffer
(:meth:`GradientSync.add`). When every parameter of a chunk expected to get a gradient has one, the
chunk is reduced (reduce-scatter for sharded chunks, all-reduce for replicated ones, mean over
ranks), possibly left running (:data:`REDUCTIONS_IN_FLIGHT`). At the end of backward
(:meth:`GradientSync.finish_backward`) the ranks agree (one small all-reduce) on which parameters
got a gradient on any rank, the rest is reduced, and each chunk whose shard gradient is final is
announced to the grad-ready hooks (the fused backward-and-step), in the same order on every rank.

Invariant: a chunk is announced at most once per backward, only once its reduction completed, and
a gradient arriving for an announced chunk raises (what the hook did with it cannot be undone).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from elixir import device as dev
from elixir import distributed as edist
from elixir.chunk import Chunk, GradState
from elixir.wrapper.backward_tracker import BackwardTracker
from elixir.wrapper.param_map import ParamMap

# Reductions left running on the backend's thread while backward goes on (CPU, world size > 1):
# chunk i's collective runs while chunk i+1's gradients arrive, and completes (then the fused step
# steps chunk i) when chunk i+1's reduction is issued. Each one in flight holds its gradient
# buffer until then (the search counts one: cost_model.fixed_device_bytes). A reduction whose
# buffer becomes the chunk's shard gradient as it is (:meth:`GradientSync.holds_buffer`) holds
# nothing extra and is not counted: it completes at the end of backward at the latest, as DDP's
# buckets do, instead of blocking backward while the next chunk's gradients could be computed.
REDUCTIONS_IN_FLIGHT = 1


class GradientSync:
    """The gradient side of the trainable ``chunks`` (see the module docstring)."""

    def __init__(self, chunks: list[Chunk], param_map: ParamMap, tracker: BackwardTracker,
                 streams: dev.SideStreams, group: Any, world_size: int) -> None:
        self.chunks, self.param_map, self.tracker, self.streams = chunks, param_map, tracker, streams
        self.group, self.world_size = group, world_size
        self.has_grad = [False] * len(param_map)  # per param, agreed across ranks, until zero_grad
        # fn(chunk) once per backward (outside no_sync) for every chunk whose reduced shard gradient
        # is final: during backward as soon as all of the chunk's parameters got their gradients,
        # else at the end of backward once the ranks agreed on which did (has_grad is current for
        # the chunk's parameters either way). A gradient that arrives for a chunk after that
        # raises, since what fn did with it (an optimizer step) cannot be undone. fn may free the
        # shard gradient (Chunk.drop_grad).
        self.grad_ready_hooks: list[Callable[[Chunk], None]] = []
        self.backward_end_hooks: list[Callable[[Any], None]] = []
        self._reducing: list[Chunk] = []  # deferred reductions in flight, oldest first

    def count_ranks(self, flags: list[int]) -> list[int]:
        """Sum ``flags`` over the ranks (the tracker's agreement on uses)."""
        t = torch.tensor(flags, dtype=torch.int32)
        edist.all_reduce(t, self.group)
        return t.tolist()

    def add(self, p: nn.Parameter, g: torch.Tensor, no_sync: bool) -> None:
        """``p``'s gradient ``g`` arrived: add it to its chunk's buffer, reduce a complete chunk."""
        slot = self.param_map.by_param[p]
        chunk = self.chunks[slot.chunk]
        i, ci = slot.index, slot.chunk
        if chunk.grad_state is GradState.REDUCING:
            self.finish_reductions(upto=chunk)  # a late gradient: as if reduced synchronously
        if self.tracker.ready[ci]:
            raise RuntimeError(
                f"elixir: a gradient of {slot.name!r} arrived after its chunk's gradient was final and "
                "the optimizer had stepped it during backward (fused_step): the parameter is used "
                "again after its gradient was complete (e.g. across reentrant checkpoint segments). "
                "Use ElixirOptimizer(..., fused_step=False) for this model."
            )
        chunk.add_grad(slot.offset, g)
        p.grad = None
        if self.tracker.arrive(i) and not no_sync and self.tracker.uniform[ci]:
            self.reduce_chunk(chunk, defer=True)

    def reduce_chunk(self, chunk: Chunk, defer: bool = False) -> None:
        """Reduce ``chunk``'s gradient; with ``defer`` its collective may be left running
        (:data:`REDUCTIONS_IN_FLIGHT`), completed by a later reduction or at the end of backward."""
        chunk.reduce(defer=defer)
        if chunk.grad_state is GradState.REDUCING:
            self._reducing.append(chunk)
            # oldest first, so every rank completes (and announces) chunks in the same order
            while sum(map(self.holds_buffer, self._reducing)) > REDUCTIONS_IN_FLIGHT:
                self._finish_reduction(self._reducing.pop(0))
        else:
            self._after_reduction(chunk)

    def holds_buffer(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s reduction in flight holds a gradient buffer that its completion
        frees. Not when the buffer is kept as the shard gradient (a whole-chunk gradient adopted:
        :attr:`ChunkGrads.adopts`) and no grad-ready hook (the fused step) frees that once the
        chunk is final: then the bytes stay in use whenever the reduction completes (a replicated
        chunk's gradient lives until the optimizer step, as a DDP bucket does). Those in flight
        are waited for only at the end of backward, or by a gradient arriving late for them."""
        grads = chunk.grads
        return bool(self.grad_ready_hooks) or not grads.adopts or grads.valid

    def _finish_reduction(self, chunk: Chunk) -> None:
        chunk.finish_reduction()
        self._after_reduction(chunk)

    def finish_reductions(self, upto: Optional[Chunk] = None) -> None:
        """Complete the deferred reductions in flight, oldest first (through ``upto`` only). If one
        fails (a lost rank), the others are abandoned (each waits for its own collective) and the
        error is raised."""
        while self._reducing:
            c = self._reducing.pop(0)
            try:
                self._finish_reduction(c)
            except BaseException:
                rest, self._reducing = self._reducing, []
                for other in rest:
                    other.abandon_grad()
                raise
            if c is upto:
                break

    def drop_in_flight(self) -> None:
        """An abandoned backward: forget the reductions in flight (each chunk waits for its own
        collective in ``abandon_grad``)."""
        self._reducing.clear()

    def _after_reduction(self, chunk: Chunk) -> None:
        if self.grad_ready_hooks and not self.tracker.ready[chunk.index]:
            # Early (during backward): final only when every parameter of the chunk got its
            # gradient here, so it has one on every rank; otherwise wait for the agreement.
            if self.tracker.chunk_complete(chunk.index):
                for i in self.param_map.by_chunk[chunk.index]:
                    self.has_grad[i] = True
                self._announce(chunk)

    def _announce(self, chunk: Chunk) -> None:
        self.tracker.ready[chunk.index] = True
        for fn in self.grad_ready_hooks:
            fn(chunk)

    def settle_chunk(self, chunk: Chunk) -> None:
        """Before ``chunk`` is stepped during backward: its reduction must be done where the step
        reads the gradient (the host for a host master, else the compute stream)."""
        if chunk.spec.master_on_host:
            self.streams.synchronize()
        else:
            self.streams.join()

    def settle_reductions(self) -> None:
        """End of backward: the compute stream waits for the reductions (device-side), and where a
        reduced gradient was copied to host memory the host waits too, so the optimizer, clipping
        and ``full_grads`` read finished gradients."""
        self.streams.join()
        if any(c.shard_grad is not None and c.spec.master_on_host for c in self.chunks):
            self.streams.synchronize()

    def finish_backward(self, no_sync: bool, owner: Any) -> None:
        """End of backward: complete the reductions in flight; outside ``no_sync``, agree on which
        parameters got gradients, reduce the rest, announce what is final and run the
        backward-end hooks (``fn(owner)``)."""
        tracker = self.tracker
        self.finish_reductions()
        n, k = len(self.param_map), len(self.chunks)
        local = tracker.arrived_or_local()
        if no_sync:
            tracker.local_arrived = local  # remembered for the next synchronising backward
            return
        tracker.local_arrived = [False] * n
        mask = torch.zeros(n + k, dtype=torch.int32)
        if n:
            mask[:n] = torch.tensor(local, dtype=torch.int32)
        for c in self.chunks:
            if c.grad_state is GradState.ACCUMULATING:
                mask[n + c.index] = 1
        if self.world_size > 1:
            edist.all_reduce(mask, self.group, op=torch.distributed.ReduceOp.MAX)
        got = mask.tolist()
        self.has_grad = [a or bool(b) for a, b in zip(self.has_grad, got[:n])]
        for c in self.chunks:
            if got[n + c.index]:
                c.open_grad()
                self.reduce_chunk(c)
            if self.grad_ready_hooks and not tracker.ready[c.index] and c.grad_valid:
                self._announce(c)
            c.end_backward()
        for fn in self.backward_end_hooks:
            fn(owner)
