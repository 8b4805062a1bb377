"""The fused backward-and-step: each chunk's optimizer steps as soon as its gradient is final.

Without it, every chunk keeps its reduced shard gradient until ``optimizer.step()``, so the
gradients of the whole model exist at once (4 bytes per parameter in fp32). With it, the module
announces each chunk whose reduced gradient is final (:meth:`ElixirModule.register_grad_ready_hook`:
during backward as soon as all of the chunk's parameters got theirs, else at the end of backward),
and :class:`BackwardStep` steps that chunk's fragments right away, refreshes its compute shard and
frees its shard gradient. At most a few chunks' gradients exist at any time. Disk-placed chunks are
staged one at a time through :class:`~elixir.offload.pipeline.BackwardStager`, so their reads and
writes overlap the rest of backward.

It is exact: each chunk is stepped with the same gradient, hyper-parameters and kernel as the
separate step would use (in fp32 the result is bitwise equal). It is valid only when nothing needs
every gradient before the first update, so :func:`fallback_reason` names what forbids it: global
clipping (``max_norm``; the global norm is known only once backward ended) and fp16 loss scaling
(every rank must agree there is no inf/NaN gradient anywhere before any step). Accumulating over
several backwards must use ``module.no_sync()`` (a backward outside it is an optimizer step);
a second backward before ``optimizer.step()`` raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from elixir.offload.pipeline import BackwardStager
from elixir.offload.state_binding import bind_state
from elixir.wrapper.disk_faults import StepFaultPoints

if TYPE_CHECKING:
    from elixir.chunk import Chunk
    from elixir.wrapper.interfaces import ShardedOptimizer


def fallback_reason(max_norm: float, loss_scaling: bool) -> Optional[str]:
    """Why the fused backward-and-step cannot run with these settings (None: it can)."""
    if max_norm > 0:
        return (
            f"max_norm={max_norm} clips by the global gradient norm, known only after the whole "
            "backward; pass max_norm=0 to fuse"
        )
    if loss_scaling:
        return "fp16 loss scaling must see every gradient (inf/NaN on any rank) before any step"
    return None


class BackwardStep:
    """Steps ``eo``'s chunks from the module's grad-ready hook (see the module docstring)."""

    def __init__(self, eo: ShardedOptimizer) -> None:
        self.eo = eo
        em = eo.module
        store = em.disk_store
        self.stager = BackwardStager(store, sorted(store.chunks, reverse=True)) if store is not None else None
        self.stepped: set[int] = set()
        self.points: Optional[StepFaultPoints] = None  # this backward's disk-fault agreement points
        self.step_of, self.ended = 0, True  # the step the chunks in `stepped` belong to; its backward ended
        em.register_grad_ready_hook(self._on_ready)
        em.register_backward_end_hook(self._on_backward_end)

    def detach(self) -> None:
        """Stop stepping from the module's hooks (a newer optimizer took over the module)."""
        self.eo.module.remove_hook(self._on_ready)
        self.eo.module.remove_hook(self._on_backward_end)

    def _on_ready(self, chunk: Chunk) -> None:
        i = chunk.index
        eo = self.eo
        if self.stepped and not self.ended and self.step_of != eo.module.iteration:
            # the last backward stopped (an error: a disk fault, a lost rank) after it had stepped
            # some chunks: that step is partly applied
            eo.torn_step = self.step_of
            self.finish_step()
        if i in self.stepped:
            raise RuntimeError(
                "elixir: a second backward ran before optimizer.step(), but with fused_step every "
                "backward outside module.no_sync() already is an optimizer step. Accumulate gradients "
                "inside `with model.no_sync():`, or use ElixirOptimizer(..., fused_step=False)."
            )
        if not self.stepped:
            eo.refuse_torn_step()
            self.step_of, self.ended = eo.module.iteration, False
            if self.stager is not None:
                self.points = StepFaultPoints(eo.module.group, eo.module.iteration, "fused backward-and-step")
        self.stepped.add(i)
        eo.module.settle_chunk(chunk)  # the reduction may still run on its side stream
        if self.stager is not None and i in self.stager.store.chunks:
            with eo.marking_torn_step():
                try:
                    self.stager.run(i, self.points.guard(self._step_disk_chunk))
                except OSError as e:  # reported on every rank here, or at the next point
                    self.points.failed(e, i, defer=True)
        else:
            eo.step_chunk(i)
        chunk.drop_grad()

    def _step_disk_chunk(self, i: int) -> None:
        self.eo.step_chunk(i)
        bind_state(self.eo.disk_store, i, self.eo.fragment_states(i))

    def _on_backward_end(self, module) -> None:
        if self.stager is not None and self.points is None:
            self.stager.drain()
        elif self.stager is not None:
            with self.eo.marking_torn_step():
                try:
                    self.stager.drain()  # the last write
                except OSError as e:
                    self.points.failed(e, None, defer=True)
                self.points.point(None)
        self.ended = True
        # step() was not called for these updates: tell an LR scheduler that the optimizer stepped
        self.eo.optim._opt_called = True

    def finish_step(self) -> None:
        """``optimizer.step()`` after a fused backward: the chunks are stepped already."""
        self.stepped.clear()
        self.points = None
