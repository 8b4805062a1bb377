"""Restart from the last good checkpoint (issue 18 item 2): ``example/train_gpt.py --resume auto``
under ``torchrun --max-restarts 1`` at world size 2 on a tiny GPT-2; rank 1 is SIGKILLed right
after the first checkpoint appears; the restarted run resumes from the newest complete checkpoint
and ends with the same fp32 parameters as an uninterrupted run, bit for bit. Slow (three torchrun
launches, about a minute): run with ``-m slow``."""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import load_file

from elixir.testing.restarts import TaggedRun, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "example", "train_gpt.py")
TINY = ["--steps", "30", "--layers", "2", "--width", "64", "--seq", "32", "--batch", "2"]


@pytest.mark.slow
def test_killed_rank_restarts_from_the_last_checkpoint_bit_for_bit(tmp_path):
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ref = TaggedRun(torchrun(SCRIPT, [*TINY, "--out", str(tmp_path / "ref.safetensors")], 2), env,
                    log=str(tmp_path / "ref.log")).start()
    assert ref.wait(300) == 0, ref.output()

    ckpt = tmp_path / "ckpt"
    args = [*TINY, "--ckpt", str(ckpt), "--save-every", "5", "--resume", "auto", "--out", str(tmp_path / "got.safetensors")]
    run = TaggedRun(torchrun(SCRIPT, args, 2, max_restarts=1), env, log=str(tmp_path / "run.log")).start()
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "step-00000005").exists():  # committed atomically: complete once named
            assert run.proc.poll() is None and time.monotonic() < deadline, run.output()
            time.sleep(0.01)
        killed_at = time.monotonic()
        assert run.kill(1) is not None, "rank 1 was not running"
        rc = run.wait(300)
    finally:
        run.stop()
    out = run.output()
    assert rc == 0, out
    assert "resumed from" in out and (tmp_path / "got.safetensors").exists(), out
    resumed = out[out.index("resumed from"):].split("\n")[0]
    ref_w, got_w = load_file(str(tmp_path / "ref.safetensors")), load_file(str(tmp_path / "got.safetensors"))
    assert ref_w.keys() == got_w.keys()
    diff = [k for k in ref_w if not torch.equal(ref_w[k], got_w[k])]
    assert not diff, diff
    print(f"restart: rank 1 killed once step 5's checkpoint existed; {resumed}; the run ended "
          f"{time.monotonic() - killed_at:.1f} s after the kill")


def test_latest_skips_a_damaged_checkpoint(tmp_path):
    """``--resume auto`` picks the newest checkpoint that verifies; a damaged newer one is skipped
    with a warning naming it."""
    from elixir import checkpoint
    from elixir.search import minimum_waste_search
    from elixir.testing.reference import default_optimizer
    from elixir.testing.zoo import ZOO
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    torch.manual_seed(0)
    model = ZOO["gpt2"].build()
    em = ElixirModule(model, minimum_waste_search(model, 1))
    eo = ElixirOptimizer(em, default_optimizer(list(em.parameters())))
    assert checkpoint.latest(str(tmp_path)) is None
    for step in (5, 10):
        checkpoint.save(checkpoint.step_path(str(tmp_path), step), em, eo, extra={"step": step})
    assert checkpoint.latest(str(tmp_path)) == checkpoint.step_path(str(tmp_path), 10)
    shard = next(p for p in (tmp_path / "step-00000010").iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000010.*damaged"):
        good = checkpoint.latest(str(tmp_path))
    assert good == checkpoint.step_path(str(tmp_path), 5)
    assert checkpoint.load(good, em, eo) == {"step": 5}
