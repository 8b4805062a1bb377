"""bench/search_regret.py: the alternatives it times are real, differ from the search's plan, and
the regret and prediction error are computed as the issue defines them."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _bench():
    spec = importlib.util.spec_from_file_location("search_regret", os.path.join(HERE, "..", "bench", "search_regret.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["search_regret"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_alternatives_are_distinct_plans_of_the_same_model():
    from elixir.hardware import load_profile

    b = _bench()
    hw = load_profile("cpu-box")
    found = b.candidate_plans(b.Workload("t", 64, 2, 512, 1, 16, budget_gib=0.02), 2, hw)
    plans = found["plans"]
    assert {"search", "zero3", "zero12", "min-waste"} <= set(plans)
    chosen = plans["search"]
    names = set(chosen.param_names)
    for name, p in plans.items():
        if isinstance(p, str):
            assert p.startswith(("does not fit", "same as ")), (name, p)
            continue
        assert set(p.param_names) == names, name
        if name != "search":
            assert not b._same_plan(p, chosen), name
        t, peak, host, disk = b.predicted(p, found["profile"], 2, hw)
        assert t > 0 and peak > 0 and host >= 0 and disk >= 0


def test_an_alternative_over_the_host_budget_is_not_a_rival():
    """On a CPU box device and host share the host budget: an alternative that fits the device
    budget but not the pool (the 124M-disk grid's 'tier-up', disk chunks moved to host) is not timed."""
    from elixir.hardware import load_profile
    from elixir.plan.budgets import MemoryPolicy

    b = _bench()
    hw = load_profile("cpu-box")
    gib = 2**30
    budgets = {"device_memory": 2 * gib, "host_memory": 2 * gib, "disk": 4 * gib}
    dev, host, _ = MemoryPolicy().usable(2 * gib, 2 * gib, 4 * gib)
    assert b.over_budget((1.0, dev // 2, dev // 2 - 1, 0), budgets, hw) is None
    assert "host" in b.over_budget((1.0, dev // 2, host - dev // 2 + 1, 0), budgets, hw)
    assert "device" in b.over_budget((1.0, dev + 1, 0, 0), budgets, hw)
    assert "disk" in b.over_budget((1.0, 1, 1, 4 * gib), budgets, hw)


def test_regret_ties_inside_the_spread_and_prediction_error_sign():
    b = _bench()
    mine = {"plan": "search", "status": "ok", "median_s": 1.05, "spread_s": 0.1, "predicted_s": 0.84}
    other = {"plan": "zero3", "status": "ok", "median_s": 1.0, "spread_s": 0.02}
    assert b.score([mine, other]) == {"regret": 1.0, "best_plan": "zero3", "prediction_error": pytest.approx(0.2)}
    slow = dict(mine, median_s=1.3, predicted_s=1.56)
    assert b.score([slow, other]) == {"regret": pytest.approx(1.3), "best_plan": "zero3", "prediction_error": pytest.approx(-0.2)}
    assert b.score([dict(mine, status="failed: x"), other])["regret"] is None
    s = b.summary([{"regret": 1.0, "prediction_error": 0.2}, {"regret": 1.3, "prediction_error": -0.1},
                   {"regret": None, "prediction_error": None}])
    assert s == {"median_regret": 1.15, "worst_regret": 1.3, "median_abs_prediction_error": 0.15000000000000002,
                 "worst_abs_prediction_error": 0.2}


@pytest.mark.slow
def test_smoke_run_writes_the_json_the_issue_names(tmp_path):
    import json
    import subprocess

    out = tmp_path / "regret.json"
    subprocess.run([sys.executable, os.path.join(HERE, "..", "bench", "search_regret.py"), "--smoke", "--json", str(out)],
                   check=True, timeout=900)
    res = json.loads(out.read_text())
    (w,) = res["workloads"]
    assert w["name"] == "smoke" and w["regret"] >= 1.0 and isinstance(w["prediction_error"], float)
    assert sum(p["status"] == "ok" for p in w["plans"]) >= 2
