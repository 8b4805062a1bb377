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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("elixir_gpu_bench", os.path.join(ROOT, "bench", "gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_stops_at_the_first_cuda_step_without_a_gpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, ELIXIR_GPU_CHECK_INSTALL="0", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "out"
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "NO GPU" in r.stdout and "did not run" in r.stdout
    assert "would run: " in r.stdout and "pip install --no-deps --no-build-isolation -e ." in r.stdout
    env_txt = (out / "env.txt").read_text()
    assert "torch" in env_txt and "available False" in env_txt and "elixir" in env_txt
    assert "NO GPU" in (out / "summary.txt").read_text()
    assert not (out / "cuda_tests.log").exists() and not (out / "gpu_bench.json").exists()


def test_script_refuses_bad_usage(tmp_path):
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(tmp_path), "everything"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2


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
def test_script_rehearsal_on_cpu_runs_every_step(tmp_path):
    """ELIXIR_GPU_CHECK_ALLOW_CPU=1: the whole script past the GPU check, the cuda tests (all
    skipped here) and the bench's hw, adam and step parts at tiny sizes (about 4 minutes on 2 cores)."""
    env = dict(os.environ, PYTHON=sys.executable, ELIXIR_GPU_CHECK_INSTALL="0", ELIXIR_GPU_CHECK_ALLOW_CPU="1",
               CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "cuda_tests.xml").exists() and "cuda tests: passed" in r.stdout
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert res["hw"]["status"] == "ok" and res["adam"]["status"] == "ok"
    assert [s["status"] for s in res["step"]] == ["ok"] * 4, res["step"]
    assert res["finished"] and "## Step time" in (tmp_path / "gpu_bench.md").read_text()
