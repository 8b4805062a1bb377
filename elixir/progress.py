"""Progress lines for long work (a large model's chunk build, a long load): silent for work that
ends quickly, then one line to stderr at most every ``every`` seconds with the count done, the time
taken and an estimate of the time left. ``ELIXIR_PROGRESS=0`` silences it; only the rank that
passes ``enabled=True`` (rank 0, by convention) speaks."""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, Optional, TextIO, TypeVar

T = TypeVar("T")


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class Progress:
    """Counts ``total`` units of ``what`` (e.g. "building chunks"); call :meth:`advance` after each."""

    def __init__(self, what: str, total: int, enabled: bool = True, after: float = 10.0, every: float = 30.0,
                 stream: Optional[TextIO] = None) -> None:
        self.what, self.total = what, int(total)
        self.enabled = enabled and os.environ.get("ELIXIR_PROGRESS", "1") != "0"
        self.after, self.every = after, every
        self.stream = stream
        self.done = 0
        self.start = time.perf_counter()
        self._last: Optional[float] = None
        self.lines = 0

    def advance(self, n: int = 1, detail: str = "") -> None:
        """``n`` more units done; prints a line when the work has run ``after`` seconds and the last
        line is ``every`` seconds old (and always at the end, once any line was printed)."""
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.start
        finished = self.done >= self.total
        due = elapsed >= self.after and (self._last is None or now - self._last >= self.every)
        if not (due or (finished and self.lines)):
            return
        self._last = now
        self.lines += 1
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        tail = "done" if finished else f"about {_minutes(left)} left"
        extra = f", {detail}" if detail else ""
        print(f"elixir: {self.what}: {self.done}/{self.total} ({100 * self.done / max(1, self.total):.0f}%)"
              f"{extra}, {_minutes(elapsed)} so far, {tail}", file=self.stream or sys.stderr, flush=True)

    def over(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, each counted done when the loop body that took it has finished."""
        for item in items:
            yield item
            self.advance()
