"""Everything device-specific, in one place.

Streams, events, pinned memory, synchronisation and memory queries. On an accelerator they map to
the torch backend (CUDA today); on CPU they are exact no-ops or plain equivalents, so no other
module branches on the device type.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional, Union

import torch

DeviceLike = Union[str, torch.device, None]


def default_device() -> torch.device:
    """The compute device for this process: the local CUDA device when there is one (``LOCAL_RANK``'s,
    else torch's current device: the one :func:`elixir.distributed.bind_device` or the user set),
    else CPU."""
    if torch.cuda.is_available():
        if "LOCAL_RANK" in os.environ:
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_device(device: DeviceLike) -> torch.device:
    return default_device() if device is None else torch.device(device)


def is_accelerator(device: DeviceLike) -> bool:
    """True when ``device`` has memory separate from the host (so host offload is a real copy)."""
    return as_device(device).type not in ("cpu", "meta")


class _NullStream:
    """Stands in for a stream on CPU, where work runs synchronously when it is issued.

    Waiting is then a no-op, but the stand-in keeps what the runtime's ordering logic needs to be
    checked on CPU: a name, and (through :func:`use_stream`) which stream is current, so code
    that issues work "on the gather stream" really runs inside that stream's context on CPU too.
    """

    def __init__(self, name: str = "default") -> None:
        self.name = name
        self.waited_streams = 0  # how many times this stream was ordered after another
        self.waited_events = 0
        self.synchronized = 0  # host waits

    def wait_stream(self, other: object) -> None:
        self.waited_streams += 1

    def wait_event(self, event: object) -> None:
        event.wait(self)

    def synchronize(self) -> None:
        self.synchronized += 1

    def __repr__(self) -> str:
        return f"_NullStream({self.name!r})"


class UnrecordedEventError(RuntimeError):
    """An event was waited on before anything recorded it (on CUDA this silently waits for nothing)."""


class _NullEvent:
    """Stands in for an event on CPU. Waiting on an event nobody recorded is the classic
    stream-ordering bug (CUDA ignores it and the consumer reads unfinished data), so the
    stand-in refuses it; it also counts waits so tests can see that consumers waited."""

    def __init__(self) -> None:
        self.recorded = False
        self.waits = 0

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def wait(self, stream: object = None) -> None:
        if not self.recorded:
            raise UnrecordedEventError("waiting on an event that was never recorded")
        self.waits += 1
        if isinstance(stream, _NullStream):
            stream.waited_events += 1

    def synchronize(self) -> None:
        if not self.recorded:
            raise UnrecordedEventError("synchronizing an event that was never recorded")

    def query(self) -> bool:
        return True


_cpu_current = threading.local()  # the null stream use_stream() made current, per thread


def new_stream(device: DeviceLike = None, name: str = "side"):
    """A side stream for overlapping copies and collectives with compute (a null one on CPU)."""
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return _NullStream(name)


def current_stream(device: DeviceLike = None):
    """The stream work is issued on now: torch's current CUDA stream, or on CPU the null stream
    :func:`use_stream` made current (a per-thread default one otherwise)."""
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    stream = getattr(_cpu_current, "stream", None)
    if stream is None:
        stream = _cpu_current.stream = _NullStream("default")
    return stream


@contextlib.contextmanager
def use_stream(stream) -> Iterator[None]:
    """Run the body with ``stream`` current (on CPU the null stream becomes :func:`current_stream`)."""
    if stream is None:
        yield
    elif isinstance(stream, _NullStream):
        previous = getattr(_cpu_current, "stream", None)
        _cpu_current.stream = stream
        try:
            yield
        finally:
            _cpu_current.stream = previous
    else:
        with torch.cuda.stream(stream):
            yield


def new_event(device: DeviceLike = None):
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.Event()
    return _NullEvent()


class _HostTimingEvent:
    """Stands in for a timing event on CPU, where work is done when the call returns: the host
    clock when it was recorded."""

    def __init__(self) -> None:
        self.t: Optional[float] = None

    def record(self, stream: object = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        if self.t is None:
            raise UnrecordedEventError("synchronizing a timing event that was never recorded")

    def elapsed_time(self, end: _HostTimingEvent) -> float:
        """Milliseconds from this event to ``end`` (as ``torch.cuda.Event.elapsed_time``)."""
        if self.t is None or end.t is None:
            raise UnrecordedEventError("elapsed_time between events that were not both recorded")
        return 1e3 * (end.t - self.t)


def timing_event(device: DeviceLike = None):
    """An event that measures device time: recorded on a stream, it completes when the stream's
    work before it is done, and ``start.elapsed_time(end)`` is the device's milliseconds between
    two of them (after both completed). Time accelerator work with these, not the host clock: the
    host only queues it. On CPU, the host clock at ``record``."""
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=True)
    return _HostTimingEvent()


def record_stream(tensor: torch.Tensor, stream) -> None:
    """Tell the caching allocator ``tensor`` is in use on ``stream`` (no-op on CPU)."""
    if tensor.device.type == "cuda" and not isinstance(stream, _NullStream):
        tensor.record_stream(stream)


class SideStreams:
    """The side streams of one runtime, and the rule that orders them against compute.

    - ``gather``: host-to-device copies of host shards and the all-gathers into payloads;
    - ``reduce``: gradient reduce-scatters / all-reduces and the device-to-host copies of reduced
      gradients;
    - ``copy``: master-to-shard refreshes after an optimizer step.

    Work goes on a side stream with :meth:`issue`: the side stream first waits for everything
    already queued on the compute (current) stream (the inputs were produced there and the
    memory may have been freed there), then runs the body; the event it yields is recorded when
    the body's work ends, and the consumer makes its own stream wait on that event only where it
    needs the result (:meth:`wait`), so compute is never blocked on work it does not use.
    On CPU the streams are :class:`_NullStream` stand-ins and the same code runs synchronously.
    """

    def __init__(self, device: DeviceLike = None) -> None:
        self.device = as_device(device)
        self.gather = new_stream(self.device, "gather")
        self.reduce = new_stream(self.device, "reduce")
        self.copy = new_stream(self.device, "copy")
        self.issued = 0  # bodies issued on side streams (for tests)

    def compute(self):
        """The stream the caller runs on (the compute stream)."""
        return current_stream(self.device)

    @contextlib.contextmanager
    def issue(self, stream) -> Iterator[object]:
        """Run the body's work on ``stream``, ordered after the compute stream's queued work.
        Yields the event that is recorded at the end of the body (wait on it after the block)."""
        stream.wait_stream(self.compute())
        event = new_event(self.device)
        with use_stream(stream):
            yield event
            event.record(stream)
        self.issued += 1

    def after(self, stream, wait: Callable[[], object]):
        """Run ``wait`` (the wait of an asynchronous collective issued from ``stream``) with
        ``stream`` current, and return an event recorded right after it. On NCCL the wait orders
        ``stream`` after the collective, so buffers the collective read (freed into ``stream``'s
        pool when the work handle lets go of them) are not reused before it finished; the event
        covers the collective and everything queued on ``stream`` before it. On CPU the wait
        blocks the host until the collective's thread is done."""
        with use_stream(stream):
            wait()
            event = new_event(self.device)
            event.record(stream)
        return event

    def wait(self, event) -> None:
        """Make the caller's stream wait for ``event`` (a no-op on CPU, once it was recorded)."""
        if event is not None:
            self.compute().wait_event(event)

    def join(self) -> None:
        """Make the compute stream wait for everything queued on the side streams (device-side:
        the host does not block)."""
        compute = self.compute()
        for s in (self.gather, self.reduce, self.copy):
            compute.wait_stream(s)

    def synchronize(self) -> None:
        """Block the host until every side stream's work is done: before the host reads memory a
        side stream writes (reduced gradients copied to pinned host buffers) or writes memory a
        side stream may still read (host shards and masters being copied to the device)."""
        for s in (self.gather, self.reduce, self.copy):
            s.synchronize()


class HostBufferPool:
    """Reusable host buffers for transient transfers, page-locked when an accelerator is present.

    Pinning memory is expensive (``cudaHostAlloc`` maps and locks pages), and a non-blocking copy
    needs a pinned host side, so staging buffers are kept by ``(dtype, numel)`` and handed out
    again. A buffer given back with an event is reused only once that event has completed (a
    non-blocking copy may still read or write it). On a CPU-only machine the buffers are plain
    host memory and the same bookkeeping runs.
    """

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self._free: dict[tuple, list] = {}
        self.allocated = 0  # buffers created
        self.reused = 0  # buffers handed out again
        self.bytes = 0  # bytes held by the pool's buffers (handed out or free)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of ``numel`` elements of ``dtype`` (contents undefined)."""
        free = self._free.get((dtype, int(numel)), [])
        for i, (buf, event) in enumerate(free):
            if event is None or event.query():
                del free[i]
                self.reused += 1
                return buf
        self.allocated += 1
        buf = empty_host(int(numel), dtype, pin=self.pin)
        self.bytes += buf.numel() * buf.element_size()
        return buf

    def give(self, buf: torch.Tensor, event=None) -> None:
        """Return ``buf`` to the pool; with ``event``, not before that event completes."""
        self._free.setdefault((buf.dtype, buf.numel()), []).append((buf, event))

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers held free now (given back, not yet handed out again)."""
        return sum(buf.numel() * buf.element_size() for free in self._free.values() for buf, _ in free)

    def clear(self) -> None:
        """Drop the free buffers (those handed out stay with their holders)."""
        for free in self._free.values():
            for buf, _ in free:
                self.bytes -= buf.numel() * buf.element_size()
        self._free.clear()


_HOST_POOL: Optional[HostBufferPool] = None


def host_pool() -> HostBufferPool:
    """The process's pool of transient host staging buffers (created on first use)."""
    global _HOST_POOL
    if _HOST_POOL is None:
        _HOST_POOL = HostBufferPool()
    return _HOST_POOL


def synchronize(device: DeviceLike = None) -> None:
    device = as_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pin_memory_available() -> bool:
    return torch.cuda.is_available()


class _CudaRegistrar:
    """Page-locks host ranges for the accelerator: ``cudaHostRegister`` / ``cudaHostUnregister``."""

    def register(self, ptr: int, nbytes: int) -> None:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"elixir: cudaHostRegister of {nbytes} bytes failed (error {int(err)}): "
                               "lower the host memory the plan pins, or build the plan with pin_memory=False")

    def unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


