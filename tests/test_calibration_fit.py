"""The calibration's compute fit (issue 35): ``m = a * (matmul + memory time) + b * ops`` by
non-negative least squares over every reference size, on replicated plans.

Two sizes and two unknowns let a noisy pair trade the throughput factor for a per-op cost, and
the sharded plan the fit used carried its chunks' own work into both: GPT-2 steps were priced
20-30% over their measured time in the regret grid."""

import dataclasses
import random

import pytest

from elixir.hardware import load_profile
from elixir.plan import Sharding
from elixir.profiling.calibrate import SIZES, _fit_compute, _reference_runs


def _rows(a: float, b: float, noise: list[float]) -> list[tuple[float, float, float]]:
    """Runs of the reference sizes' shape (throughput seconds and ops growing apart), measured as
    ``a * t + b * o`` times ``1 + noise``."""
    pts = [(0.004, 317), (0.012, 905), (0.03, 317), (0.15, 317)]
    return [(t, o, (a * t + b * o) * (1 + e)) for (t, o), e in zip(pts, noise)]


def test_the_fit_recovers_both_terms_from_exact_runs():
    rng = random.Random(0)
    for _ in range(20):
        a, b = rng.uniform(0.5, 2.0), rng.uniform(1e-6, 1e-4)
        fa, fb = _fit_compute(_rows(a, b, [0.0] * 4))
        assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)


def test_one_noisy_run_moves_the_fit_less_than_it_moves_a_two_run_solve():
    a, b = 0.9, 2e-5
    rows = _rows(a, b, [0.3, 0.0, 0.0, 0.0])  # the smallest size 30% slow (a neighbour's load)
    (t1, o1, m1), (t2, o2, m2) = rows[0], rows[-1]  # the former fit: the smallest and the largest alone
    det = t1 * o2 - t2 * o1
    two_b = (t1 * m2 - t2 * m1) / det
    fa, fb = _fit_compute(rows)
    assert abs(fb - b) < abs(two_b - b)
    assert abs(fa - a) / a < 0.1


def test_the_fit_never_returns_a_negative_term():
    # runs where the unconstrained fit's per-op cost comes out negative: the larger size slower per
    # unit of throughput than the smaller ones explain
    rows = [(0.004, 317, 0.003), (0.012, 905, 0.009), (0.15, 317, 0.2)]
    fa, fb = _fit_compute(rows)
    assert fa > 0 and fb >= 0
    w = [t / m for t, _, m in rows]  # the throughput-only least-squares fit of the same residuals
    assert fb == 0.0 and fa == pytest.approx(sum(w) / sum(x * x for x in w))


def test_the_reference_sizes_tell_ops_from_throughput():
    # every size of one layer count dispatches the same ops: some size must differ in layers
    assert len({s[3] for s in SIZES}) > 1
    assert len({(s[0], s[2]) for s in SIZES}) > 1
    assert max(SIZES, key=lambda s: s[0] * s[0] * s[2]) == SIZES[-1]  # the largest last


def test_the_compute_runs_are_replicated_and_the_collective_run_sharded():
    hw = dataclasses.replace(load_profile("cpu-box"), calibration={}, cores=2)
    runs, preds, chunk = _reference_runs(hw, 2)
    assert len(runs) == len(SIZES) + 2
    for _size, plan, _dtype, mode in runs[:-1]:  # the compute fit and the bf16 run
        assert mode == "replicated" and {c["sharding"] for c in plan["chunks"]} == {Sharding.REPLICATED.value}
        assert plan["cache_blocks"] == 0
    assert runs[len(SIZES)][2] == "bfloat16" and runs[len(SIZES)][0] == SIZES[-1]
    size, plan, dtype, mode = runs[-1]
    assert size == SIZES[-1] and dtype == "float32" and mode == "pair"  # with prefetch too
    assert any(c["sharding"] == Sharding.SHARDED.value for c in plan["chunks"]) and chunk > 0
    # the replicated compute runs pay no gathers; the sharded run does
    assert all(p["all_gather"] == 0 for p in preds[:-1]) and preds[-1]["all_gather"] > 0
    # the layer counts change the ops at one width and sequence
    same = [p["ops"] for (s, *_), p in zip(runs, preds) if (s[0], s[2]) == (SIZES[0][0], SIZES[0][2])]
    assert len(set(same)) > 1
