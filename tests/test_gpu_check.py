"""scripts/gpu_check.sh and bench/gpu.py on a machine without a GPU: the script runs up to the
first CUDA step and stops there with exit code 3 and a clear message; the bench's model builder,
parameter count and report work (the whole bench at tiny sizes on CPU is the slow smoke test)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.at_once import run_at_once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("elixir_gpu_bench", os.path.join(ROOT, "bench", "gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _script(*args, env=None, timeout=120):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


MODES = {"main": [], "bench": ["bench"]}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict:
    """Both modes of the script on this GPU-less machine, run at once (each is a few interpreter
    starts in a row): per mode, its output folder and the finished process."""
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    env.pop("ELIXIR_GPU_CHECK_ALLOW_CPU", None)
    outs = {mode: tmp_path_factory.mktemp(f"gpu_check_{mode}") / "out" for mode in MODES}
    script = os.path.join(ROOT, "scripts", "gpu_check.sh")
    done = run_at_once({mode: ["bash", script, str(outs[mode]), *args] for mode, args in MODES.items()}, timeout=120,
                       env=env)
    return {mode: (outs[mode], done[mode]) for mode in MODES}


@pytest.mark.dist  # starts processes
@pytest.mark.parametrize("mode", list(MODES))
def test_script_stops_at_the_first_cuda_step_without_a_gpu(stopped, mode):
    out, r = stopped[mode]
    assert r.returncode == 3, r.stdout + r.stderr
    assert "NO GPU" in r.stdout and "did not run" in r.stdout
    env_txt = (out / "env.txt").read_text()
    assert "torch" in env_txt and "available False" in env_txt and "elixir" in env_txt
    assert "NO GPU" in (out / "summary.txt").read_text()
    for later in ("probe.txt", "smoke.jsonl", "cuda_tests.log", "gpu_bench.json", "gpu_bench_step.json"):
        assert not (out / later).exists(), later


@pytest.mark.dist  # starts processes
def test_script_refuses_bad_usage(tmp_path):
    r = _script(timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr
    assert _script(str(tmp_path), "everything", timeout=30).returncode == 2


@pytest.mark.dist  # starts processes
def test_each_mode_is_planned_within_six_minutes():
    r = _script("--print-budget", timeout=30)
    assert r.returncode == 0, r.stderr
    steps: dict = {}
    totals = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if parts[1] == "total":
            totals[parts[0]] = int(parts[2])
        else:
            steps.setdefault(parts[0], []).append((parts[1], int(parts[2])))
    assert set(totals) == {"main", "bench"}
    for mode, total in totals.items():
        assert total == sum(s for _, s in steps[mode]) and total <= 360, (mode, total)
    assert [n for n, _ in steps["main"]] == ["env", "smoke", "tests", "ckpt", "adam", "slack"]


def test_bench_picks_the_systems_and_the_capacity_rung(tmp_path, monkeypatch):
    bench = _bench()
    ran = []
    monkeypatch.setattr(bench.Bench, "trial", lambda self, spec, timeout: ran.append(spec) or {"status": "ok", "system": spec["system"], "size": spec["size"]})
    bench.main(["--out", str(tmp_path), "--parts", "step", "--systems", "elixir", "fsdp2-offload", "--size", "0.7B"])
    assert [(s["system"], s["size"]) for s in ran] == [("elixir", "0.7B"), ("fsdp2-offload", "0.7B")]
    ran.clear()
    bench.main(["--out", str(tmp_path), "--parts", "capacity", "--cap-sizes", "plain=1.1B", "elixir=6.7B",
                "--systems", "plain", "elixir"])
    assert [(s["system"], s["size"]) for s in ran] == [("plain", "1.1B"), ("elixir", "6.7B")]
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--cap-sizes", "elixir=12B"])


@pytest.mark.dist  # starts processes
def test_smoke_rehearses_every_case_against_plain_torch_on_cpu(tmp_path):
    """scripts/gpu_smoke.py --allow-cpu: every case (GPT-2 and LLaMA, HH/DH/HK/DD, fused_step on and
    off, the gathering plan) and the sanitizer reruns, each compared with plain torch."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_smoke.py"), "--out", str(tmp_path), "--allow-cpu"],
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "smoke.jsonl").read_text().splitlines()]
    cases = [x for x in lines if "case" in x]
    spec = importlib.util.spec_from_file_location("gpu_smoke", os.path.join(ROOT, "scripts", "gpu_smoke.py"))
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    assert [c["case"] for c in cases] == [c[0] for c in smoke.all_cases()]
    for c in cases:
        assert c["status"] == "ok", c
        assert len(c["losses"]) == len(c["ref_losses"]) == smoke.STEPS and c["masters_compared"] > 0
        assert c["max_loss_rel_diff"] <= smoke.LOSS_RTOL and c["max_master_diff"] <= smoke.MASTER_ATOL
        assert c["fused_step_active"] == c["fused_step"]
        for key in ("max_memory_allocated", "max_memory_reserved", "ledger_peak_device_bytes", "rss_bytes",
                    "predicted_peak_device_bytes"):
            assert key in c, key
        if c["placement"][0] in "HK":
            assert c["gathers"] > 0, c["case"]
    assert lines[-1]["summary"]["failed"] == [] and lines[-1]["summary"]["cases"] == len(cases) + len(smoke.SANITIZED)
    sanitized = [json.loads(x) for x in (tmp_path / "smoke_sanitizer.jsonl").read_text().splitlines() if '"case"' in x]
    assert sorted(c["case"] for c in sanitized) == sorted(smoke.SANITIZED) and all(c["status"] == "ok" for c in sanitized)