class _PinnedBlock(mmap.mmap):
    """An anonymous mapping of exactly the bytes asked for (rounded to a page), page-locked while
    it lives. A tensor made on it by ``torch.frombuffer`` keeps it alive; when the tensor's storage
    goes, the block is unregistered and unmapped."""

    registrar: Optional[object] = None
    ptr = 0

    def __del__(self) -> None:
        if self.registrar is not None:
            self.registrar.unregister(self.ptr)
            _PINNED[0] -= len(self)


#: How host memory is page-locked: torch's ``pin_memory=True`` goes through its pinned caching
#: allocator, which rounds every block up to a power of two and keeps it (a 600 MiB shard takes
#: 1 GiB, and shard gradients allocated every step pile up): host RSS up to about 2x the
#: prediction. elixir pins exact-size mappings of its own instead. Tests put a recorder here (the
#: CPU stand-in, see :func:`empty_host`).
PINNED_REGISTRAR: Optional[object] = None
_PINNED = [0]  # bytes page-locked now by empty_host


def pinned_bytes() -> int:
    """Host bytes :func:`empty_host` holds page-locked now (exact sizes, page-rounded)."""
    return _PINNED[0]


def _registrar():
    if PINNED_REGISTRAR is not None:
        return PINNED_REGISTRAR
    return _CudaRegistrar() if pin_memory_available() else None


