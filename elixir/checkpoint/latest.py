"""Numbered checkpoints under one directory, and the newest complete one (``--resume auto``).

A run that saves every N steps writes ``ROOT/step-00000050``, ``ROOT/step-00000100``, ...
(:func:`step_path`). Each save is atomic, so a directory of that name is complete unless it was
damaged afterwards; :func:`latest` still verifies (sizes and checksums, no process group) and
skips a damaged one with a warning, so a restart resumes from the newest checkpoint that loads.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Optional

from elixir.checkpoint.errors import CheckpointError
from elixir.checkpoint.verify import verify

_NAME = re.compile(r"^step-(\d+)$")


def step_path(root: str, step: int) -> str:
    """The directory of the checkpoint taken after ``step`` steps under ``root``."""
    return os.path.join(root, f"step-{step:08d}")


def numbered(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every numbered checkpoint directory under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := _NAME.match(n))]
    return sorted(found, reverse=True)


def latest(root: str) -> Optional[str]:
    """The newest checkpoint under ``root`` that :func:`~elixir.checkpoint.verify` passes (a
    damaged one is skipped with a warning naming it); None when there is none."""
    for _, path in numbered(root):
        try:
            verify(path)
        except CheckpointError as e:
            warnings.warn(f"elixir: skipping checkpoint {path}: {e}", stacklevel=2)
            continue
        return path
    return None
