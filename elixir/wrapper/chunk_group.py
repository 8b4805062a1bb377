"""The trainable chunks of an ElixirModule as one group: what happens to all of them at once.

After an optimizer step the masters changed: compute shards are refreshed from them (on the copy
stream), ZeRO-1/2 chunks publish their updated slices into their resident payloads (all-gathers,
possibly left running), and every gathered payload, now stale, is dropped from the rCache. Between
steps the group forgets its reduced gradients. Invariant: after :meth:`ChunkGroup.after_step`
returns, no chunk holds a payload older than its master.
"""

from __future__ import annotations

from typing import Container, Iterator, Optional

import torch

from elixir import device as dev
from elixir.chunk import BlockCache, Chunk


class ChunkGroup:
    """Operations over every trainable chunk (``chunks``, plan order)."""

    def __init__(self, chunks: list[Chunk], streams: dev.SideStreams, cache: BlockCache) -> None:
        self.chunks, self.streams, self.cache = chunks, streams, cache

    def after_step(self, fresh: Container[int] = ()) -> None:
        """Refresh compute shards (but those of the chunks in ``fresh``, already equal to their
        masters), publish the ZeRO-1/2 chunks' updated slices, drop every gathered payload."""
        for c in self.chunks:
            if c.index not in fresh:
                c.refresh_from_master()  # on the copy stream
        self.publish()
        self.streams.join()  # the next forward's compute waits for the refreshed shards
        self.cache.release_all()

    def publish(self, chunks: Optional[list[int]] = None, wait: bool = True) -> None:
        """All-gather the updated slices of every ZeRO-1/2 chunk (of ``chunks`` when given) into its
        resident payload; with ``wait=False`` they may still run when this returns."""
        for c in self.chunks if chunks is None else [self.chunks[i] for i in chunks]:
            c.publish(async_op=True)
        if wait:
            self.finish_publishes()

    def finish_publishes(self) -> None:
        """Wait for the asynchronous publishes in flight."""
        for c in self.chunks:
            c.finish_publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget every chunk's reduced (shard) gradient."""
        for c in self.chunks:
            c.zero_grad(set_to_none)

    def shards(self) -> Iterator[tuple[Chunk, torch.Tensor, Optional[torch.Tensor]]]:
        """(chunk, fp32 master shard, shard gradient or None) for this rank, plan order."""
        for c in self.chunks:
            yield c, c.master, (c.shard_grad if c.grad_valid else None)

    def kinds(self) -> dict[str, int]:
        """How many chunks of each sharding."""
        kinds: dict[str, int] = {}
        for c in self.chunks:
            kinds[c.spec.sharding.value] = kinds.get(c.spec.sharding.value, 0) + 1
        return kinds
