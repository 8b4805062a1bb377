"""Everything device-specific, in one place.

Streams, events, pinned memory, synchronisation and memory queries. On an accelerator they map to
the torch backend (CUDA today); on CPU they are exact no-ops or plain equivalents, so no other
module branches on the device type.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Union

import torch

DeviceLike = Union[str, torch.device, None]


def default_device() -> torch.device:
    """The compute device for this process: the local CUDA device when there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def as_device(device: DeviceLike) -> torch.device:
    return default_device() if device is None else torch.device(device)


def is_accelerator(device: DeviceLike) -> bool:
    """True when ``device`` has memory separate from the host (so host offload is a real copy)."""
    return as_device(device).type not in ("cpu", "meta")


class _NullStream:
    """Stands in for a stream on CPU: work is synchronous, so waiting is a no-op."""

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NullEvent:
    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def new_stream(device: DeviceLike = None):
    """A side stream for overlapping copies and collectives with compute (a null one on CPU)."""
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return _NullStream()


def current_stream(device: DeviceLike = None):
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    return _NullStream()


@contextlib.contextmanager
def use_stream(stream) -> Iterator[None]:
    """Run the body on ``stream`` (no-op for the null stream)."""
    if isinstance(stream, _NullStream) or stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def new_event(device: DeviceLike = None):
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.Event()
    return _NullEvent()


def record_stream(tensor: torch.Tensor, stream) -> None:
    """Tell the caching allocator ``tensor`` is in use on ``stream`` (no-op on CPU)."""
    if tensor.device.type == "cuda" and not isinstance(stream, _NullStream):
        tensor.record_stream(stream)


def synchronize(device: DeviceLike = None) -> None:
    device = as_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pin_memory_available() -> bool:
    return torch.cuda.is_available()


def empty_host(shape, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A host tensor, page-locked when an accelerator is present and ``pin`` is set."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin and pin_memory_available())


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """Page-lock a host tensor when that helps copies (returns it unchanged on CPU-only machines)."""
    if pin_memory_available() and tensor.device.type == "cpu" and not tensor.is_pinned():
        return tensor.pin_memory()
    return tensor


def non_blocking_ok(src: torch.Tensor, dst_device: DeviceLike) -> bool:
    """Whether a copy from ``src`` to ``dst_device`` may be issued non-blocking."""
    dst = as_device(dst_device)
    return dst.type == "cuda" or (src.device.type == "cuda") or (src.is_pinned() if src.device.type == "cpu" else False)


def device_capacity(device: DeviceLike = None) -> int:
    """Total memory in bytes of ``device`` (host RAM for CPU)."""
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_capacity()


def host_capacity() -> int:
    """Total host RAM in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes currently allocated by torch on an accelerator; 0 on CPU (use elixir's own accounting)."""
    device = as_device(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def max_memory_allocated(device: DeviceLike = None) -> int:
    device = as_device(device)
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak_memory(device: DeviceLike = None) -> None:
    device = as_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (Linux/macOS)."""
    try:
        import resource
        import sys

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb if sys.platform == "darwin" else kb * 1024
    except Exception:  # pragma: no cover - platform without resource
        return 0


def describe(device: Optional[torch.device] = None) -> str:
    device = as_device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device_capacity(device) / 2**30:.0f} GiB)"
    return f"CPU ({host_capacity() / 2**30:.0f} GiB RAM, {os.cpu_count()} cores)"


_HOST_ALLOCATOR_TUNED = False


def keep_host_memory() -> bool:
    """Ask glibc's malloc to keep freed host memory for reuse instead of returning it to the OS.

    Large tensors on CPU are allocated with ``mmap`` and unmapped when freed, so every gathered
    chunk, gradient buffer and activation of a step page-faults its memory in again (on the order
    of 2 GB/s: a 38 MB buffer costs ~20 ms). A GPU's caching allocator avoids this; this is the
    CPU equivalent: malloc stops using ``mmap`` and stops trimming the heap, so freed blocks are
    reused and the process keeps its peak footprint (as a caching allocator does). Process-wide and
    idempotent; returns False where it does not apply (not glibc) or when ``ELIXIR_KEEP_HOST_MEMORY=0``.
    """
    global _HOST_ALLOCATOR_TUNED
    if _HOST_ALLOCATOR_TUNED:
        return True
    if os.environ.get("ELIXIR_KEEP_HOST_MEMORY", "1") == "0":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        ok = libc.mallopt(m_mmap_max, 0) == 1 and libc.mallopt(m_trim_threshold, ctypes.c_int(2**31 - 1)) == 1
    except (OSError, AttributeError):
        return False
    _HOST_ALLOCATOR_TUNED = ok
    return ok
