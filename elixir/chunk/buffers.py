"""Recycled gradient buffers: a CPU runtime's equivalent of a GPU caching allocator, for the
chunk-sized buffers it takes and gives back every step.

On a CPU device every chunk's gradient buffer (and, for split state, its shard gradient) is a
fresh allocation per step. From malloc that costs one of two things:

- a block of 32 MiB or more is mapped on its own and unmapped when freed, so each step
  page-faults it in again (about 0.4 ms per MB here: 15 ms of a 35 MB buffer's 19);
- a smaller one comes from malloc's heap (``device.keep_host_memory``), where buffers freed and
  taken back beside activations of other sizes leave holes the next step cannot reuse, and the
  heap grows past every count of the bytes in use (GPT-2 medium in 18 MB chunks: 4.9 GiB of free
  heap at a 7.9 GiB peak for a 4.6 GiB plan).

A :class:`GradBufferPool` keeps the buffers given back, by size and dtype, and hands them out
again, so each is allocated once and touched once. It holds no more buffers than were in use at
once (the search counts exactly those, resident for the whole step on a CPU box:
``search.cost_model.timeline_peak``). It is off on accelerators (their caching allocator does
this already) and for plans that stream from disk, which give memory back at once instead
(``device.return_host_memory``).
"""

from __future__ import annotations

from typing import Optional

import torch

from elixir import device as dev


class GradBufferPool:
    """The runtime's chunk-sized buffers, kept by ``(dtype, numel)`` in a
    :class:`~elixir.device.HostBufferPool` (unpinned) and handed out again; a plain allocation
    when disabled. It only ever takes back whole tensors (never a view of a larger one)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pool = dev.HostBufferPool(pin=False)
        self._pinned = dev.HostBufferPool(pin=True)  # host-state shard gradients: page-locked
        self._pinned_ptrs: set[int] = set()  # the pinned pool's buffers handed out: give() returns them there

    @property
    def allocated(self) -> int:
        """Buffers created through the pool."""
        return self._pool.allocated + self._pinned.allocated

    @property
    def reused(self) -> int:
        """Buffers handed out again."""
        return self._pool.reused + self._pinned.reused

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool = False) -> torch.Tensor:
        """A flat buffer of ``numel`` elements of ``dtype`` on ``device`` (contents undefined);
        with ``pin``, a host buffer page-locked when an accelerator is present."""
        on_host = torch.device(device).type == "cpu"
        if pin and on_host:
            if not self.enabled:
                return dev.empty_host(int(numel), dtype, pin=True)
            buf = self._pinned.take(int(numel), dtype)
            self._pinned_ptrs.add(buf.data_ptr())
            return buf
        if self.enabled and on_host:
            return self._pool.take(int(numel), dtype)
        return torch.empty(int(numel), dtype=dtype, device=device)

    def give(self, buf: Optional[torch.Tensor]) -> None:
        """Take ``buf`` back for reuse. The caller must hold no other reference to it (nor to a
        view of it) that is still read or written."""
        if not self.enabled or buf is None or buf.device.type != "cpu" or not buf.is_contiguous():
            return
        if buf.storage_offset() != 0 or buf.untyped_storage().nbytes() != buf.numel() * buf.element_size():
            return  # a view of a larger tensor: not ours to recycle
        if buf.data_ptr() in self._pinned_ptrs:
            self._pinned_ptrs.discard(buf.data_ptr())
            self._pinned.give(buf)
        else:
            self._pool.give(buf)

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers held free now."""
        return self._pool.free_bytes + self._pinned.free_bytes

    def clear(self) -> None:
        """Drop the free buffers (back to malloc)."""
        self._pool.clear()
        self._pinned.clear()