def empty_host(shape, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A host tensor, page-locked when an accelerator is present and ``pin`` is set: an
    exact-size mapping registered with the accelerator (not torch's power-of-two pinned cache;
    see :data:`PINNED_REGISTRAR`). Freed (and unregistered) with its last tensor; free it only once
    no non-blocking copy reads or writes it (the runtime synchronises its side streams first)."""
    registrar = _registrar() if pin else None
    if registrar is None:
        return torch.empty(shape, dtype=dtype, device="cpu")
    numel = 1
    for n in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)):
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device="cpu")
    block = _PinnedBlock(-1, nbytes)
    flat = torch.frombuffer(block, dtype=dtype, count=numel)
    block.ptr = flat.data_ptr()
    registrar.register(block.ptr, nbytes)
    block.registrar = registrar
    _PINNED[0] += len(block)
    return flat.view(shape)


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """Page-lock a host tensor when that helps copies (returns it unchanged on CPU-only machines):
    a copy in an exact-size pinned block (:func:`empty_host`)."""
    if _registrar() is not None and tensor.device.type == "cpu" and not _is_pinned(tensor):
        out = empty_host(tuple(tensor.shape), tensor.dtype)
        out.copy_(tensor)
        return out
    return tensor


def _is_pinned(t: torch.Tensor) -> bool:
    return pin_memory_available() and t.is_pinned()


def non_blocking_ok(src: torch.Tensor, dst_device: DeviceLike) -> bool:
    """Whether a copy from ``src`` to ``dst_device`` may be issued non-blocking."""
    dst = as_device(dst_device)
    return dst.type == "cuda" or (src.device.type == "cuda") or (_is_pinned(src) if src.device.type == "cpu" else False)


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


def max_memory_reserved(device: DeviceLike = None) -> int:
    """The most bytes the caching allocator held on an accelerator since the last peak reset; 0 on CPU."""
    device = as_device(device)
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0


def memory_reserved(device: DeviceLike = None) -> int:
    """Bytes the caching allocator holds on an accelerator (allocated plus cached); 0 on CPU."""
    device = as_device(device)
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def reset_peak_memory(device: DeviceLike = None) -> None:
    device = as_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes since it was exec'd: ``VmHWM`` from
    ``/proc/self/status`` on Linux. Not ``ru_maxrss``: a spawned process's ``ru_maxrss`` also
    holds its parent's RSS at fork time, so a rank spawned from a large process reports the
    parent's peak. Elsewhere (macOS), ``ru_maxrss`` (bytes there); 0 where neither exists."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        # lazy: resource exists on Unix only
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):  # pragma: no cover - platform without resource
        return 0


def describe(device: Optional[torch.device] = None) -> str:
    device = as_device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device_capacity(device) / 2**30:.0f} GiB)"
    return f"CPU ({host_capacity() / 2**30:.0f} GiB RAM, {os.cpu_count()} cores)"


_HOST_ALLOCATOR_TUNED = False
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (4 MiB * sizeof(long))
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def _mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt``; raises OSError/AttributeError where glibc is not the allocator."""
    return ctypes.CDLL("libc.so.6").mallopt(param, ctypes.c_int(value)) == 1


def trim_host_memory() -> None:
    """Give the free pages inside glibc's heap back to the OS (``malloc_trim(0)``, which also
    releases whole free pages in the middle of the heap). For one-off phases that interleave
    short-lived host buffers with long-lived ones (building chunks), where the holes the
    short-lived ones leave would otherwise stay resident. A no-op where glibc is not the allocator."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def keep_host_memory() -> bool:
    """Ask glibc's malloc to keep freed host memory of small and medium blocks for reuse.

    Large tensors on CPU are allocated with ``mmap`` and unmapped when freed, so every gathered
    chunk, gradient buffer and activation of a step page-faults its memory in again (on the order
    of 2 GB/s: a 38 MB buffer costs ~20 ms). A GPU's caching allocator avoids this; this is the
    CPU equivalent for blocks below glibc's largest mmap threshold (32 MiB): malloc serves them
    from its heap, stops trimming it, and freed blocks are reused. Blocks of 32 MiB and more (whole
    chunks, their gradient buffers, the logits) still come from ``mmap`` and go back when freed:
    kept in the heap they left holes that other sizes could not fill, and the heap grew past
    every count of the bytes in use (GPT-2 81.9M at world size 2, every chunk replicated, shard
    gradients freed at ``zero_grad``: peak RSS 2.67 GiB with every block kept, 2.13 GiB with this
    threshold; FSDP2 2.36 GiB). Process-wide and idempotent; returns False where it does not apply (not glibc) or when
    ``ELIXIR_KEEP_HOST_MEMORY=0``.
    """
    global _HOST_ALLOCATOR_TUNED
    if _HOST_ALLOCATOR_TUNED:
        return True
    if os.environ.get("ELIXIR_KEEP_HOST_MEMORY", "1") == "0":
        return False
    try:
        ok = _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and _mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):
        return False
    _HOST_ALLOCATOR_TUNED = ok
    return ok


STREAMING_MMAP_THRESHOLD = 1 << 20  # blocks from this size on are mapped on their own (return_host_memory)


def return_host_memory() -> bool:
    """Ask glibc's malloc to give blocks of :data:`STREAMING_MMAP_THRESHOLD` (1 MiB) and more
    back to the OS as soon as they are freed: the policy for a process that streams chunks
    from disk, the opposite of :func:`keep_host_memory`.

    By default glibc raises its mmap threshold to the size of every mapped block freed, up to
    32 MiB, so after the first free nearly every buffer under 32 MiB (shards, gradient buffers,
    gathered payloads and staged shards of chunks that small, the larger activations) comes from
    the heap, and the holes their churn leaves beside longer-lived blocks stay resident. Measured
    (bench/memory_breakdown.py, 119M LLaMA, 8.7M-element chunks with optimizer state on disk,
    world 1): 0.31 GiB resident at the peak of backward beyond the live bytes against 0.16 GiB
    with a fixed 4 MiB threshold (which also stops the raise); peak RSS 1.03 against 0.91 GiB.
    4 MiB was not low enough once the activations themselves are a few MiB each: a bf16 hidden
    state at hidden 6144 and sequence 256 is 3 MiB, and a LoRA step's transients of that size
    left holes in the heap that grew with the layers (PEFT LoRA on LLaMA 6144 with frozen chunks
    on disk, world 1: 0.105 / 0.175 GiB free in the heap at the peak with 1 / 2 layers; 0.003 /
    0.004 GiB with 1 MiB, RSS then the live bytes: 1.59 / 1.66 GiB peak against 1.66 / 1.80).
    Costs a page fault per 4 KiB of each such block on every allocation (about 2 GB/s), small
    beside the disk transfers of these plans. Process-wide; returns False where it does not apply
    (not glibc) or when ``ELIXIR_RETURN_HOST_MEMORY=0``."""
    if os.environ.get("ELIXIR_RETURN_HOST_MEMORY", "1") == "0":
        return False
    try:
        return _mallopt(_M_MMAP_THRESHOLD, STREAMING_MMAP_THRESHOLD)
    except (OSError, AttributeError):
        return False


def host_allocator_stats() -> dict[str, int]:
    """glibc malloc's view of this process (``mallinfo2``): ``heap_bytes`` obtained from the OS
    for its arenas, ``heap_in_use_bytes`` of it handed out, ``heap_free_bytes`` free but kept
    (resident once touched: with :func:`keep_host_memory` freed memory is never returned, so RSS
    keeps the heap's high-water mark), and ``mmapped_bytes`` in separate mappings. Empty where
    not glibc."""
    try:
        class _MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        mi = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_bytes": mi.arena, "heap_in_use_bytes": mi.uordblks, "heap_free_bytes": mi.fordblks,
            "mmapped_bytes": mi.hblkhd}


def release_free_host_memory() -> bool:
    """Return the host memory malloc holds free to the OS (``malloc_trim(0)``: whole free pages
    anywhere in the heap, not only at its top), keeping the allocations in use. Called once per
    optimizer step: within a step freed buffers are still reused without page faults (see
    :func:`keep_host_memory`), but holes that transient buffers of different sizes (disk staging,
    lazily created state) leave behind cannot pile up across steps. False where not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(ctypes.c_size_t(0))
        return True
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
