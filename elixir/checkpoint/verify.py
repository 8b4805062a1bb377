"""Check a checkpoint without loading it: the index, every file's presence, size and checksum."""

from __future__ import annotations

import time
from dataclasses import dataclass

from elixir.checkpoint import atomic
from elixir.checkpoint.index import Index


@dataclass(frozen=True)
class Verified:
    """What :func:`verify` found in a checkpoint that passed.

    Attributes:
        path: the checkpoint directory read (the renamed-aside copy if a save was interrupted).
        kind: ``"sharded"`` or ``"full"``.
        world_size: the world size it was saved at.
        files: every file the index lists, by name, with its size in bytes.
        checked: whether the checksums were checked; False for a checkpoint written before elixir
            stored checksums (only presence and sizes could be checked).
        seconds: time spent.
    """

    path: str
    kind: str
    world_size: int
    files: dict[str, int]
    checked: bool
    seconds: float

    def summary(self) -> str:
        total = sum(self.files.values())
        what = "checksums match" if self.checked else "cannot check contents: this checkpoint predates checksums (sizes only)"
        return (f"{self.path}: {self.kind} checkpoint of world size {self.world_size}, {len(self.files)} files, "
                f"{total / 2**20:.1f} MiB: {what} ({self.seconds:.2f} s)")


def verify(path: str) -> Verified:
    """Check the checkpoint at ``path`` (no process group needed): raise
    :class:`~elixir.checkpoint.CheckpointError` naming the first missing, truncated or damaged file;
    return what was checked otherwise."""
    t0 = time.perf_counter()
    root = atomic.resolve(path)
    index = Index.read(root)  # index format, every file present with its recorded size
    for fname in index.files:
        index.check(root, fname)
    return Verified(root, index.kind, index.world_size, dict(index.files), bool(index.checksums),
                    time.perf_counter() - t0)
