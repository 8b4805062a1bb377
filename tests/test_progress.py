"""Progress lines for long work (elixir.progress): silent for short work, throttled, with an
estimate of the time left, a closing line, and off under ELIXIR_PROGRESS=0."""

from __future__ import annotations

import io

from elixir import progress as P


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(monkeypatch, steps: int, seconds_each: float, **kw) -> list[str]:
    clock = _Clock()
    monkeypatch.setattr(P.time, "perf_counter", clock)
    out = io.StringIO()
    p = P.Progress("building chunks", steps, stream=out, **kw)
    for _ in range(steps):
        clock.now += seconds_each
        p.advance()
    return out.getvalue().splitlines()


def test_short_work_is_silent(monkeypatch):
    assert _run(monkeypatch, 10, 0.5) == []  # 5 s in all: under the 10 s threshold


def test_long_work_reports_throttled_with_time_left_and_a_closing_line(monkeypatch):
    lines = _run(monkeypatch, 100, 2.0)  # 200 s: a line at 10 s, then every 30 s, then the end
    assert lines[0] == "elixir: building chunks: 5/100 (5%), 10 s so far, about 3.2 min left"
    assert len(lines) == 1 + 6 + 1  # 10 s, 40, 70 ... 190 s, and the closing line at 200 s
    assert lines[-1] == "elixir: building chunks: 100/100 (100%), 3.3 min so far, done"
    assert "20/100 (20%), 40 s so far, about 2.7 min left" in lines[1]  # 160 s left


def test_silenced_by_the_environment_or_off_rank(monkeypatch):
    monkeypatch.setenv("ELIXIR_PROGRESS", "0")
    assert _run(monkeypatch, 100, 2.0) == []
    monkeypatch.delenv("ELIXIR_PROGRESS")
    assert _run(monkeypatch, 100, 2.0, enabled=False) == []


def test_over_counts_an_item_once_its_loop_body_is_done(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(P.time, "perf_counter", clock)
    p = P.Progress("loading", 3, stream=io.StringIO())
    seen = []
    for item in p.over("abc"):
        seen.append((item, p.done))
        if item == "b":
            continue  # a skipped item counts too
        clock.now += 1
    assert seen == [("a", 0), ("b", 1), ("c", 2)] and p.done == 3
