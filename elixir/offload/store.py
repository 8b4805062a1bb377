"""DiskStore: the fp32 masters and optimizer state of disk-placed chunks, in one file per rank.

Each disk chunk owns *flats*: 1-D tensors of the chunk's shard length, one for the fp32 master
(the chunk's own ``master`` tensor) and one per elementwise optimizer-state key (``exp_avg``,
``exp_avg_sq``...), each with its own byte region in the rank's offload file. Every tensor the rest
of the runtime holds (fragments, optimizer state entries) is a view of a flat, so it keeps its
identity and shape while the flat's storage is resized to 0 bytes between uses (as a released
chunk payload is): the host then holds none of the chunk's master or state, and a stray access
raises instead of reading stale values.

A record may be *filled* only in a prefix (a chunk's padding is its tail, and stays zero): after its
first write, which lays the whole region down, reads and writes move the filled prefix only and a
read zeroes the rest in memory, so padding costs no disk traffic.

A chunk moves OFFLOADED -> READING -> RESIDENT -> WRITING -> OFFLOADED (checked): reads and writes
are queued on the async I/O engine (:mod:`elixir.offload.aio`) and finished by :meth:`DiskStore.finish`.
The master's host bytes are recorded in the runtime's memory ledger only while staged.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

import torch

from elixir.offload.aio import ALIGN, AsyncFileIO, IOHandle, make_io
from elixir.offload.directory import open_offload_file, page_cache_bytes

MASTER = "master"
COMP = "master_comp"  # a bf16-kahan master's compensation (elixir.optim.lowbit), a flat beside it


class Ledger(Protocol):
    """What the store needs of the runtime's memory ledger (``elixir.chunk.MemoryLedger``)."""

    def alloc(self, kind: str, where: str, nbytes: int) -> None: ...

    def free(self, kind: str, where: str, nbytes: int) -> None: ...


class DiskState(enum.Enum):
    """Where a disk-resident chunk's bytes are: only on disk, being read, in memory, or being written."""

    OFFLOADED = "offloaded"  # only on disk; flats hold 0 bytes
    READING = "reading"  # flats allocated, reads in flight
    RESIDENT = "resident"  # flats hold the current values (they may be newer than the disk)
    WRITING = "writing"  # writes in flight; flats freed when they finish


_MOVES = {
    DiskState.OFFLOADED: {DiskState.READING},
    DiskState.READING: {DiskState.RESIDENT, DiskState.OFFLOADED},  # OFFLOADED: the read failed
    DiskState.RESIDENT: {DiskState.WRITING, DiskState.OFFLOADED},
    DiskState.WRITING: {DiskState.OFFLOADED, DiskState.RESIDENT},  # RESIDENT: the write failed
}


@dataclass(frozen=True)
class Region:
    """A byte range of the offload file."""

    offset: int
    nbytes: int


@dataclass
class DiskChunk:
    """One disk-placed chunk on this rank: its flats (``MASTER`` and state keys) and file regions."""

    index: int
    numel: int
    filled: Optional[int] = None  # elements transferred (a prefix; the rest is zero padding); None: all
    flats: dict[str, torch.Tensor] = field(default_factory=dict)
    regions: dict[str, Region] = field(default_factory=dict)
    state: DiskState = DiskState.RESIDENT
    pending: list = field(default_factory=list)
    reads: dict = field(default_factory=dict)  # flat key -> its read's handle, while READING
    version: int = 0  # bumped whenever the disk copy may change (a write queued, a writable mapping)
    laid_down: set = field(default_factory=set)  # flat keys written whole once (the padding is on disk)

    @property
    def moved(self) -> int:
        """Elements each transfer moves: the filled prefix."""
        return self.numel if self.filled is None else self.filled

    @property
    def staged_bytes(self) -> int:
        """Host bytes the chunk holds when staged (master plus every state flat)."""
        return sum(r.nbytes for r in self.regions.values())


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _owned_flats(index: int, flats: dict[str, torch.Tensor], filled: Optional[int]) -> dict[str, torch.Tensor]:
    """``flats`` (the first one's length), checked to be 1-D and to own their storage exactly, as a
    new record's flats must (and ``filled`` a prefix of them)."""
    numel = next(iter(flats.values())).numel()
    for k, t in flats.items():
        if t.dim() != 1 or not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != _nbytes(t):
            raise ValueError(f"chunk {index}: a disk-placed {k} must own its storage exactly")
        if t.numel() != numel:
            raise ValueError(f"chunk {index}: {k} of {t.numel()} elements, the record's flats of {numel}")
    if filled is not None and not 0 <= filled <= numel:
        raise ValueError(f"chunk {index}: {filled} filled elements of {numel}")
    return flats


