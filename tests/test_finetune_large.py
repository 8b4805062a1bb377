"""example/finetune_large.py at a tiny size: --make-checkpoint writes a bf16 HF checkpoint in
several files from a meta-built model, and fine-tuning from it (built on meta, planned with
optimal_search, load_pretrained) gives falling losses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "example", "finetune_large.py")


def _run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_make_checkpoint_then_finetune(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    print(_run("--make-checkpoint", ckpt, "--hidden", "128", "--layers", "2", "--shard-size", "200KB"))
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) >= 3
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    out = _run(ckpt, "--steps", "6", "--seq", "64", "--lr", "3e-3", "--offload-dir", str(tmp_path / "off"))
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses
