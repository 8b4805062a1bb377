"""`elixir demo`: flags survive the torchrun relaunch, and a tiny run trains on 2 ranks.

The two demo runs (a tiny training and a budget that fits nothing) start at once (``demos``)."""

import json
import math
import os
import sys

import pytest

from elixir import cli
from elixir.demo import PRESETS, DemoConfig, _param_count, build_gpt, config_from_args, lr_lambda, worker_argv
from tests.at_once import run_at_once


def _parse(argv):
    parser = cli.build_parser()
    import argparse
    import importlib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    importlib.import_module("elixir.demo").add_arguments(sub.choices["demo"])
    return parser.parse_args(argv)


def test_worker_argv_round_trips_every_flag():
    cfg = DemoConfig(preset="tiny", steps=7, batch=3, seq=32, world_size=3, dtype="bf16", lr=1e-4, warmup=2,
                     seed=5, eval_batches=2, corpus_bytes=12345, threads=1, budget_mib=12.5, json_path="/tmp/x.json")
    args = _parse(worker_argv(cfg))
    assert args.worker
    assert config_from_args(args) == cfg
    assert config_from_args(_parse(worker_argv(DemoConfig()))) == DemoConfig()


def test_presets_match_their_models():
    import torch

    for name in PRESETS:
        with torch.device("meta"):
            model = build_gpt(name, 128)
        assert sum(p.numel() for p in model.parameters()) == _param_count(name, 128), name
    assert 10e6 <= _param_count("small") <= 100e6  # the default is "tens of millions"


def test_lr_schedule_warms_up_then_decays():
    f = lr_lambda(DemoConfig(steps=100, warmup=10))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(99) < 0.2 and f(99) >= 0.1
    assert all(f(i) >= f(i + 1) for i in range(10, 99))


def _binding_budget_mib(batch: int, seq: int) -> float:
    """A per-rank device budget just above the least any plan of the tiny demo fits in, far below
    what its fastest (fully replicated) plan needs: the search has to shard."""
    import torch

    from elixir.demo import _trace_step
    from elixir.search import DoesNotFitError, optimal_search

    model = build_gpt("tiny", seq)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    kw = dict(unified_dtype=torch.bfloat16, overlap=True, inp={"input_ids": ids, "labels": ids}, step_fn=_trace_step,
              process_bytes=0)  # as the demo plans: --budget-mib is the model's and the runtime's memory
    free = optimal_search(model, 2, **kw)
    assert not any(c.sharded for c in free.chunks)
    with pytest.raises(DoesNotFitError) as e:
        optimal_search(model, 2, device_memory=1, host_memory=1, **kw)
    least = e.value.needs.get("memory") or e.value.needs["device_memory"]  # one pool on a CPU profile
    assert least < free.prediction.peak_device_bytes
    return 1.02 * least / 2**20


def test_search_flags_are_checked():
    with pytest.raises(SystemExit, match="only with --search optimal"):
        config_from_args(_parse(["demo", "--search", "minimum_waste", "--budget-mib", "5"]))
    assert config_from_args(_parse(["demo", "--search", "minimum_waste"])).search == "minimum_waste"
    assert DemoConfig().search == "optimal"


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> dict:
    """Per demo run, its finished process; both start at once (``tiny`` writes ``json``)."""
    out = tmp_path_factory.mktemp("demo") / "demo.json"
    demo = [sys.executable, "-m", "elixir", "demo", "--preset", "tiny", "--world-size", "2", "--batch", "8", "--seq", "64",
            "--corpus-bytes", "1000000"]
    tiny = [*demo, "--steps", "30", "--budget-mib", f"{_binding_budget_mib(8, 64):.3f}", "--json", str(out)]
    nothing = [*demo, "--steps", "2", "--budget-mib", "0.01"]
    # the terminal widths each test was written for: the tiny run's tables, the message's lines
    envs = {"tiny": dict(os.environ, COLUMNS="120"), "nothing": dict(os.environ, COLUMNS="200")}
    done = run_at_once({"tiny": tiny, "nothing": nothing}, timeout=120, envs=envs)
    return {**done, "json": out}


@pytest.mark.dist
def test_tiny_demo_trains_on_two_ranks(demos):
    out, proc = demos["json"], demos["tiny"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    s = json.loads(out.read_text())
    assert s["world_size"] == 2 and len(s["losses"]) == 30
    assert s["val_loss_before"] > math.log(256) - 0.5
    assert s["val_loss_after"] < s["val_loss_before"] - 0.8, s
    assert sum(s["losses"][-5:]) / 5 < sum(s["losses"][:5]) / 5 - 0.8
    # both ranks report the runtime's accounting: exactly the plan's parameters per rank (its
    # shards of sharded chunks, and whole ZeRO-1/2 and replicated chunks, padding included)
    mem = s["memory"]
    assert len(mem) == 2 and all(m["peak_rss"] > 0 for m in mem)
    assert mem[0]["shard"] == mem[1]["shard"]
    elem = 2 if s["config"]["dtype"] == "bf16" else 4
    assert mem[0]["shard"] == elem * s["plan"]["param_elements_per_rank"], s["plan"]
    assert 0 < mem[0]["peak_gathered"] <= mem[0]["cache"]
    # only rank 0 prints: the summary appears once, with the plan and the memory table
    assert proc.stdout.count("summary") == 1, proc.stdout
    assert "elixir optimal plan" in proc.stdout and "memory per rank" in proc.stdout
    assert "FALLBACK" not in proc.stdout
    # the search explains its plan and is held to its predictions
    assert s["plan"]["search"] == "optimal" and s["plan"]["sharded"] > 0
    assert "why: memory binds" in proc.stdout and "chunks of the plan" in proc.stdout
    assert "predicted by the search vs measured" in proc.stdout
    assert s["predicted_step_s"] > 0 and s["measured_step_s"] > 0
    assert 0.5 < mem[0]["device_peak"] / s["predicted_runtime_bytes"] < 1.5, s


@pytest.mark.dist
def test_budget_that_fits_nothing_prints_the_message_once_without_a_traceback(demos):
    """Before: every rank printed a 40-line DoesNotFitError traceback, then torchrun its own report.
    Now rank 0 prints the search's message and suggestions as `elixir plan` does; exit status 1."""
    proc = demos["nothing"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both and "ChildFailedError" not in both, both[-3000:]
    assert proc.stdout.count("no plan fits") == 1, proc.stdout[-3000:]  # rank 0 only
    assert "summary" not in proc.stdout
