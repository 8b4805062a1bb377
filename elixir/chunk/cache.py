"""The rCache: at most ``capacity`` sharded chunks gathered at once, with an eviction policy.

The cache decides which gathered chunk to release when another must be gathered. Pinned chunks
(in use) are never evicted. The policy is LRU, or Belady (evict the chunk whose next use is
furthest away) when a :class:`~elixir.chunk.schedule.Schedule` can tell the future.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, Iterable, Optional

from elixir.chunk.accounting import ElixirMemoryError
from elixir.chunk.chunk import Chunk
from elixir.chunk.state import ChunkState

NextUse = Callable[[Chunk], float]


class BlockCache:
    """Gathers chunks on demand into at most ``capacity`` blocks.

    Args:
        capacity: the number of rCache blocks.
        strict: raise when every block is pinned and one more is needed (else go over capacity
            for the moment, with one warning).
    """

    def __init__(self, capacity: int, strict: bool = False) -> None:
        self.capacity = max(int(capacity), 0)
        self.strict = strict
        self.resident: OrderedDict[int, Chunk] = OrderedDict()  # LRU order: oldest first
        self.peak_resident = 0
        self.gathers = 0
        self.evictions = 0
        self.prefetches = 0  # asynchronous gathers issued ahead of use
        self._warned = False

    def __contains__(self, chunk: Chunk) -> bool:
        return chunk.index in self.resident

    def touch(self, chunk: Chunk) -> None:
        self.resident.move_to_end(chunk.index)

    def _victim(self, next_use: Optional[NextUse], protect: Iterable[int]) -> Optional[Chunk]:
        protected = set(protect)
        candidates = [
            c for c in self.resident.values()
            if c.state is ChunkState.HOLD and c.pins == 0 and c.index not in protected
        ]
        if not candidates:
            return None
        if next_use is None:
            return candidates[0]  # least recently used
        return max(candidates, key=next_use)  # Belady: needed furthest in the future (ties: LRU)

    def make_room(self, next_use: Optional[NextUse] = None, protect: Iterable[int] = (), soft: bool = False) -> bool:
        """Evict until one block is free. ``soft``: give up (return False) instead of exceeding."""
        while len(self.resident) >= self.capacity:
            victim = self._victim(next_use, protect)
            if victim is None:
                if soft:
                    return False
                if self.strict:
                    raise ElixirMemoryError(
                        f"all {self.capacity} rCache blocks are in use and one more chunk is needed; "
                        f"use a plan with more cache blocks"
                    )
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"elixir: all {self.capacity} rCache blocks are pinned and another chunk is "
                        f"needed; going over the plan's cache for now (the plan's cache_blocks is too "
                        f"small for this model's execution order)",
                        stacklevel=3,
                    )
                return True
            self.evict(victim)
        return True

    def evict(self, chunk: Chunk) -> None:
        chunk.release()
        del self.resident[chunk.index]
        self.evictions += 1

    def acquire(self, chunk: Chunk, next_use: Optional[NextUse] = None, protect: Iterable[int] = ()) -> None:
        """Make ``chunk`` gathered (waiting for an in-flight gather) and most recently used."""
        if chunk.index in self.resident:
            chunk.wait()
            self.touch(chunk)
            return
        self.make_room(next_use, protect)
        chunk.gather()
        self.admit(chunk)

    def prefetch(self, chunk: Chunk, next_use: Optional[NextUse], protect: Iterable[int]) -> bool:
        """Start an asynchronous gather of ``chunk`` if a block can be freed without exceeding."""
        if chunk.index in self.resident:
            return True
        if not self.make_room(next_use, protect, soft=True):
            return False
        chunk.gather(async_op=True)
        self.admit(chunk)
        self.prefetches += 1
        return True

    def admit(self, chunk: Chunk) -> None:
        """Count ``chunk``, gathered by the caller, as resident (it is evicted like any other)."""
        self.resident[chunk.index] = chunk
        self.gathers += 1
        self.peak_resident = max(self.peak_resident, len(self.resident))

    def drain(self) -> None:
        """Finish every in-flight prefetch gather (GATHERING -> HOLD), so no collective of this
        cache is still running when its chunks are freed or the process group is torn down."""
        for chunk in list(self.resident.values()):
            chunk.wait()

    def release_all(self) -> None:
        """Release every unpinned chunk (end of backward, after an optimizer step, no_grad forward)."""
        for chunk in list(self.resident.values()):
            if chunk.pins == 0:
                self.evict(chunk)
