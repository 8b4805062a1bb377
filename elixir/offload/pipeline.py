"""Running work over disk chunks: the read-ahead pipeline and the staged-together context
(:mod:`elixir.offload.stream`, re-exported here), and mappings of the offload file for code that
touches masters directly (checkpoints).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch

from elixir.offload.state_binding import FragmentState, bind_state, is_bound
from elixir.offload.store import MASTER, DiskState, DiskStore
from elixir.offload.stream import release_staging, run_pipelined, staged

__all__ = ["disk_mapped", "run_pipelined", "staged"]


@contextlib.contextmanager
def disk_mapped(
    store: Optional[DiskStore],
    fragment_states: Optional[Callable[[int], Sequence[FragmentState]]] = None,
    writable: bool = False,
) -> Iterator[dict[int, torch.Tensor]]:
    """Map every disk chunk's master through ``mmap`` (page cache, not process memory) for the
    block, for code that reads or writes masters and optimizer state directly (checkpoint save and
    load); yields ``{chunk index: master view}`` (empty without a store). Read-only, a chunk still
    staged after a failed write yields its in-memory master instead (its disk copy is stale).

    ``fragment_states(i)`` gives the optimizer state of chunk ``i``'s fragments (see
    :func:`~elixir.offload.state_binding.bind_state`). Read-only (``writable=False``): the state
    entries bound to the disk are swapped for mapped views for the block (private mappings: the
    file never changes). ``writable``: writes to the masters go to the file; on exit the optimizer
    state installed meanwhile (e.g. by loading) is moved to the disk one chunk at a time, so at most
    one chunk is staged."""
    if store is None:
        yield {}
        return
    masters: dict[int, torch.Tensor] = {}
    entries: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for i in sorted(store.chunks):
            rec = store.chunks[i]
            if rec.state is DiskState.RESIDENT and not writable:
                # still staged after a failed write (a full disk): memory holds the current values,
                # so a checkpoint to another disk saves them (state entries are views of them already)
                masters[i] = rec.flats[MASTER]
                continue
            views = store.mapped(i, writable=writable)
            masters[i] = views[MASTER]
            if fragment_states is None or writable:
                continue
            for st, lo, hi in fragment_states(i):
                for k, v in list((st or {}).items()):
                    flat = rec.flats.get(k)
                    if k != MASTER and flat is not None and isinstance(v, torch.Tensor) and is_bound(v, flat, lo, hi - lo):
                        entries.append((st, k, v))
                        st[k] = views[k][lo:hi].view(v.shape)
        yield masters
    finally:
        for st, k, v in entries:
            st[k] = v
        entries.clear()
        masters.clear()
    if writable and fragment_states is not None:
        for i in sorted(store.chunks):
            with staged(store, [i], before_write=lambda j: bind_state(store, j, fragment_states(j))):
                pass


class BackwardStager:
    """Stages disk chunks one at a time in the order their gradients become final during backward
    (the fused backward-and-step), overlapping their reads and writes with the backward compute.

    :meth:`run` stages chunk ``i`` (already read ahead when it was the expected one), queues the
    read of the next expected chunk (``order``: the reverse of the plan order, as backward visits
    chunks), runs ``work(i)`` and queues ``i``'s write. A write is finished before the next chunk is
    staged, so at most **two** chunks are in host memory, as in :func:`run_pipelined`: the one
    being stepped and the one being read (or written). A wrong guess costs one discarded read.
    :meth:`drain` (end of backward) finishes the last write and drops an unused read-ahead.

    ``write_behind`` (opt-in, off by default): the previous chunk's write is finished only after
    ``work(i)``, so it overlaps the next chunk's read and ``work(i)`` instead of preceding them
    (measured with ``bench/disk_offload.py --breakdown``). Then **three** chunks are in host memory
    at once (written, worked on, read), one more than the cost model prices
    (:data:`elixir.plan.footprint.DISK_STAGING`).
    """

    def __init__(self, store: DiskStore, order: Sequence[int], write_behind: bool = False) -> None:
        self.store = store
        self.order = list(order)
        self.write_behind = write_behind
        self.ahead: Optional[int] = None  # read queued or done, not yet worked on
        self.writing: Optional[int] = None
        self.done: set[int] = set()

    def _next(self) -> Optional[int]:
        for i in self.order:
            if i not in self.done:
                return i
        return None

    def run(self, index: int, work: Callable[[int], None]) -> None:
        st = self.store
        try:
            if not self.write_behind:
                self._finish_write()
            if self.ahead is not None and self.ahead != index:
                st.offload(self.ahead, write=False)  # guessed wrong: the disk copy is current
                self.ahead = None
            if self.ahead == index:
                st.finish(index)
                self.ahead = None
            else:
                st.stage(index)
            self.done.add(index)
            nxt = self._next()
            if nxt is not None:
                st.start_read(nxt)
                self.ahead = nxt
            work(index)
            self._finish_write()
            st.start_write(index)
            self.writing = index
        except BaseException:
            self.ahead = self.writing = None
            st.settle()
            raise

    def _finish_write(self) -> None:
        if self.writing is not None:
            self.store.finish(self.writing)
            self.writing = None
            # backward frees activations while chunks stage: keep their holes from adding up
            release_staging()

    def drain(self) -> None:
        """Finish the last write and drop an unused read-ahead; ready for the next backward."""
        st = self.store
        try:
            if self.writing is not None:
                st.finish(self.writing)
            if self.ahead is not None:
                st.offload(self.ahead, write=False)
        finally:
            self.ahead = self.writing = None
            self.done.clear()
            release_staging()
