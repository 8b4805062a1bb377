"""Plans with every chunk of one sharding, or the shardings mixed: shared by the tests that run
the same training over each chunk kind (clipping, ZeRO stages, deferred reductions)."""

from __future__ import annotations

import dataclasses

from elixir.search import SearchResult, Sharding

MIX = (Sharding.SHARDED, Sharding.ZERO2, Sharding.ZERO1, Sharding.REPLICATED)


def with_kinds(sr, kinds: str):
    """``sr`` with every chunk ZeRO-2 (``"zero2"``), or the kinds cycling through :data:`MIX`."""
    if not kinds:
        return sr
    w = sr.world_size
    chunks = [c.with_sharding(Sharding.ZERO2 if kinds == "zero2" else MIX[i % len(MIX)], w) for i, c in enumerate(sr.chunks)]
    sharded = sum(c.sharded for c in chunks)
    return dataclasses.replace(sr, chunks=tuple(chunks), cache_blocks=max(1, min(sr.cache_blocks, sharded)))


def uniform(sr: SearchResult, kind: Sharding) -> SearchResult:
    """``sr`` with every chunk of sharding ``kind``."""
    chunks = tuple(c.with_sharding(kind, sr.world_size) for c in sr.chunks)
    return dataclasses.replace(sr, chunks=chunks, cache_blocks=max(1, min(sr.cache_blocks, sum(c.sharded for c in chunks))))
