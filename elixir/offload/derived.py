"""Compute shards derived from their fp32 masters on disk (``KK`` chunks: shard and state on disk).

A trainable chunk whose compute shard and fp32 master are both on disk keeps one copy of its
values there, the master: its compute shard (bf16, fp16 or fp32) is the master cast down, so it is
derived on each read instead of being stored beside it. That saves the shard's bytes on disk
(12 instead of 14 bytes per element in bf16 with Adam; 12 instead of 16 in fp32) and the shard's
write after every step, at the cost of reading 4 bytes per element at each gather instead of the
compute dtype's 2. Casting is round-to-nearest-even, as the optimizer's own refresh of the shard
(torch's ``copy_`` and the fused CPU Adam kernel both round so), so a derived shard is bit for bit
the shard a step would have written. A ``bf16-kahan`` master's fp32 shard is the master plus its
Kahan compensation (the ``master_comp`` state flat of the same record, read after the master
through the same buffers and added in fp32), as a step writes a host shard: the master alone lags
the optimizer by up to half a bf16 ulp (issue 33). That reads 4 bytes per element instead of 2;
a bf16 shard reads the master alone, the compensated master rounded to nearest.

:class:`DerivedShards` has the part of :class:`~elixir.offload.DiskStore`'s interface that a
:class:`~elixir.chunk.Chunk` uses for its ``shard_store`` (``stage``, ``discard``, ``offload``), so
the chunk does not know which kind of store holds its shard. Writing a derived shard back is a
no-op: whoever changes a chunk's values changes its master (the optimizer, checkpoint and
pretrained loading all do), and the next read derives the new shard from it.

**Read-ahead.** A gather's read is synchronous, so in forward the disk would idle while each
chunk computes. When a shard has its master's dtype (fp32 compute, or a bf16 master under bf16),
the bytes on disk *are* the shard: so once a gather dropped chunk ``i``'s staged shard, the read of
the chunk that followed ``i`` last time (learned from the order of :meth:`DerivedShards.stage`
calls made with gradients enabled, i.e. training forwards; the chain restarts once a step wrote
masters) is queued straight into that chunk's shard, and its gather only waits for it. At most
one shard is staged at any time, read-ahead included (the one the cost model prices,
:data:`elixir.plan.footprint.DISK_SHARD_STAGING`; booked in the ledger when queued). A read-ahead
is used only if its master's disk copy is still the one it read (:meth:`DiskStore.is_current`),
and dropped at the next gather of another chunk: a wrong guess costs one read, never a stale
value. A shard of another dtype than its master is still read through the two small buffers
(reading it ahead would need a whole chunk's master-dtype buffer that nothing prices).

**In place.** At world size 1 on a CPU the shard is the whole payload, so a gather fills the
payload straight from the master (:meth:`DerivedShards.stage_into`): one copy of a staged master
(the fused step's read-ahead in backward) or of a read-ahead, instead of master -> shard -> payload,
and no shard staged but a read-ahead.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from elixir.offload.aio import IOHandle
from elixir.offload.store import COMP, MASTER, DiskState, DiskStore, Ledger
from elixir.plan import DERIVED_SHARD_PIECE_ELEMENTS as PIECE_ELEMENTS
from elixir.plan.footprint import DERIVED_SHARD_READ_BUFFERS


class _DerivedShard:
    """One chunk's compute shard: a 1-D tensor whose storage is resized to 0 bytes when offloaded."""

    def __init__(self, index: int, shard: torch.Tensor, ledger_kind: str) -> None:
        self.index = index
        self.shard = shard
        self.ledger_kind = ledger_kind
        self.state = DiskState.RESIDENT

    @property
    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()


