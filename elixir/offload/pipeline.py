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
from elixir.plan.footprint import DISK_STAGING

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
    chunks), runs ``work(i)`` and queues ``i``'s write. A wrong guess costs one discarded read.
    :meth:`drain` (end of backward) finishes the last writes and drops an unused read-ahead.

    ``depth``: chunks in host memory at once, at least 2 (default
    :data:`elixir.plan.footprint.DISK_STAGING`, the number the cost model prices and the runtime
    ledger books through the store). Besides the one worked on and the one read ahead,
    ``depth - 2`` writes stay in flight: at 2 the previous chunk's write is finished before the
    next chunk is staged, so the update and the write never overlap; at 3 (the default) it is
    finished only after the next chunk's ``work``, so the update of chunk ``i`` runs while chunk
    ``i+1`` is written and chunk ``i-1`` read (measured: ``bench/disk_offload.py --breakdown``).
    The writes in flight fill up one per chunk stepped
    (:func:`elixir.plan.footprint.disk_chunks_staged`, as the cost model's timeline counts them).
    """

    def __init__(self, store: DiskStore, order: Sequence[int], depth: int = DISK_STAGING) -> None:
        self.store = store
        self.order = list(order)
        self.depth = depth
        self.ahead: Optional[int] = None  # read queued or done, not yet worked on
        self.writing: list[int] = []  # writes in flight, oldest first
        self.done: set[int] = set()

    @property
    def depth(self) -> int:
        return self._depth

    @depth.setter
    def depth(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"BackwardStager depth {depth}: at least 2 chunks must be staged (the one "
                             "stepped and the one read ahead); use depth=2 for the least host memory")
        self._depth = int(depth)

    def _next(self) -> Optional[int]:
        for i in self.order:
            if i not in self.done:
                return i
        return None

    def run(self, index: int, work: Callable[[int], None]) -> None:
        st = self.store
        try:
            self._finish_writes(keep=self.depth - 2)  # room for this chunk and the next read
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
            self._finish_writes(keep=self.depth - 3)  # room for this chunk's write
            st.start_write(index)
            self.writing.append(index)
        except BaseException:
            self.ahead = None
            self.writing = []
            st.settle()
            raise

    def _finish_writes(self, keep: int) -> None:
        """Finish the oldest writes until at most ``keep`` are in flight."""
        while len(self.writing) > max(0, keep):
            self.store.finish(self.writing.pop(0))
            # backward frees activations while chunks stage: keep their holes from adding up
            release_staging()

    def drain(self) -> None:
        """Finish the last writes and drop an unused read-ahead; ready for the next backward."""
        st = self.store
        try:
            for i in self.writing:
                st.finish(i)
            if self.ahead is not None:
                st.offload(self.ahead, write=False)
        finally:
            self.ahead = None
            self.writing = []
            self.done.clear()
            release_staging()
