"""Resident memory of a process tree, which the benches cap: ``bench/capacity.py`` kills a trial
whose tree passes ``--mem-cap``; ``bench/step_time.py`` kills a line one of whose ranks passes the
budget its model's tight line claims. One helper, so both caps measure the same thing."""

from __future__ import annotations

import os


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (of any of its threads)."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (0 for a process that is gone)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
            todo += _children(p)
        except OSError:  # it ended while we looked
            continue
    return total


def rank_rss(pid: int, world: int) -> int:
    """The largest resident bytes of one rank of a job started as ``pid``: the process itself
    (with its descendants) at world size 1; under ``torch.distributed.run`` each child of the
    launcher is a rank."""
    if world == 1:
        return tree_rss(pid)
    try:
        ranks = _children(pid)
    except OSError:
        return 0
    return max((tree_rss(r) for r in ranks), default=0)
