"""The rCache simulator: how many gathers (and evictions) a cache of N blocks costs for one step.

A trace lists, per hooked op of a training step, the chunks that op needs resident together. The
cache starts empty (the runtime resets it at the end of backward) and holds ``blocks`` gathered
chunks. A miss gathers the chunk; when the cache is full it first evicts:

- ``"belady"``: the resident chunk whose next use is furthest away (ties: the largest chunk id); the
  runtime's policy when it has a traced order;
- ``"lru"``: the least recently used chunk (ties: the smallest chunk id); its policy without one.

The native kernel (``csrc/cache_sim.cpp``) and the Python twin here give identical results.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from elixir._native import get_native, warn_fallback

POLICIES = ("belady", "lru")


@dataclass(frozen=True)
class AccessTrace:
    """Per-step chunk accesses as two flat int arrays (CSR): step ``t`` touches
    ``chunks[offsets[t]:offsets[t + 1]]``."""

    offsets: np.ndarray  # int64[n_steps + 1]
    chunks: np.ndarray  # int32[n_accesses]
    n_chunks: int

    @classmethod
    def from_steps(cls, steps: Sequence[Sequence[int]], n_chunks: Optional[int] = None) -> AccessTrace:
        offsets = np.zeros(len(steps) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in steps], out=offsets[1:])
        flat = np.fromiter((c for s in steps for c in s), dtype=np.int32, count=int(offsets[-1]))
        n = int(flat.max()) + 1 if n_chunks is None and flat.size else int(n_chunks or 0)
        return cls(offsets, flat, n)

    @property
    def n_steps(self) -> int:
        return len(self.offsets) - 1

    def steps(self) -> list[list[int]]:
        o, c = self.offsets, self.chunks
        return [c[o[t] : o[t + 1]].tolist() for t in range(self.n_steps)]

    def max_working_set(self) -> int:
        """The fewest blocks any single step can run with (distinct chunks of the largest step)."""
        return max((len(set(s)) for s in self.steps()), default=0)


@dataclass(frozen=True)
class CacheStats:
    """Simulated cost of one step: total gathers, evictions, and gathers per chunk."""

    gathers: int
    evictions: int
    per_chunk: np.ndarray  # int64[n_chunks]


def simulate(trace: AccessTrace, blocks: int, policy: str = "belady", backend: str = "auto") -> CacheStats:
    """Simulate ``trace`` through ``blocks`` cache blocks.

    ``backend``: ``"native"``, ``"python"`` or ``"auto"`` (native when the extension is built).
    Raises ValueError when one step needs more chunks at once than there are blocks.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    per_chunk = np.zeros(trace.n_chunks, dtype=np.int64)
    native = get_native() if backend in ("auto", "native") else None
    if native is not None and hasattr(native, "simulate_cache"):
        g, e = native.simulate_cache(trace.offsets, trace.chunks, trace.n_chunks, int(blocks), policy, per_chunk)
        return CacheStats(int(g), int(e), per_chunk)
    if backend == "native":
        raise RuntimeError("the native cache simulator is not available (build the extension)")
    if backend == "auto":
        warn_fallback("the rCache simulator")
    g, e = _simulate_py(trace.steps(), trace.n_chunks, int(blocks), policy == "belady", per_chunk)
    return CacheStats(g, e, per_chunk)


def _simulate_py(steps: list[list[int]], n_chunks: int, blocks: int, belady: bool, per_chunk: np.ndarray) -> tuple[int, int]:
    n_steps = len(steps)
    uniq = [list(dict.fromkeys(s)) for s in steps]
    for s in uniq:
        for c in s:
            if not 0 <= c < n_chunks:
                raise ValueError("chunk id out of range in trace")
    need = max((len(s) for s in uniq), default=0)
    if blocks < need:
        raise ValueError(f"cache has {blocks} blocks but one step needs {need} chunks at once")
    next_use: list[list[int]] = [[] for _ in range(n_steps)]
    if belady:
        last = [n_steps] * n_chunks
        for t in range(n_steps - 1, -1, -1):
            next_use[t] = [last[c] for c in uniq[t]]
            for c in uniq[t]:
                last[c] = t
    resident = [False] * n_chunks
    key = [0] * n_chunks
    heap: list[tuple[int, int]] = []  # Belady: (-next_use, -chunk); LRU: (last_use, chunk)
    used = gathers = evictions = 0
    for t, step in enumerate(uniq):
        hits = {c for c in step if resident[c]}
        if not belady:
            for c in hits:
                key[c] = t
                heapq.heappush(heap, (t, c))
        for c in step:
            if c in hits:
                continue
            if used == blocks:
                while True:
                    k, v = heapq.heappop(heap)
                    if belady:
                        k, v = -k, -v
                    if resident[v] and key[v] == k and v not in step:
                        resident[v] = False
                        used -= 1
                        evictions += 1
                        break
            resident[c] = True
            used += 1
            gathers += 1
            per_chunk[c] += 1
            key[c] = t
            if not belady:
                heapq.heappush(heap, (t, c))
        if belady:
            for c, nu in zip(step, next_use[t]):
                key[c] = nu
                heapq.heappush(heap, (-nu, -c))
    return gathers, evictions
