"""Explicit chunk kinds and states, with checked transitions.

A chunk is of one :class:`ChunkKind` for its whole life: ``TRAINABLE`` (gradients, fp32 master,
optimizer state) or ``FROZEN`` (compute-dtype weights only; gathered and released, never reduced).

A chunk has two independent state machines:

- :class:`ChunkState`, for its gathered payload (the full flat tensor used for compute):
  ``RELEASED -> GATHERING -> HOLD <-> COMPUTE``, and back to ``RELEASED`` from ``HOLD``;
- :class:`GradState`, for its gradients within one backward:
  ``EMPTY -> ACCUMULATING -> REDUCED``, or through ``REDUCING`` when the reduction's collective
  is left running while backward goes on (a late gradient after an early reduction reopens
  ``REDUCED -> ACCUMULATING``; finalisation resets to ``EMPTY``).
"""

from __future__ import annotations

import enum


class ChunkKind(enum.Enum):
    """What a chunk holds besides its compute-dtype weights."""

    TRAINABLE = "trainable"  # gradient buffer, reduced shard gradient, fp32 master, optimizer state
    FROZEN = "frozen"  # nothing else: requires_grad=False parameters, read-only during training


class ChunkState(enum.Enum):
    """Where a chunk's payload stands."""

    RELEASED = "released"  # no payload storage (sharded chunks between uses)
    GATHERING = "gathering"  # an asynchronous all-gather into the payload is in flight
    HOLD = "hold"  # payload valid, in the rCache, evictable
    COMPUTE = "compute"  # payload valid and pinned by at least one user


class GradState(enum.Enum):
    """Where a chunk's gradients stand within one backward."""

    EMPTY = "empty"  # no gradient this backward
    ACCUMULATING = "accumulating"  # gradient buffer allocated, gradients arriving
    REDUCING = "reducing"  # the reduction's collective is in flight (the buffer is still held)
    REDUCED = "reduced"  # reduced into this rank's shard gradient


_CHUNK_MOVES = {
    ChunkState.RELEASED: {ChunkState.GATHERING, ChunkState.HOLD},
    ChunkState.GATHERING: {ChunkState.HOLD},
    ChunkState.HOLD: {ChunkState.COMPUTE, ChunkState.RELEASED},
    ChunkState.COMPUTE: {ChunkState.HOLD},
}

_GRAD_MOVES = {
    GradState.EMPTY: {GradState.ACCUMULATING},
    GradState.ACCUMULATING: {GradState.REDUCING, GradState.REDUCED, GradState.EMPTY},
    GradState.REDUCING: {GradState.REDUCED, GradState.EMPTY},
    GradState.REDUCED: {GradState.ACCUMULATING, GradState.EMPTY},
}


class IllegalTransition(RuntimeError):
    """A chunk was asked to move between two states that are not connected (a runtime bug)."""


def check_chunk_move(index: int, old: ChunkState, new: ChunkState) -> None:
    if new not in _CHUNK_MOVES[old]:
        raise IllegalTransition(f"chunk {index}: illegal payload transition {old.name} -> {new.name}")


def check_grad_move(index: int, old: GradState, new: GradState) -> None:
    if new not in _GRAD_MOVES[old]:
        raise IllegalTransition(f"chunk {index}: illegal gradient transition {old.name} -> {new.name}")
