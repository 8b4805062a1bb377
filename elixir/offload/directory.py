"""Where offloaded bytes go: the offload directory, checked up front, and cleaned up at exit.

:func:`open_offload_file` returns an :class:`OffloadLocation` holding one file for this process
(this rank). With ``offload_dir=None`` the file lives in a fresh per-run directory under
``tempfile.gettempdir()``; with a directory given, in that directory. Once its space is reserved
and its descriptors are open, the file's name is unlinked (and the per-run directory removed):
the bytes stay reachable through the open descriptors and the kernel frees them when the process
ends, so nothing is left behind even if it is killed. A given directory that did not exist is
created (with its missing parents) and removed again, if empty, when the file is closed (at
interpreter exit at the latest); a directory that already existed is left as it was. A directory that cannot be created or written, or that has less free space than asked
for, raises :class:`OffloadDirError` naming the fix.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from typing import Optional

from elixir.offload.aio import OffloadFile


class OffloadDirError(OSError):
    """The offload directory is unusable (not writable, or too little free space)."""


def _size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (never "0.0 MiB" for a small need)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def _fix(need: int) -> str:
    return (
        f"pass offload_dir= a writable directory on a local disk with at least {_size(need)} free "
        "(ElixirModule(..., offload_dir=...)), or place fewer chunks on disk in the plan"
    )


@dataclass
class OffloadLocation:
    """The open offload file and what to remove when done."""

    file: OffloadFile
    path: str
    temp_dir: Optional[str]  # the per-run directory we created (removed at exit), or None
    created_dirs: tuple[str, ...] = ()  # missing directories of offload_dir we made, outermost first

    def close(self) -> None:
        _cleanup(self.file, self.path, self.temp_dir, self.created_dirs)


def _cleanup_names(path: str, temp_dir: Optional[str]) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _remove_created(created_dirs: tuple[str, ...]) -> None:
    """Remove the directories we created, innermost first, as long as they are empty (another
    rank's or the user's files keep them)."""
    for d in reversed(created_dirs):
        try:
            os.rmdir(d)
        except OSError:
            return


def _cleanup(f: OffloadFile, path: str, temp_dir: Optional[str], created_dirs: tuple[str, ...] = ()) -> None:
    f.close()
    _cleanup_names(path, temp_dir)
    _remove_created(created_dirs)


def _missing_dirs(directory: str) -> tuple[str, ...]:
    """The directories ``os.makedirs(directory)`` would create, outermost first."""
    missing = []
    d = directory
    while d and not os.path.exists(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return tuple(reversed(missing))


def open_offload_file(offload_dir: Optional[str], need_bytes: int, rank: int = 0, direct: bool = False) -> OffloadLocation:
    """Create this rank's offload file in ``offload_dir`` (default: a new temporary directory) and
    reserve ``need_bytes`` in it. Raises :class:`OffloadDirError` when that is impossible."""
    temp_dir = None
    created: tuple[str, ...] = ()
    if offload_dir is None:
        try:
            temp_dir = tempfile.mkdtemp(prefix="elixir-offload-")
        except OSError as e:
            raise OffloadDirError(f"cannot create a temporary offload directory under {tempfile.gettempdir()!r} ({e}); {_fix(need_bytes)}") from None
        directory = temp_dir
    else:
        directory = os.path.abspath(os.path.expanduser(offload_dir))
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise OffloadDirError(f"offload_dir {directory!r} is not a directory; {_fix(need_bytes)}")
        created = _missing_dirs(directory)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            _remove_created(created)
            raise OffloadDirError(f"offload_dir {directory!r} cannot be created ({e.strerror}); {_fix(need_bytes)}") from None
    path = os.path.join(directory, f"elixir-{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{rank}.offload")
    try:
        f = OffloadFile(path, direct=direct)
    except OSError as e:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        _remove_created(created)
        raise OffloadDirError(f"offload_dir {directory!r} is not writable ({e.strerror}); {_fix(need_bytes)}") from None
    loc = OffloadLocation(f, path, temp_dir, created)
    try:
        free = shutil.disk_usage(directory).free
        if free < need_bytes:
            raise OffloadDirError(
                f"offload_dir {directory!r} has {_size(free)} free but the disk-placed state needs "
                f"{_size(need_bytes)} on this rank; {_fix(need_bytes)}"
            )
        if need_bytes > 0 and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(f.fd, 0, need_bytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise OffloadDirError(f"offload_dir {directory!r}: no space for {need_bytes} B ({e.strerror}); {_fix(need_bytes)}") from None
                # file systems without fallocate support: space is checked above, writes extend the file
    except BaseException:
        loc.close()
        raise
    _cleanup_names(path, temp_dir)  # anonymous from now on: freed with the descriptors
    weakref.finalize(loc, _cleanup, f, path, temp_dir, created)
    return loc


def page_cache_bytes(fd: int) -> int:
    """Bytes of the file open as ``fd`` that the kernel holds in its page cache now (``mincore``):
    not process memory, but charged to the same memory cgroup, and dirty pages among them must be
    written back before they can be reclaimed. ``offload_direct=True`` keeps most transfers out of
    it. 0 where it cannot be measured."""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        page = mmap.PAGESIZE
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # never written
        view = ctypes.c_char.from_buffer(mm)
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            ok = libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), vec) == 0
        finally:
            del view
            mm.close()
        return (len(vec) - bytes(vec).count(0)) * page if ok else 0  # bit 0: resident
    except (OSError, ValueError, TypeError, AttributeError, BufferError):
        return 0
