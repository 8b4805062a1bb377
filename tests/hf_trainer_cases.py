"""What the HF Trainer tests share: a learnable toy dataset, and a two-rank torchrun job whose
per-rank results come back as ``result_{rank}.pt`` files."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def progressions(n: int, seq: int, vocab: int = 128) -> list[dict]:
    """Arithmetic progressions mod ``vocab`` (random start and stride): learnable, so the loss falls."""
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % vocab
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def run_job(script: str, out: str) -> list:
    """Run ``tests/<script>`` on two local ranks writing into ``out``; each rank's result."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(ROOT, "tests", script), out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(os.path.join(out, f"result_{r}.pt"), weights_only=False) for r in range(2)]
