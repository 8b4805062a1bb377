"""Where one rank's bytes are: an ElixirModule's ``memory_report``, read from its ledger, its offload
store and the process, beside what its optimizer reports (:class:`MemoryAccounts` keeps the
reporters and the offload stores whose peaks reset with the ledger's)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from elixir import device as dev
from elixir.chunk import BlockCache, Chunk, GradBufferPool, MemoryLedger
from elixir.offload.store import DiskStore


class MemoryAccounts:
    """The byte counts beside the ledger: reporters (an optimizer's state) and the offload stores."""

    def __init__(self, ledger: MemoryLedger, stores: tuple[Optional[Any], ...]) -> None:
        self.ledger = ledger
        self.stores = [s for s in stores if s is not None]  # DiskStore / DerivedShards that exist
        self.reporters: list[Callable[[], dict[str, int]]] = []

    def extra(self) -> dict[str, int]:
        """What the reporters return, merged."""
        out: dict[str, int] = {}
        for fn in self.reporters:
            out.update(fn())
        return out

    def reset_peaks(self) -> None:
        self.ledger.reset_peaks()
        for store in self.stores:
            store.reset_peak()


def memory_report(ledger: MemoryLedger, all_chunks: list[Chunk], cache: BlockCache, device: torch.device,
                  grad_dtype: torch.dtype, grad_buffers: GradBufferPool, disk_store: Optional[DiskStore],
                  extra: dict[str, int]) -> dict[str, int]:
    """Where this rank's bytes are: the runtime's own tensors by category (the ledger), the
    optimizer's state (``extra``: what the registered reporters returned), the disk staging, and
    beside them the process as the OS sees it.

    Ledger and optimizer (current, and ``peak_*`` since ``reset_peak_memory``):
    ``shard_*`` compute shards of trainable chunks; ``frozen_shard_*`` those of frozen chunks
    (all a frozen chunk costs between uses); ``master_bytes`` fp32 masters resident (disk masters only
    while staged); ``cache_bytes`` / ``gathered_bytes`` the rCache; ``grad_buffer`` full-size
    gradient buffers during backward; ``shard_grad_bytes`` reduced shard gradients, in
    ``grad_element_bytes`` per element (0 between steps with the fused backward-and-step);
    ``optimizer_state_bytes`` the inner optimizer's resident state (an ElixirOptimizer reports
    it); ``disk_staged_bytes`` masters+state of disk chunks staged in host memory.

    Process (CPU box: device and host are one pool): ``rss_bytes`` / ``peak_rss_bytes``;
    ``elixir_bytes`` what the ledger and the optimizer account for in host memory (with an
    accelerator, its device bytes are not in RSS and not counted here); ``untracked_bytes`` = RSS
    less elixir's bytes: the interpreter and libraries (the search's ``process`` term), the
    model's other tensors, activations alive now, transient copies and allocator slack;
    ``heap_free_bytes`` memory malloc holds free in its heap (slack: resident unless trimmed;
    with ``keep_host_memory`` it is never given back, so RSS keeps its high-water mark);
    ``grad_pool_free_bytes`` gradient buffers held free for the next backward (CPU:
    :class:`~elixir.chunk.GradBufferPool`).
    ``offload_page_cache_bytes`` the offload file's pages in the kernel's page cache (not in
    RSS, but charged to the same memory cgroup)."""
    L = ledger
    block = max((c.payload_bytes for c in all_chunks if c.spec.sharded), default=0)
    store = disk_store
    # RSS counts host memory only: on an accelerator the ledger's device bytes and the
    # optimizer state held there are not in it (on a CPU device both are host memory)
    on_host = ("host", "device") if not dev.is_accelerator(device) else ("host",)
    tracked = sum(n for (_, loc), n in L.current.items() if loc in on_host) + extra.get(
        "optimizer_state_host_bytes", extra.get("optimizer_state_bytes", 0))
    heap = dev.host_allocator_stats()
    rss = dev.rss_bytes()
    process = {
        "rss_bytes": rss,
        "peak_rss_bytes": dev.peak_rss_bytes(),
        "elixir_bytes": tracked,
        "heap_free_bytes": heap.get("heap_free_bytes", 0),
        "grad_pool_free_bytes": grad_buffers.free_bytes,
        "untracked_bytes": max(0, rss - tracked),
        "offload_page_cache_bytes": store.page_cache_bytes() if store is not None else 0,
    }
    return {
        "grad_element_bytes": torch.empty((), dtype=grad_dtype).element_size(),
        "peak_shard_grad_bytes": L.bytes("shard_grad", peak=True),
        "disk_staged_bytes": store.staged_bytes if store is not None else 0,
        "peak_disk_staged_bytes": store.peak_staged_bytes if store is not None else 0,
        **extra,
        **process,
        "shard_bytes": L.bytes("shard"),
        "shard_device_bytes": L.bytes("shard", "device"),
        "shard_host_bytes": L.bytes("shard", "host"),
        "frozen_shard_bytes": L.bytes("frozen_shard"),
        "frozen_shard_device_bytes": L.bytes("frozen_shard", "device"),
        "frozen_shard_host_bytes": L.bytes("frozen_shard", "host"),
        "master_bytes": L.bytes("master"),
        "cache_bytes": cache.capacity * block,
        "gathered_bytes": L.bytes("gathered"),
        "peak_gathered_bytes": L.bytes("gathered", peak=True),
        "peak_grad_buffer_bytes": L.bytes("grad_buffer", peak=True),
        "shard_grad_bytes": L.bytes("shard_grad"),
        "device_peak_bytes": L.device_peak,
        # torch's own statistics for the whole process on the device (0 on CPU), beside the
        # ledger's figures for the runtime's tensors
        "device_allocated_bytes": dev.memory_allocated(device),
        "device_max_allocated_bytes": dev.max_memory_allocated(device),
        "device_reserved_bytes": dev.memory_reserved(device),
    }