class DerivedShards:
    """The compute shards of this rank's ``KK`` chunks, each read as its master cast down (see the
    module docstring). ``masters``: the :class:`DiskStore` holding the chunks' fp32 masters."""

    def __init__(self, masters: DiskStore, ledger: Optional[Ledger]) -> None:
        self.masters = masters
        self.ledger = ledger
        self.chunks: dict[int, _DerivedShard] = {}
        self._pieces: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.staged_bytes = 0
        self.peak_staged_bytes = 0
        self.bytes_read = 0
        self.bytes_written = 0  # always 0: nothing is written, kept for DiskStore's report shape
        self.stage_seconds = 0.0  # wall time of stage() reading from the file (a gather's read and cast)
        self.read_ahead = True  # queue the next forward gather's read (module docstring)
        # gathers fill a world-size-1 payload straight from the master, and steps neither stage
        # nor refresh these shards (ChunkStorage.shard_is_derived); False only to time the older
        # copying path (bench/disk_offload.py --breakdown's "before")
        self.in_place = True
        self.read_ahead_bytes = 0  # read ahead and used by the gather
        self.wasted_read_ahead_bytes = 0  # read ahead and dropped (a wrong guess, or the master changed)
        self._ahead: Optional[tuple[int, IOHandle, int]] = None  # (chunk, read, master's version)
        self._last: Optional[int] = None  # the last chunk staged with gradients enabled
        self._after: dict[int, int] = {}  # chunk -> the one staged after it last time
        self._writes_seen = 0  # masters.bytes_written when _last was set

    def register(self, index: int, shard: torch.Tensor, ledger_kind: str) -> None:
        """Take over chunk ``index``'s resident shard (resizable, owning its storage; booked in the
        ledger as ``ledger_kind`` on host) once its master is in ``masters``: free its bytes."""
        if index not in self.masters.chunks:
            raise ValueError(f"chunk {index}: a derived shard needs its master on disk first")
        if shard.numel() != self.masters.chunks[index].numel:
            raise ValueError(f"chunk {index}: shard of {shard.numel()} elements, master of {self.masters.chunks[index].numel}")
        rec = _DerivedShard(index, shard, ledger_kind)
        self.chunks[index] = rec
        self._book(rec.nbytes)
        self.discard(index)

    def _book(self, nbytes: int) -> None:
        self.staged_bytes += nbytes
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def _allocate(self, rec: _DerivedShard, state: DiskState) -> None:
        rec.shard.untyped_storage().resize_(rec.nbytes)
        if self.ledger is not None:
            self.ledger.alloc(rec.ledger_kind, "host", rec.nbytes)
        rec.state = state
        self._book(rec.nbytes)

    def stage(self, index: int) -> None:
        """Make chunk ``index``'s shard resident: its master cast down, from memory when the master
        is staged, else from its read-ahead, else read from the offload file through two small
        buffers."""
        rec = self.chunks[index]
        self._learn(index)
        if rec.state is DiskState.RESIDENT:
            return
        if self._ahead is not None and self._take_ahead(index):
            return
        self._allocate(rec, DiskState.RESIDENT)
        try:
            self._read(index, rec.shard)
        except BaseException:
            self._free(index)
            raise

    def stage_into(self, index: int, out: torch.Tensor) -> None:
        """Fill ``out`` (the chunk's payload at world size 1: the shard's length and dtype) with
        chunk ``index``'s shard values without staging the shard: one copy of the master instead
        of two (master -> shard -> payload) when the master is staged or read ahead by the fused
        step, and the file read through the pieces straight into ``out`` otherwise. A read-ahead
        of this chunk is copied from; the next chunk's read is queued after (module docstring)."""
        rec = self.chunks[index]
        self._learn(index)
        took = rec.state is not DiskState.RESIDENT and self._ahead is not None and self._take_ahead(index)
        if rec.state is DiskState.RESIDENT:  # read ahead (freed once copied), or staged by its owner
            t0 = time.perf_counter()
            out.copy_(rec.shard)
            self.stage_seconds += time.perf_counter() - t0
            if took:
                self._free(index)
        else:
            self._read(index, out)
        if self.read_ahead and index == self._last and torch.is_grad_enabled():
            self._start_ahead(index)

    def _read(self, index: int, out: torch.Tensor) -> None:
        """``out`` = chunk ``index``'s master cast to ``out``'s dtype (from memory when the master
        is staged, else from the file through the two pieces)."""
        if self._pieces is None:  # sized for the largest shard, held from now on (read_buffer_bytes)
            n = min(PIECE_ELEMENTS, max(r.shard.numel() for r in self.chunks.values()))
            dt = self.masters.chunks[index].flats[MASTER].dtype  # fp32, or a bf16 master (issue 33)
            self._pieces = tuple(torch.empty(n, dtype=dt) for _ in range(DERIVED_SHARD_READ_BUFFERS))
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                self.bytes_read += self.masters.read_converted(index, MASTER, out, self._pieces)
                if self.compensated(index, out.dtype):  # then the compensation, through the same pieces
                    self.bytes_read += self.masters.read_converted(index, COMP, out, self._pieces, add=True)
        finally:
            self.stage_seconds += time.perf_counter() - t0

    def compensated(self, index: int, dtype: torch.dtype) -> bool:
        """Whether chunk ``index``'s shard in ``dtype`` is its bf16-kahan master plus the Kahan
        compensation (the ``master_comp`` state flat, there once the optimizer state is bound to
        the disk): in fp32, as the optimizer's own refresh of the shard writes it (module
        docstring). A bf16 shard is the master alone (the compensated master rounded to nearest)."""
        rec = self.masters.chunks[index]
        return dtype == torch.float32 and rec.flats[MASTER].dtype == torch.bfloat16 and COMP in rec.flats

    # ---- read-ahead (module docstring) ------------------------------------------------------

    def _learn(self, index: int) -> None:
        """Record which chunk followed the last one staged in a training forward."""
        if not torch.is_grad_enabled() or self.masters.bytes_written != self._writes_seen:
            self._last = None  # not a training forward, or a step wrote masters since: a new chain
            self._writes_seen = self.masters.bytes_written
        if not torch.is_grad_enabled():
            return
        if self._last is not None and self._last != index:
            self._after[self._last] = index
        self._last = index

    def _start_ahead(self, after: int) -> None:
        """Queue the read of the chunk expected after ``after`` into its shard (none staged now)."""
        nxt = self._after.get(after)
        if nxt is None or self._ahead is not None or self.staged_bytes:
            return
        rec, master = self.chunks[nxt], self.masters.chunks[nxt]
        if rec.state is not DiskState.OFFLOADED or master.state is not DiskState.OFFLOADED:
            return
        if master.flats[MASTER].dtype != rec.shard.dtype or self.compensated(nxt, rec.shard.dtype):
            return  # cast (or compensated) on the way in: read through the pieces at the gather
        self._allocate(rec, DiskState.READING)
        try:
            handle, nbytes, version = self.masters.read_flat(nxt, MASTER, rec.shard)
        except BaseException:
            self._free(nxt)
            raise
        self.bytes_read += nbytes
        self._ahead = (nxt, handle, version)

    def _finish_ahead(self) -> tuple[int, bool]:
        """Wait for the read-ahead in flight and forget it (its shard is then RESIDENT, whatever
        it holds): (its chunk, whether those are the master's current values)."""
        index, handle, version = self._ahead
        self._ahead = None
        t0 = time.perf_counter()
        ok = True
        try:
            handle.wait()
        except OSError:
            ok = False  # the gather reads again, and reports the disk's error if it persists
        finally:
            dt = time.perf_counter() - t0
            self.stage_seconds += dt
            self.masters.converted_wait_seconds += dt  # a gather waiting on the disk, as a converted read
            self.chunks[index].state = DiskState.RESIDENT
        return index, ok and self.masters.is_current(index, version)

    def _take_ahead(self, index: int) -> bool:
        """Use the read-ahead if it is chunk ``index``'s and still current; drop it otherwise."""
        ahead, ok = self._finish_ahead()
        if ahead == index and ok:
            self.read_ahead_bytes += self.chunks[ahead].nbytes
            return True
        self.wasted_read_ahead_bytes += self.chunks[ahead].nbytes
        self._free(ahead)
        return False

    def drop_read_ahead(self) -> None:
        """Wait for a read-ahead in flight and free its shard."""
        if self._ahead is not None:
            ahead, _ = self._finish_ahead()
            self.wasted_read_ahead_bytes += self.chunks[ahead].nbytes
            self._free(ahead)

    def discard(self, index: int) -> None:
        """Free chunk ``index``'s shard after its gather (its master stays the truth); in a
        training forward, queue the next chunk's read (module docstring)."""
        if self._ahead is not None and self._ahead[0] == index:
            self.drop_read_ahead()  # waits for the read before the buffer goes
            return
        if self._free(index) and self.read_ahead and index == self._last and torch.is_grad_enabled():
            self._start_ahead(index)

    def _free(self, index: int) -> bool:
        """Free a staged shard's bytes; False when none were staged."""
        rec = self.chunks[index]
        if rec.state is DiskState.OFFLOADED:
            return False
        if not rec.shard.untyped_storage().resizable():
            raise RuntimeError(
                f"disk chunk {index}: the host buffer of its shard was exported (e.g. with .numpy()) and "
                "cannot be freed; copy disk-resident tensors (.clone()) before exporting them"
            )
        rec.shard.untyped_storage().resize_(0)
        rec.state = DiskState.OFFLOADED
        self._book(-rec.nbytes)
        if self.ledger is not None:
            self.ledger.free(rec.ledger_kind, "host", rec.nbytes)
        return True

    def offload(self, index: int, write: bool = True) -> None:
        """Free chunk ``index``'s shard (no read-ahead follows: not a gather); ``write`` changes
        nothing (the master holds the values)."""
        if self._ahead is not None and self._ahead[0] == index:
            self.drop_read_ahead()
        self._free(index)

    def settle(self) -> None:
        self.drop_read_ahead()
        for index in self.chunks:
            self._free(index)

    def is_resident(self, index: int) -> bool:
        return self.chunks[index].state is DiskState.RESIDENT

    @property
    def read_buffer_bytes(self) -> int:
        """Host bytes of the read buffers (allocated at the first read, then held)."""
        return 0 if self._pieces is None else sum(p.numel() * p.element_size() for p in self._pieces)

    def report(self) -> dict[str, int]:
        """Host bytes staged now and at peak, and bytes read so far (as :meth:`DiskStore.report`;
        no file of its own: ``file_bytes`` and ``bytes_written`` are 0), and the read buffers'."""
        return {
            "read_buffer_bytes": self.read_buffer_bytes,
            "disk_chunks": len(self.chunks),
            "file_bytes": 0,
            "staged_bytes": self.staged_bytes,
            "peak_staged_bytes": self.peak_staged_bytes,
            "max_chunk_staged_bytes": max((r.nbytes for r in self.chunks.values()), default=0),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
        }

    def page_cache_bytes(self) -> int:
        return 0  # reads go through the masters' file, counted there

    def reset_peak(self) -> None:
        self.peak_staged_bytes = self.staged_bytes

    def close(self) -> None:
        """Free the read buffers (after any read-ahead in flight); the masters' store owns the file."""
        self.drop_read_ahead()
        self._pieces = None
