"""Durable file writes: a reader sees the old file or the new one, never a torn one.

The primitives every writer in elixir uses (hardware profiles, plans, traces, checkpoints):
:func:`fsync_file`, :func:`fsync_dir`, :func:`atomic_write_json`. The checkpoint's whole-directory
protocol builds on them in :mod:`elixir.checkpoint.atomic`.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_file(path: str | os.PathLike) -> None:
    """Flush ``path``'s data to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush the directory ``path`` (its entries: files created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 1) -> None:
    """Write ``obj`` as JSON to ``path`` via a temp file in the same folder, fsync, then rename."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def require_version(found: Any, expected: int, what: str, fix: str) -> None:
    """Refuse a file whose format ``what`` has another version than the one this elixir reads."""
    if found != expected:
        raise ValueError(f"{what} version {found} is not supported (this elixir reads version {expected}); {fix}")


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Load JSON from ``path``; a malformed file raises ValueError naming ``what`` it should be."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a valid {what} JSON file: {e}") from None
