"""Where each trainable parameter of an ElixirModule lives in the chunks (FSDP2's ``FSDPParam`` role).

:class:`ParamMap` is the one place that maps parameters onto chunks: slots by parameter, parameters
by chunk, and the shard-overlap arithmetic, "which slice of this parameter sits in my shard of its
chunk" (:meth:`ParamMap.shard_pieces`). The optimizer's fragments, the state dicts, the optimizer
state and the checkpoints all ask it instead of redoing the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from elixir.chunk import ChunkSpec


@dataclass(frozen=True)
class ParamSlot:
    """Where one trainable parameter lives: its chunk, offset and size, and its index."""

    index: int
    name: str
    chunk: int
    offset: int
    numel: int
    shape: tuple


@dataclass(frozen=True)
class ShardPiece:
    """The part of parameter ``param_index`` that lies in this rank's shard of chunk ``chunk``:
    elements ``[lo, hi)`` of the shard, which are elements ``[start, start + hi - lo)`` of the
    flattened parameter."""

    param_index: int
    chunk: int
    lo: int
    hi: int
    start: int


class ParamMap:
    """Slots of the trainable parameters, in plan order, and the chunks they sit in.

    Attributes:
        slots: one :class:`ParamSlot` per trainable parameter, indexed by ``slot.index``.
        params: the parameters, in the same order.
        by_chunk: ``by_chunk[c]``: indices of the slots in chunk ``c``, in chunk order.
    """

    def __init__(self, n_chunks: int):
        self.slots: list[ParamSlot] = []
        self.params: list[nn.Parameter] = []
        self.by_param: dict[nn.Parameter, ParamSlot] = {}
        self.by_chunk: list[list[int]] = [[] for _ in range(n_chunks)]

    def add(self, param: nn.Parameter, name: str, chunk: int, offset: int, shape: tuple) -> ParamSlot:
        """Place ``param`` at ``offset`` of chunk ``chunk`` (called in plan order)."""
        slot = ParamSlot(len(self.slots), name, chunk, offset, param.numel(), tuple(shape))
        self.slots.append(slot)
        self.params.append(param)
        self.by_param[param] = slot
        self.by_chunk[chunk].append(slot.index)
        return slot

    def __contains__(self, param: object) -> bool:
        return param in self.by_param

    def __len__(self) -> int:
        return len(self.slots)

    def slot_of(self, param: nn.Parameter) -> Optional[ParamSlot]:
        """The slot of ``param``; None when the module does not manage it (frozen, or not chunked)."""
        return self.by_param.get(param)

    def chunk_params(self, chunk: int) -> list[int]:
        """Indices of the slots in chunk ``chunk``."""
        return self.by_chunk[chunk]

    def shard_pieces(self, spec: ChunkSpec) -> list[ShardPiece]:
        """This rank's shard of the chunk ``spec`` describes, cut at parameter boundaries: the
        pieces of its parameters that lie in it, in chunk order (padding holds none)."""
        lo, hi = spec.shard_offset, spec.shard_offset + spec.shard_numel
        out = []
        for i in self.by_chunk[spec.index]:
            s = self.slots[i]
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(ShardPiece(i, spec.index, a - lo, b - lo, a - s.offset))
        return out

    def param_offset(self, spec: ChunkSpec, lo: int, param_index: int) -> int:
        """Where element ``lo`` of this rank's shard of chunk ``spec`` sits in the flattened
        parameter ``param_index`` (the inverse of :meth:`shard_pieces`)."""
        return spec.shard_offset + lo - self.slots[param_index].offset
