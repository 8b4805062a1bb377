"""The compute a prefetched gather can hide under (elixir/search/gather_windows.py), held against
the runtime's own prefetch schedule (elixir.chunk.schedule.Schedule, driven as
wrapper/step_hooks.py drives it) and the step profile's pass counts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from elixir.chunk.schedule import Schedule
from elixir.search.gather_windows import chunk_uses, compute_before, gather_windows
from elixir.search.simulator import AccessTrace
from elixir.search.step_profile import BACKWARD, profile_step


def _issued_by_runtime(steps: list[frozenset], depth: int) -> dict[int, int]:
    """Per chunk, the schedule step at which the runtime first prefetches it (step_hooks._use:
    observe the step, then prefetch what ``upcoming`` lists); chunks of the first step are
    gathered on demand and absent."""
    sched = Schedule(steps, lookahead=depth)
    sched.restart()
    issued: dict[int, int] = {}
    used: set[int] = set()
    for j, s in enumerate(sched.steps):
        assert sched.observe(s)
        used |= s
        for c in sched.upcoming():
            if c not in used:
                issued.setdefault(c, j)
    return issued


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_first_gather_windows_follow_the_runtime_schedule(seed, depth):
    rng = random.Random(seed)
    n_chunks, n_steps = 6, 40
    raw = [sorted(rng.sample(range(n_chunks), rng.choice([0, 1, 1, 2]))) for _ in range(n_steps)]
    trace = AccessTrace.from_steps(raw, n_chunks)
    cum = np.cumsum([0.0] + [rng.random() for _ in range(n_steps)])
    cum /= cum[-1]
    starts, uses = chunk_uses(trace)
    first = {c: int(u[0]) for c, u in enumerate(uses) if u.size}
    g = np.asarray([1 if c in first else 0 for c in range(n_chunks)])

    class _Profile:  # compute_before's inputs, shaped to give ``cum``
        numel = {f"p{t}": 0 for t in range(n_steps)}
        steps = tuple((f"p{t}",) for t in range(n_steps))
        step_kinds = ("forward",) * n_steps

    prof = _Profile()
    prof.numel = {f"p{t}": cum[t + 1] - cum[t] for t in range(n_steps)}
    np.testing.assert_allclose(compute_before(prof), cum)

    sets = [frozenset(s) for s in raw if s]
    issued = _issued_by_runtime(sets, depth)
    ids, windows = gather_windows(prof, trace, g, depth, {})
    assert sorted(ids.tolist()) == sorted(first)
    for c, w in zip(ids.tolist(), windows.tolist()):
        j = first[c]
        expect = cum[starts[j]] - cum[starts[issued[c]]] if c in issued else 0.0
        assert w == pytest.approx(expect, abs=1e-12), (c, j, issued.get(c))
    # a deeper prefetch issues every gather no later
    _, deeper = gather_windows(prof, trace, g, depth + 1, {})
    assert (deeper >= windows - 1e-12).all()


def test_compute_shares_follow_the_profiles_pass_counts():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    prof = profile_step(model, {"x": torch.randn(4, 16)}, lambda m, b: m(b["x"]).sum().backward())
    cum = compute_before(prof)
    assert cum[0] == 0 and cum[-1] == pytest.approx(1.0)
    backward = sum(cum[t + 1] - cum[t] for t, k in enumerate(prof.step_kinds) if k == BACKWARD)
    assert backward == pytest.approx(prof.backward_share())