def _put(out: torch.Tensor, values: torch.Tensor, add: bool) -> None:
    """``out`` = ``values`` converted to its dtype, or (``add``) ``out + values`` rounded once."""
    if add:
        out.add_(values)
    else:
        out.copy_(values)


class _Done:
    """The handle of a transfer of no bytes."""

    def wait(self) -> None:
        return None


class DiskStore:
    """Disk-resident masters and optimizer state of this rank's disk chunks (see module docstring).

    Args:
        ledger: the runtime's memory ledger (staged masters are booked as ``master`` on ``host``);
            None for a store without masters (an optimizer's own offload, :mod:`elixir.optim.nvme`).
        offload_dir: directory for the offload file (None: a per-run temporary directory).
        need_bytes: bytes to reserve up front (masters plus the expected optimizer state).
        rank: this rank (names the file).
        io: the async engine (default: :func:`~elixir.offload.aio.make_io`).
        direct: also open the file with ``O_DIRECT`` for aligned transfers.
    """

    def __init__(
        self,
        ledger: Optional[Ledger],
        offload_dir: Optional[str],
        need_bytes: int,
        rank: int = 0,
        io: Optional[AsyncFileIO] = None,
        direct: bool = False,
    ) -> None:
        self.ledger = ledger
        self.location = open_offload_file(offload_dir, need_bytes, rank, direct=direct)
        self.io = io if io is not None else make_io()
        self.chunks: dict[int, DiskChunk] = {}
        self._end = 0
        self.staged_bytes = 0
        self.peak_staged_bytes = 0
        self.bytes_read = 0
        self.bytes_written = 0
        # seconds the caller spent blocked on this store's transfers: staging (finish) and converted
        # reads (read_converted, a derived shard's gather); with the byte counters, what a profile
        # of a disk-bound step (bench/disk_offload.py --breakdown) splits into I/O and compute
        self.wait_seconds = 0.0
        self.converted_wait_seconds = 0.0
        self._booked: dict[str, str] = {}  # flat key -> ledger kind its staged bytes are booked under

    @property
    def path(self) -> str:
        return self.location.path

    # ---- layout ------------------------------------------------------------------------------

    def _region(self, nbytes: int) -> Region:
        r = Region(self._end, nbytes)
        self._end = _align(self._end + nbytes)
        return r

    def register(self, chunk) -> None:
        """Take over ``chunk``'s master (a resident, resizable 1-D tensor) and a bf16-kahan
        master's compensation (``chunk.comp``, a flat beside it): write them to disk and free
        their host memory."""
        comp = chunk.comp
        self.register_tensor(chunk.index, MASTER, chunk.master, ledger_kind="master", filled=chunk.spec.shard_filled,
                             more=None if comp is None else {COMP: comp})

    def register_tensor(self, index: int, key: str, tensor: torch.Tensor, ledger_kind: Optional[str] = None,
                        filled: Optional[int] = None, more: Optional[dict[str, torch.Tensor]] = None) -> None:
        """Take over ``tensor`` (resident, resizable, 1-D, owning its storage exactly) as the
        flat of a new record ``index`` under ``key`` (``more``: other flats of its length, same
        terms): write it to disk and free its host memory.
        ``ledger_kind``: the ledger entry (on ``host``) its bytes are booked under while staged;
        the caller booked it already, as it is resident now. ``filled``: elements holding values (a
        prefix; the rest is zero padding, never transferred after this first write); None: all."""
        if index in self.chunks:
            raise ValueError(f"chunk {index} is already on disk")
        flats = _owned_flats(index, {key: tensor, **(more or {})}, filled)
        rec = DiskChunk(index, tensor.numel(), filled)
        for k, t in flats.items():
            rec.flats[k], rec.regions[k] = t, self._region(_nbytes(t))
        if ledger_kind is not None:
            self._booked[key] = ledger_kind
        self.chunks[index] = rec
        self._book(rec.staged_bytes)  # resident now; the ledger already holds it
        self.start_write(index)
        self.finish(index)

    def add_record(self, index: int, numel: int) -> None:
        """A resident record of ``numel`` elements without a master: its flats come from
        :meth:`add_flat` (state only; an optimizer's own offload uses this)."""
        if index in self.chunks:
            raise ValueError(f"chunk {index} is already on disk")
        self.chunks[index] = DiskChunk(index, numel)

    def reset_layout(self) -> None:
        """Forget every record (all must be offloaded); the file's regions are laid out anew."""
        if any(rec.state is not DiskState.OFFLOADED or rec.pending for rec in self.chunks.values()):
            raise RuntimeError("reset_layout with chunks staged or in flight")
        self.chunks.clear()
        self._end = 0

    def add_flat(self, index: int, key: str, dtype: torch.dtype) -> torch.Tensor:
        """A new flat for state ``key`` of chunk ``index`` (allocated when the chunk is staged,
        0 bytes otherwise), with its own file region."""
        rec = self.chunks[index]
        if key in rec.flats:
            raise ValueError(f"chunk {index} already has a flat for {key!r}")
        flat = torch.empty(rec.numel, dtype=dtype)
        rec.regions[key] = self._region(_nbytes(flat))
        rec.flats[key] = flat
        if rec.state is DiskState.RESIDENT:
            self._book(_nbytes(flat))
        else:
            flat.untyped_storage().resize_(0)
        return flat

    # ---- movement ----------------------------------------------------------------------------

    def _move(self, rec: DiskChunk, new: DiskState) -> None:
        if new not in _MOVES[rec.state]:
            raise RuntimeError(f"disk chunk {rec.index}: illegal move {rec.state.name} -> {new.name}")
        rec.state = new

    def _book(self, nbytes: int) -> None:
        self.staged_bytes += nbytes
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def _account(self, rec: DiskChunk, sign: int) -> None:
        self._book(sign * rec.staged_bytes)
        if self.ledger is None:
            return
        for key, kind in self._booked.items():
            flat = rec.flats.get(key)
            if flat is None:
                continue
            n = rec.regions[key].nbytes
            if sign > 0:
                self.ledger.alloc(kind, "host", n)
            else:
                self.ledger.free(kind, "host", n)

    def start_read(self, index: int) -> None:
        """OFFLOADED -> READING: allocate the flats and queue their reads."""
        rec = self.chunks[index]
        self._move(rec, DiskState.READING)
        self._account(rec, +1)
        for key, flat in rec.flats.items():
            flat.untyped_storage().resize_(rec.regions[key].nbytes)
            rec.reads[key], nbytes = self._read_prefix(rec, key, flat)
            rec.pending.append(rec.reads[key])
            self.bytes_read += nbytes

    def _read_prefix(self, rec: DiskChunk, key: str, out: torch.Tensor) -> tuple[IOHandle, int]:
        """Queue the read of flat ``key``'s filled prefix into ``out`` (its length) and zero the
        rest; returns the handle and the bytes it reads."""
        n = rec.moved
        out[n:].zero_()
        if n == 0:
            return _Done(), 0
        return self.io.read(self.location.file, rec.regions[key].offset, out[:n]), n * out.element_size()

    def start_write(self, index: int) -> None:
        """RESIDENT -> WRITING: queue the writes of every flat."""
        rec = self.chunks[index]
        self._move(rec, DiskState.WRITING)
        rec.version += 1
        f = self.location.file
        for key, flat in rec.flats.items():
            part = flat if key not in rec.laid_down else flat[: rec.moved]
            rec.laid_down.add(key)
            if part.numel():
                rec.pending.append(self.io.write(f, rec.regions[key].offset, part))
                self.bytes_written += _nbytes(part)

    def finish(self, index: int) -> None:
        """Wait for the chunk's transfers: READING -> RESIDENT, WRITING -> OFFLOADED (flats freed)."""
        rec = self.chunks[index]
        pending, rec.pending = rec.pending, []
        rec.reads.clear()
        error = None
        t0 = time.perf_counter()
        for h in pending:
            try:
                h.wait()
            except Exception as e:  # wait for every transfer before touching the buffers
                error = error or e
        self.wait_seconds += time.perf_counter() - t0
        if error is not None:
            # nothing is lost: a failed read leaves the disk copy as the truth (buffers dropped), a
            # failed write keeps the chunk staged in memory (the disk copy is stale)
            failed_read = rec.state is DiskState.READING
            if failed_read:
                self._drop(rec, DiskState.OFFLOADED)
            elif rec.state is DiskState.WRITING:
                self._move(rec, DiskState.RESIDENT)
            full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
            fix = (
                f"free space in {os.path.dirname(self.path)!r} or point the offload directory at a larger disk"
                if full else "check the disk holding the offload directory"
            )
            message = (
                f"offload file {self.path!r}: {'reading' if failed_read else 'writing'} chunk {index} failed ({error}); "
                f"{'the disk copy is unchanged' if failed_read else 'its values stay in memory'}; {fix}"
            )
            code = getattr(error, "errno", None)
            raise (OSError(code, message) if code is not None else OSError(message)) from error
        if rec.state is DiskState.READING:
            self._move(rec, DiskState.RESIDENT)
        elif rec.state is DiskState.WRITING:
            self._drop(rec, DiskState.OFFLOADED)

    def _drop(self, rec: DiskChunk, new: DiskState) -> None:
        self._move(rec, new)
        for key, flat in rec.flats.items():
            if not flat.untyped_storage().resizable():
                raise RuntimeError(
                    f"disk chunk {rec.index}: the host buffer of {key!r} was exported (e.g. with .numpy()) and "
                    "cannot be freed; copy disk-resident tensors (.clone()) before exporting them"
                )
            flat.untyped_storage().resize_(0)
        self._account(rec, -1)

    @contextlib.contextmanager
    def sliceable(self, index: int) -> Iterator[None]:
        """Give an offloaded chunk's flats their size (uninitialised, untouched memory: nothing is
        read) for the block, so views of them can be made; freed again on exit."""
        rec = self.chunks[index]
        if rec.state is not DiskState.OFFLOADED:
            yield
            return
        for key, flat in rec.flats.items():
            flat.untyped_storage().resize_(rec.regions[key].nbytes)
        try:
            yield
        finally:
            for flat in rec.flats.values():
                flat.untyped_storage().resize_(0)

    def mapped(self, index: int, writable: bool = False) -> dict[str, torch.Tensor]:
        """Tensors viewing the disk copy of every flat of chunk ``index`` through ``mmap`` (page
        cache, not process memory). ``writable``: writes go to the file (shared mapping); else
        the mapping is private (copy-on-write: the file never changes). The chunk must be
        offloaded, and nothing may stage it while the tensors are in use."""
        rec = self.chunks[index]
        if rec.state is not DiskState.OFFLOADED:
            raise RuntimeError(f"disk chunk {index} is {rec.state.name}: its disk copy may be stale")
        fd = self.location.file.fd
        size = os.fstat(fd).st_size
        if writable:
            rec.version += 1
        out = {}
        for key, flat in rec.flats.items():
            region = rec.regions[key]
            if region.offset + region.nbytes > size:  # never written: mapping it would SIGBUS
                raise RuntimeError(f"disk chunk {index}: {key!r} lies beyond the end of the offload file")
            mm = mmap.mmap(fd, region.nbytes, offset=region.offset, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
            out[key] = torch.frombuffer(mm, dtype=flat.dtype, count=rec.numel)
        return out

    def read_converted(self, index: int, key: str, out: torch.Tensor, pieces: tuple[torch.Tensor, torch.Tensor],
                       add: bool = False) -> int:
        """Fill ``out`` (1-D, the record's length, any dtype) with flat ``key`` of chunk ``index``,
        converted to ``out``'s dtype (``add``: added to ``out``'s values instead, in the wider of
        the two dtypes, rounded once); the record's state is left as it is. Staged, the flat is
        converted in memory; else its region is read through the two ``pieces`` (1-D buffers of
        the flat's dtype, equal lengths) in turn, the next read queued before the last piece is
        converted. Being read ahead (READING: a staging's read-ahead),
        only flat ``key``'s read is waited for, so the caller (a backward gather) goes on while the
        optimizer state still streams in. Returns the bytes read from the file (0 when staged or
        read ahead: those bytes were counted by the read-ahead)."""
        rec = self.chunks[index]
        if rec.state is DiskState.READING and key in rec.reads:
            self._wait_for_flat(rec, key)
            _put(out, rec.flats[key], add)  # read ahead (a staging): the rest of the record may still be in flight
            return 0
        if rec.state in (DiskState.READING, DiskState.WRITING):
            waited = self.wait_seconds
            self.finish(index)  # a read-ahead or write of the record: this read's wait, not staging's
            self.converted_wait_seconds += self.wait_seconds - waited
            self.wait_seconds = waited
        flat = rec.flats[key]
        if rec.state is DiskState.RESIDENT:
            _put(out, flat, add)
            return 0
        region, f, step = rec.regions[key], self.location.file, pieces[0].numel()
        item = flat.element_size()
        spans = [(lo, min(lo + step, rec.moved)) for lo in range(0, rec.moved, step)]
        if not add:  # the padding is zero: nothing to add there
            out[rec.moved :].zero_()
        if not spans:
            return 0

        def queue(k: int):
            lo, hi = spans[k]
            return self.io.read(f, region.offset + lo * item, pieces[k % 2][: hi - lo])

        handle = queue(0)
        for k, (lo, hi) in enumerate(spans):
            t0 = time.perf_counter()
            try:
                handle.wait()
            except OSError as e:
                message = (f"offload file {self.path!r}: reading {key} of chunk {index} failed ({e}); "
                           "the disk copy is unchanged; check the disk holding the offload directory")
                raise (OSError(e.errno, message) if e.errno is not None else OSError(message)) from e
            finally:
                self.converted_wait_seconds += time.perf_counter() - t0
            if k + 1 < len(spans):
                handle = queue(k + 1)
            _put(out[lo:hi], pieces[k % 2][: hi - lo], add)
        return rec.moved * item

    def read_flat(self, index: int, key: str, out: torch.Tensor) -> tuple[IOHandle, int, int]:
        """Queue a read of flat ``key`` of offloaded chunk ``index`` straight into ``out`` (1-D, the
        flat's dtype and length: a derived shard's read-ahead); the record's state is unchanged.
        Returns the read's handle, the bytes it reads (the filled prefix; the rest of ``out`` is
        zeroed) and the record's :attr:`DiskChunk.version` now: a caller holding the bytes must
        drop them once the version moved (the disk copy was rewritten)."""
        rec = self.chunks[index]
        if rec.state is not DiskState.OFFLOADED:
            raise RuntimeError(f"disk chunk {index} is {rec.state.name}: read it through the store")
        flat = rec.flats[key]
        if out.dtype != flat.dtype or out.numel() != rec.numel:
            raise ValueError(f"chunk {index}: reading {key} ({flat.dtype}, {rec.numel}) into {out.dtype}, {out.numel()}")
        handle, nbytes = self._read_prefix(rec, key, out)
        return handle, nbytes, rec.version

    def is_current(self, index: int, version: int) -> bool:
        """Whether chunk ``index``'s disk copy is the one of ``version`` and nothing newer is staged."""
        rec = self.chunks[index]
        return rec.state is DiskState.OFFLOADED and rec.version == version

    def _wait_for_flat(self, rec: DiskChunk, key: str) -> None:
        """Wait for the read of one flat of a READING record, not the others'; on failure the
        whole record is finished, which raises the store's error."""
        t0 = time.perf_counter()
        try:
            rec.reads[key].wait()
        except OSError:
            self.finish(rec.index)  # waits for the rest, drops the buffers, raises with the fix
            raise
        finally:
            self.converted_wait_seconds += time.perf_counter() - t0

    def discard(self, index: int) -> None:
        """RESIDENT -> OFFLOADED without writing (the disk copy is current)."""
        self._drop(self.chunks[index], DiskState.OFFLOADED)

    def stage(self, index: int) -> None:
        """Bring chunk ``index`` into host memory (synchronously); no-op when it is resident."""
        rec = self.chunks[index]
        if rec.state is DiskState.OFFLOADED:
            self.start_read(index)
        if rec.state in (DiskState.READING, DiskState.WRITING):
            self.finish(index)
        if rec.state is DiskState.OFFLOADED:  # it was being written: read it back
            self.start_read(index)
            self.finish(index)

    def offload(self, index: int, write: bool = True) -> None:
        """Write chunk ``index`` back (unless ``write`` is False) and free its host memory."""
        rec = self.chunks[index]
        if rec.state is DiskState.READING:
            self.finish(index)
        if rec.state is DiskState.RESIDENT:
            if write:
                self.start_write(index)
            else:
                self.discard(index)
        if rec.state is DiskState.WRITING:
            self.finish(index)

    def settle(self) -> None:
        """Finish every transfer and write back every staged chunk (after an error, or at the end)."""
        first = None
        for index in self.chunks:
            try:
                self.offload(index, write=True)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    # ---- reporting ---------------------------------------------------------------------------

    def is_resident(self, index: int) -> bool:
        return self.chunks[index].state is DiskState.RESIDENT

    def report(self) -> dict[str, int]:
        """Host bytes staged now and at peak, file bytes laid out, bytes moved so far."""
        return {
            "disk_chunks": len(self.chunks),
            "file_bytes": self._end,
            "staged_bytes": self.staged_bytes,
            "peak_staged_bytes": self.peak_staged_bytes,
            "max_chunk_staged_bytes": max((r.staged_bytes for r in self.chunks.values()), default=0),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
        }

    def page_cache_bytes(self) -> int:
        """Bytes of the offload file in the kernel's page cache now (:func:`page_cache_bytes`)."""
        return page_cache_bytes(self.location.file.fd)

    def reset_peak(self) -> None:
        self.peak_staged_bytes = self.staged_bytes

    def close(self) -> None:
        """Write nothing more; stop the engine and remove the offload file."""
        for rec in self.chunks.values():
            for h in rec.pending:
                try:
                    h.wait()
                except Exception:
                    pass
            rec.pending = []
        self.io.close()
        self.location.close()
