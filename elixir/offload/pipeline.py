"""Running work over disk chunks: a read-ahead pipeline, and a staged-together context.

:func:`run_pipelined` stages the chunks one after another: chunk ``i+1`` is read while ``work(i)``
runs, and chunk ``i`` is written back while chunk ``i+1`` is waited for. Chunk ``i+2``'s read is
queued only once chunk ``i``'s write finished, so at most **two** chunks are staged in host memory
at any time (double buffering). It returns after every write finished, so the disk is consistent
(a checkpoint right after an optimizer step reads the stepped values).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch

from elixir.offload.store import MASTER, DiskStore


def run_pipelined(store: DiskStore, indices: Sequence[int], work: Callable[[int], None]) -> None:
    """``work(i)`` for every chunk ``i`` of ``indices`` while it is staged; each is written back after."""
    order = list(indices)
    if not order:
        return
    try:
        store.start_read(order[0])
        previous: Optional[int] = None
        for n, i in enumerate(order):
            store.finish(i)  # its read
            if previous is not None:
                store.finish(previous)  # its write: frees its buffers before the next read
                previous = None
            if n + 1 < len(order):
                store.start_read(order[n + 1])
            work(i)
            store.start_write(i)
            previous = i
        if previous is not None:
            store.finish(previous)
    except BaseException:
        store.settle()
        raise


@contextlib.contextmanager
def staged(
    store: Optional[DiskStore],
    indices: Sequence[int],
    write_back: bool = True,
    before_write: Optional[Callable[[int], None]] = None,
) -> Iterator[None]:
    """Keep chunks ``indices`` staged together inside the block; on exit run ``before_write(i)``
    and write each back (``write_back``) or drop it unchanged. Chunks already staged stay so."""
    if store is None:
        yield
        return
    mine = [i for i in indices if i in store.chunks and not store.is_resident(i)]
    try:
        for i in mine:
            store.start_read(i)
        for i in mine:
            store.finish(i)
        yield
    finally:
        first = None
        for i in mine:
            try:
                if before_write is not None and write_back:
                    before_write(i)
                store.offload(i, write=write_back)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first


@contextlib.contextmanager
def disk_resident(em, eo=None, write_back: bool = True) -> Iterator[None]:
    """Stage every disk chunk of ``em`` for the block (checkpoint save/load, which read and write
    masters and optimizer state directly). On exit the optimizer state of ``eo`` is bound to the
    disk again and, with ``write_back``, each chunk is written back. Holds all disk chunks in host
    memory at once; a no-op without disk chunks."""
    store = getattr(em, "disk_store", None)
    if store is None:
        yield
        return
    before = None
    if eo is not None:
        from elixir.offload.state_binding import bind_state

        def before(i: int) -> None:
            bind_state(store, eo, i)

    with staged(store, sorted(store.chunks), write_back=write_back, before_write=before):
        yield


@contextlib.contextmanager
def disk_snapshot(em, eo=None) -> Iterator[None]:
    """For the block, ``chunk.master`` of every disk chunk and the optimizer state entries bound to
    it are fresh host copies read from disk (a read-only snapshot, e.g. for a sharded checkpoint,
    which exports tensors to numpy and so must not touch the store's own buffers). Everything is
    put back on exit; the copies are dropped. Holds all disk chunks in host memory at once."""
    store = getattr(em, "disk_store", None)
    if store is None:
        yield
        return
    from elixir.offload.state_binding import _is_bound

    masters: dict[int, object] = {}
    entries: list[tuple[dict, str, object]] = []
    try:
        for i in sorted(store.chunks):
            rec = store.chunks[i]
            copies = store.read_copies(i)
            chunk = em.chunks[i]
            masters[i] = chunk.master
            chunk.master = copies[MASTER]
            if eo is None:
                continue
            for f in eo.chunk_fragments(i):
                st = eo.optim.state.get(f.tensor) or {}
                for k, v in list(st.items()):
                    flat = rec.flats.get(k)
                    if k != MASTER and flat is not None and isinstance(v, torch.Tensor) and _is_bound(v, flat, f.lo, f.hi - f.lo):
                        entries.append((st, k, v))
                        st[k] = copies[k][f.lo : f.hi].view(v.shape)
        yield
    finally:
        for st, k, v in entries:
            st[k] = v
        for i, m in masters.items():
            em.chunks[i].master = m
