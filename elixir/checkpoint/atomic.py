"""The whole-directory commit: a crash at any moment leaves the previous checkpoint loadable.

Everything is written into a staging directory beside the target (``.NAME.tmp-*``); files and
directory are fsynced (:mod:`elixir.fileio`), then the directory is renamed into place. An older
checkpoint at the target is first renamed aside (``.NAME.old-*``) and removed after; if a crash
falls between the two renames, :func:`resolve` finds the renamed-aside copy.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from elixir.checkpoint.errors import CheckpointError, agree
from elixir.checkpoint.index import INDEX
from elixir.fileio import fsync_dir


def staging_dir(path: str, markers: tuple[str, ...] = (INDEX,)) -> str:
    """Create and return a fresh staging directory for a checkpoint at ``path``, after removing
    debris of earlier saves that crashed. Refuses to replace anything that is not a checkpoint:
    an existing ``path`` must hold one of the files ``markers`` names (or be an empty directory)."""
    target = os.path.abspath(path)
    parent, name = os.path.split(target)
    whole = any(os.path.isfile(os.path.join(target, m)) for m in markers)
    if os.path.exists(target) and not whole and not (os.path.isdir(target) and not os.listdir(target)):
        raise CheckpointError(
            f"{target} exists and is not a checkpoint (none of {', '.join(markers)}); refusing to replace it — "
            "choose another path or remove it yourself"
        )
    os.makedirs(parent, exist_ok=True)
    debris = glob.glob(os.path.join(parent, f".{name}.tmp-*"))  # left by a save that crashed
    if whole:  # the target is whole: older copies are debris too
        debris += glob.glob(os.path.join(parent, f".{name}.old-*"))
    for stale in debris:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    return tmp


def commit(tmp: str, path: str) -> None:
    """Move the finished staging directory ``tmp`` into place at ``path``."""
    fsync_dir(tmp)
    target = os.path.abspath(path)
    parent, name = os.path.split(target)
    if os.path.exists(target):
        aside = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
        os.rename(target, aside)
        os.rename(tmp, target)
        fsync_dir(parent)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, target)
        fsync_dir(parent)


@dataclass
class Staged:
    """A collective save in progress: ``tmp`` is the staging directory every rank writes into;
    the body sets ``error`` to rank 0's failure (other ranks agree on theirs within the body)."""

    tmp: str
    error: Optional[str] = None


@contextlib.contextmanager
def collective_save(path: str, group: Any, world_size: int, rank: int, markers: tuple[str, ...] = (INDEX,),
                    finish: Optional[Callable[[str], None]] = None) -> Iterator[Staged]:
    """Stage a checkpoint directory that every rank writes into, and commit it atomically.

    Rank 0 creates the staging directory (:func:`staging_dir`; its failure is raised on every
    rank). The body writes and reports rank 0's failure in ``error``. On leaving, rank 0 runs
    ``finish(tmp)`` (an index or metadata written last) and commits; every rank then agrees on
    the outcome, so a failure is raised on every rank and no rank waits. On an exception rank 0
    removes the staging directory and a previous checkpoint at ``path`` stays as it was."""
    tmp, error = None, None
    if rank == 0:
        try:
            tmp = staging_dir(path, markers)
        except (OSError, CheckpointError) as e:
            error = str(e)
    tmp = agree(group, world_size, error, tmp)[0]
    try:
        stage = Staged(tmp)
        yield stage
        error = stage.error
        if rank == 0 and error is None:
            try:
                if finish is not None:
                    finish(tmp)
                commit(tmp, path)
            except OSError as e:
                error = f"could not finish the checkpoint or move it into place at {path}: {e}"
        agree(group, world_size, error)
    except BaseException:
        if rank == 0 and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve(path: str) -> str:
    """``path``, or the renamed-aside previous checkpoint when a save died between its renames."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        return target
    parent, name = os.path.split(target)
    aside = sorted(glob.glob(os.path.join(parent, f".{name}.old-*")), key=os.path.getmtime)
    aside = [a for a in aside if os.path.isfile(os.path.join(a, INDEX))]
    if aside:
        warnings.warn(f"elixir: {path} is missing (a save was interrupted); loading the previous checkpoint {aside[-1]}", stacklevel=3)
        return aside[-1]
    raise CheckpointError(f"no checkpoint at {path}")
