"""The checkpoint's error, and the one rule for raising it: on every rank, or on none."""

from __future__ import annotations

from typing import Any, Optional

from elixir import distributed as edist


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked; the message names the problem and fix."""


def agree(group: Any, world_size: int, error: Optional[str], payload: Any = None) -> list[Any]:
    """Exchange every rank's ``(payload, error)`` (one collective; none at world size 1).

    If any rank reports an error, raise :class:`CheckpointError` with the first one on every rank,
    so no rank is left waiting in a later collective. Otherwise return every rank's payload, by rank.
    """
    pairs = edist.all_gather_object((payload, error), group) if world_size > 1 else [(payload, error)]
    bad = [(r, e) for r, (_, e) in enumerate(pairs) if e]
    if bad:
        r, e = bad[0]
        raise CheckpointError(e if world_size == 1 else f"rank {r}: {e}")
    return [p for p, _ in pairs]
