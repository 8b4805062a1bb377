"""A traced order of chunk uses, for prefetching and Belady eviction.

The order is a sequence of steps, each the set of sharded chunk indices one hooked call needs.
The runtime reports each step it actually takes; while they match the order it can look ahead.
On a mismatch (different control flow) the schedule switches itself off until the next iteration,
and the runtime falls back to on-demand gathering with LRU eviction.

A plan made without a traced step (the front ends' ``placement_policy="auto"``, ``plugin="auto"``,
``GeminiPlugin(max_prefetch=...)`` on an untraced plan) has no order; the runtime then follows the
order its first training iteration took (:func:`learned_schedule`), from the second on.
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

INF = float("inf")


def collapse(steps: Sequence[frozenset]) -> list[frozenset]:
    """Drop empty steps and merge consecutive identical ones."""
    out: list[frozenset] = []
    for s in steps:
        if s and (not out or out[-1] != s):
            out.append(s)
    return out


def learned_schedule(observed: Sequence[frozenset], depth: int) -> Optional[Schedule]:
    """The schedule of the order one iteration took (its hooked steps' sharded chunk sets), looking
    ``depth`` steps ahead (at least 1); None when it used no sharded chunk (nothing to prefetch)."""
    steps = collapse(observed)
    return Schedule(steps, lookahead=max(1, depth)) if steps else None


class Schedule:
    """Follows a traced sequence of chunk-index sets.

    Args:
        steps: the traced steps (collapsed with :func:`collapse` first).
        lookahead: how many steps ahead :meth:`upcoming` reports.
        resync: how many steps ahead a reported step may be found and still count as in order.
    """

    def __init__(self, steps: Sequence[frozenset], lookahead: int = 1, resync: int = 3) -> None:
        self.steps = collapse(steps)
        self.lookahead = max(1, lookahead)
        self.resync = resync
        self._uses: dict[int, list[int]] = {}
        for i, s in enumerate(self.steps):
            for c in s:
                self._uses.setdefault(c, []).append(i)
        self.cursor = -1
        self.active = bool(self.steps)
        self.drifted = False

    def restart(self) -> None:
        """Start of an iteration: follow the order from its beginning again."""
        self.cursor = -1
        self.active = bool(self.steps)

    def observe(self, chunks: frozenset) -> bool:
        """Report the step being taken. Returns False (and switches off) when it is out of order."""
        if not self.active or not chunks:
            return self.active
        if 0 <= self.cursor < len(self.steps) and self.steps[self.cursor] == chunks:
            return True
        for j in range(self.cursor + 1, min(len(self.steps), self.cursor + 1 + self.resync)):
            if self.steps[j] == chunks:
                self.cursor = j
                return True
        self.active = False
        self.drifted = True
        return False

    def next_use(self, chunk_index: int) -> float:
        """Steps until ``chunk_index`` is needed again after the current step (inf if never)."""
        uses = self._uses.get(chunk_index)
        if not uses:
            return INF
        k = bisect.bisect_right(uses, self.cursor)
        return INF if k == len(uses) else uses[k] - self.cursor

    def upcoming(self) -> list[int]:
        """Chunk indices of the next ``lookahead`` steps, nearest first, without repeats."""
        out: list[int] = []
        for j in range(self.cursor + 1, min(len(self.steps), self.cursor + 1 + self.lookahead)):
            for c in sorted(self.steps[j]):
                if c not in out:
                    out.append(c)
        return out

    def current(self) -> Optional[frozenset]:
        return self.steps[self.cursor] if 0 <= self.cursor < len(self.steps) else None
