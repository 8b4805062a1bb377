"""Check a checkpoint without loading it: the index, every file's presence, size and checksum."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from elixir.checkpoint import atomic
from elixir.checkpoint.index import Index
from elixir.checkpoint.mesh_source import MESH, read_meta


@dataclass(frozen=True)
class Verified:
    """What :func:`verify` found in a checkpoint that passed.

    Attributes:
        path: the checkpoint directory read (the renamed-aside copy if a save was interrupted).
        kind: ``"sharded"``, ``"full"`` or ``"mesh"`` (:func:`~elixir.checkpoint.save_mesh`: every
            part checked).
        world_size: the world size it was saved at.
        files: every file the index lists, by name (a mesh checkpoint's under their part's
            directory, ``stage00-tp00/...``), with its size in bytes.
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
    if os.path.isfile(os.path.join(root, MESH)):
        return _verify_mesh(root, t0)
    index = Index.read(root)  # index format, every file present with its recorded size
    for fname in index.files:
        index.check(root, fname)
    return Verified(root, index.kind, index.world_size, dict(index.files), bool(index.checksums),
                    time.perf_counter() - t0)


def _verify_mesh(root: str, t0: float) -> Verified:
    meta = read_meta(root)
    files: dict[str, int] = {}
    checked = True
    for part in meta["parts"]:
        pdir = os.path.join(root, part)
        index = Index.read(pdir)
        for fname in index.files:
            index.check(pdir, fname)
            files[f"{part}/{fname}"] = index.files[fname]
        checked = checked and bool(index.checksums)
    lay = meta["layout"]
    world = int(lay.get("pp", 1)) * int(lay.get("dp_shard", 1)) * int(lay.get("tp", 1))
    return Verified(root, "mesh", world, files, checked, time.perf_counter() - t0)