def test_bench_model_builder_counts_and_buffers():
    bench = _bench()
    from transformers import LlamaForCausalLM

    for size in ("tiny", "tiny2"):
        model = bench.build_model(size, 32, "cpu")
        assert sum(p.numel() for p in model.parameters()) == bench.param_count(size)
        torch.manual_seed(0)
        ref = LlamaForCausalLM(bench.llama_config(size, 32))  # built the ordinary way
        ours = dict(model.named_buffers())
        for name, b in ref.named_buffers():
            assert torch.equal(ours[name], b), name
        ids = torch.randint(0, 256, (2, 32))
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    # the real sizes are what their names say (within 10%)
    for name in ("0.7B", "1.1B", "2.0B", "3.4B", "4.9B", "6.7B", "9.0B"):
        assert abs(bench.param_count(name) / (float(name[:-1]) * 1e9) - 1) < 0.1, name


def test_bench_report_renders_partial_and_failed_results():
    bench = _bench()
    args = {"size": "1.1B", "batch": 8, "seq": 1024, "cap_gib": 24.0, "cap_batch": 1, "cap_seq": 512, "hardware": None}
    r = {
        "started": "now", "args": args, "device": "NVIDIA H100", "notes": ["a note"],
        "hw": {"status": "ok", "h2d_pinned_GBps": 50.0, "h2d_pageable_GBps": 20.0, "adam_device_Mparams_per_s": 9000.0,
               "adam_host_Mparams_per_s": 900.0, "profile": "/x/hw.json"},
        "step": [
            {"system": "elixir", "size": "1.1B", "status": "ok", "step_s": 0.21, "peak_device_bytes": 30 << 30,
             "predicted_peak_device_bytes": 32 << 30, "predicted_step_s": 0.2},
            {"system": "plain", "size": "1.1B", "status": "ok", "step_s": 0.2, "peak_device_bytes": 28 << 30},
            {"system": "fsdp2", "size": "1.1B", "status": "timeout"},
            {"system": "elixir-host", "size": "1.1B", "status": "skipped: out of time"},
        ],
        "capacity": [
            {"system": "plain", "size": "1.1B", "status": "ok"}, {"system": "plain", "size": "2.0B", "status": "oom"},
            {"system": "elixir", "size": "2.0B", "status": "ok", "step_times": [3.0, 1.0, 1.1],
             "predicted_peak_device_bytes": 20 << 30, "predicted_step_s": 1.0, "cap_bytes": 24 << 30},
        ],
        "capacity_best": {"plain": ["1.1B", bench.param_count("1.1B")], "elixir": ["2.0B", bench.param_count("2.0B")],
                          "fsdp2-offload": [None, 0]},
    }
    md = bench.render_markdown(json.loads(json.dumps(r)))
    assert "| elixir | 0.210 | 30.00 |" in md and "1.05x" in md
    assert "| fsdp2 | - | - | - | - | timeout |" in md
    ratio = bench.param_count("2.0B") / bench.param_count("1.1B")
    assert "2.0B: ok" in md and "2.0B: oom" in md and f"elixir / plain = {ratio:.2f}x" in md
    assert "+7%" in md  # predicted 32 GiB against 30 measured
    assert "(partial" in md


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["main", "bench"])
def test_script_rehearsal_on_cpu_runs_every_step_within_six_minutes(tmp_path, mode):
    """ELIXIR_GPU_CHECK_ALLOW_CPU=1: every step of the mode on CPU (CUDA tests skipped, tiny bench)."""
    env = dict(os.environ, PYTHON=sys.executable, ELIXIR_GPU_CHECK_ALLOW_CPU="1", CUDA_VISIBLE_DEVICES="")
    r = _script(str(tmp_path), mode, env=env, timeout=420)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "TIMED OUT" not in summary and "FAILED" not in summary and "SKIPPED" not in summary, summary
    seconds = int(summary.rsplit("done in ", 1)[1].split("s", 1)[0])
    assert seconds <= 360, summary
    if mode == "main":
        assert (tmp_path / "cuda_tests.xml").exists() and (tmp_path / "ckpt_tests.xml").exists()
        assert json.loads((tmp_path / "smoke.jsonl").read_text().splitlines()[-1])["summary"]["failed"] == []
        assert json.loads((tmp_path / "gpu_bench.json").read_text())["adam"]["status"] == "ok"
    else:
        step = json.loads((tmp_path / "gpu_bench_step.json").read_text())["step"]
        assert [s["system"] for s in step] == ["elixir", "plain", "fsdp2", "fsdp2-offload"]
        assert all(s["status"] == "ok" for s in step), step
        cap = json.loads((tmp_path / "gpu_bench_capacity.json").read_text())["capacity"]
        assert sorted(c["system"] for c in cap) == ["elixir", "fsdp2-offload", "plain"]
