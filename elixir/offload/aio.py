"""Asynchronous reads and writes of tensor memory to a file: the native engine or a thread fallback.

:func:`make_io` returns an :class:`AsyncFileIO`. Its :meth:`~AsyncFileIO.read` and
:meth:`~AsyncFileIO.write` queue one transfer between a contiguous CPU tensor and a byte range of an
:class:`OffloadFile` and return an :class:`IOHandle` at once; ``handle.wait()`` blocks until the
transfer is done and raises ``OSError`` if it failed. The handle keeps the tensor alive until then.

The native engine is ``elixir._C.AioEngine`` (``csrc/aio.cpp``: a thread pool doing pread/pwrite on
raw pointers, the GIL released while waiting). Without the extension the same interface runs on a
Python thread pool calling ``os.preadv``/``os.pwritev`` on memoryviews of the tensors (those calls
release the GIL too), after :func:`elixir._native.warn_fallback`.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Protocol

import torch

from elixir._native import get_native, warn_fallback

ALIGN = 4096  # O_DIRECT alignment used for offsets, addresses and sizes


class IOHandle(Protocol):
    def wait(self) -> None: ...


class OffloadFile:
    """An open file for offloaded bytes: a buffered fd, plus an ``O_DIRECT`` fd when asked for and
    supported by the file system (used only for transfers aligned to :data:`ALIGN`)."""

    def __init__(self, path: str, direct: bool = False) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.direct_fd: Optional[int] = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError:  # tmpfs and some others refuse O_DIRECT: stay buffered
                self.direct_fd = None

    def parts(self, offset: int, address: int, nbytes: int) -> list[tuple[int, int, int, int]]:
        """(fd, offset, address, nbytes) pieces of one transfer: its aligned body through the
        ``O_DIRECT`` fd when offset and address are aligned, everything else buffered."""
        body = nbytes - nbytes % ALIGN
        if self.direct_fd is None or offset % ALIGN or address % ALIGN or body == 0:
            return [(self.fd, offset, address, nbytes)]
        out = [(self.direct_fd, offset, address, body)]
        if body < nbytes:
            out.append((self.fd, offset + body, address + body, nbytes - body))
        return out

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd, self.direct_fd = -1, None


def _check(t: torch.Tensor) -> None:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"async file I/O needs a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")


class AsyncFileIO:
    """Queue reads/writes between tensors and an :class:`OffloadFile` (see the module docstring)."""

    kind = "abstract"

    def read(self, f: OffloadFile, offset: int, t: torch.Tensor) -> IOHandle:
        """Fill ``t`` with ``t.nbytes`` bytes of ``f`` starting at ``offset``."""
        _check(t)
        return self._submit(False, f, offset, t)

    def write(self, f: OffloadFile, offset: int, t: torch.Tensor) -> IOHandle:
        """Write ``t``'s bytes to ``f`` at ``offset``."""
        _check(t)
        return self._submit(True, f, offset, t)

    def _submit(self, write: bool, f: OffloadFile, offset: int, t: torch.Tensor) -> IOHandle:
        raise NotImplementedError

    def close(self) -> None:
        """Finish what is queued and stop the threads."""


class _NativeHandle:
    __slots__ = ("engine", "handles", "tensor", "error")

    def __init__(self, engine, handles: list[int], tensor: torch.Tensor) -> None:
        self.engine, self.handles, self.tensor = engine, handles, tensor
        self.error: Optional[BaseException] = None

    def wait(self) -> None:
        """Block until done; a failed transfer raises at every wait, not only the first (a read
        may be waited on for one flat, then again with the chunk's others)."""
        if self.tensor is None:
            if self.error is not None:
                raise self.error
            return
        error = None
        for h in self.handles:  # wait for every part before the tensor may go
            try:
                self.engine.wait(h)
            except Exception as e:
                error = error or e
        self.tensor = None
        self.error = error
        if error is not None:
            raise error


class NativeFileIO(AsyncFileIO):
    """``elixir._C.AioEngine``: C++ threads doing pread/pwrite."""

    kind = "native"

    def __init__(self, threads: int = 2, piece_bytes: int = 8 << 20) -> None:
        native = get_native()
        if native is None or not hasattr(native, "AioEngine"):
            raise RuntimeError("the native extension has no AioEngine; rebuild it (python setup.py build_ext --inplace)")
        self._engine = native.AioEngine(threads, piece_bytes)

    def _submit(self, write: bool, f: OffloadFile, offset: int, t: torch.Tensor) -> IOHandle:
        addr, n = t.data_ptr(), t.numel() * t.element_size()
        hs = [self._engine.submit(write, fd, o, a, k) for fd, o, a, k in f.parts(offset, addr, n)]
        return _NativeHandle(self._engine, hs, t)

    def close(self) -> None:
        self._engine.shutdown()


class _FutureHandle:
    __slots__ = ("futures", "tensor")

    def __init__(self, futures: list[Future], tensor: torch.Tensor) -> None:
        self.futures, self.tensor = futures, tensor  # the tensor stays alive until waited on

    def wait(self) -> None:
        error = None
        for fut in self.futures:
            try:
                fut.result()
            except Exception as e:
                error = error or e
        self.tensor = None
        if error is not None:
            raise error


def _transfer(write: bool, fd: int, offset: int, address: int, nbytes: int) -> None:
    view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B") if nbytes else memoryview(b"")
    done = 0
    while done < nbytes:
        part = view[done:]
        n = os.pwritev(fd, [part], offset + done) if write else os.preadv(fd, [part], offset + done)
        if n == 0:
            raise ValueError("unexpected end of file (read beyond what was written)")
        done += n


class ThreadFileIO(AsyncFileIO):
    """The fallback: a Python thread pool calling ``os.preadv``/``os.pwritev``."""

    kind = "python"

    def __init__(self, threads: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="elixir-aio")

    def _submit(self, write: bool, f: OffloadFile, offset: int, t: torch.Tensor) -> IOHandle:
        addr, n = t.data_ptr(), t.numel() * t.element_size()
        futs = [self._pool.submit(_transfer, write, fd, o, a, k) for fd, o, a, k in f.parts(offset, addr, n)]
        return _FutureHandle(futs, t)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def make_io(threads: int = 2, native: Optional[bool] = None) -> AsyncFileIO:
    """The native engine when the extension has it (``native=None`` or ``True``), else the thread
    fallback (with a one-time warning unless ``native=False`` asked for it explicitly)."""
    if native is not False:
        ext = get_native()
        if ext is not None and hasattr(ext, "AioEngine"):
            return NativeFileIO(threads)
        if native is True:
            raise RuntimeError("native async I/O requested but elixir._C has no AioEngine; rebuild the extension")
        warn_fallback("async disk I/O (elixir.offload)")
    return ThreadFileIO(threads)
