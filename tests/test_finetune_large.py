"""example/finetune_large.py at a tiny size: --make-checkpoint writes a bf16 HF checkpoint in
several files from a meta-built model; fine-tuning from it (built on meta, planned with
optimal_search, load_pretrained) gives falling losses, every weight trained or (--lora) only
PEFT adapters over a frozen base that the plan streams from disk.

The two checkpoint builds run at once, then the two fine-tuning runs (tests/at_once.py); each test
checks its own run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.at_once import run_at_once

pytestmark = pytest.mark.dist  # every test runs the example in its own process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "example", "finetune_large.py")
STEP = re.compile(r"^step (\d+): loss (\S+)")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return env


def _stdout(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _losses(out: str) -> list[float]:
    return [float(m.group(2)) for m in map(STEP.match, out.splitlines()) if m]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The checkpoint the runs below fine-tune, and the same one built with --stage-on-disk:
    both builds at once (tests/at_once.py)."""
    tmp = tmp_path_factory.mktemp("finetune_large")
    (tmp / "off").mkdir()
    # big enough that the frozen bf16 base (14 MB) is well above the search's resolution (0.4% of the
    # budget), so the least memory that fits (--host-memory min) puts it on disk
    make = ["--hidden", "384", "--layers", "4", "--shard-size", "2MB"]
    done = run_at_once({
        "ram": [sys.executable, SCRIPT, "--make-checkpoint", str(tmp / "ckpt"), *make],
        "staged": [sys.executable, SCRIPT, "--make-checkpoint", str(tmp / "staged"), *make, "--stage-on-disk",
                   "--offload-dir", str(tmp / "off")],
    }, timeout=300, env=_env())
    return {"ckpt": str(tmp / "ckpt"), "made": done["ram"], "staged": str(tmp / "staged"), "staged_run": done["staged"],
            "staged_off": tmp / "off"}


@pytest.fixture(scope="module")
def ckpt(built) -> str:
    print(_stdout(built["made"]))
    return built["ckpt"]


@pytest.fixture(scope="module")
def trained(ckpt, tmp_path_factory) -> dict:
    """The fine-tuning runs of the checkpoint, started at once: per run, its folder and process."""
    tmp = {name: tmp_path_factory.mktemp(name) for name in ("finetune", "lora")}
    cmds = {"finetune": [sys.executable, SCRIPT, ckpt, "--steps", "6", "--seq", "64", "--lr", "3e-3", "--offload-dir",
                         str(tmp["finetune"] / "off")]}
    if importlib.util.find_spec("peft") is not None:
        cmds["lora"] = [sys.executable, "-c", _LORA, os.path.join(ROOT, "example"), ckpt, str(tmp["lora"])]
    done = run_at_once(cmds, timeout=300, env=_env())
    return {name: (tmp[name], p) for name, p in done.items()}


def test_make_checkpoint_then_finetune(ckpt, trained):
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) >= 3
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    out = _stdout(trained["finetune"][1])
    losses = _losses(out)
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses


def test_make_checkpoint_staged_on_disk_equals_the_one_built_in_ram(ckpt, built):
    """--stage-on-disk (what a model whose bf16 shards exceed the RAM gets) writes the same
    tensors as the build in RAM, and leaves no offload file behind."""
    from safetensors.torch import load_file

    path, off = built["staged"], built["staged_off"]
    out = _stdout(built["staged_run"])
    assert "staged on disk" in out, out
    assert not any(off.iterdir()), list(off.iterdir())

    def tensors(d):
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            files = set(json.load(f)["weight_map"].values())
        return {k: v for name in files for k, v in load_file(os.path.join(d, name)).items()}

    a, b = tensors(ckpt), tensors(path)
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].equal(b[k]), k


# Two LoRA runs in one process: the frozen base on disk (--host-memory min) and in RAM (the
# default budget). Prints one JSON line for the test to check.
_LORA = r"""
import json, sys
import torch
from safetensors import safe_open
sys.path.insert(0, sys.argv[1])
import finetune_large as fl
from elixir.search import Placement

ckpt, tmp = sys.argv[2], sys.argv[3]
common = [ckpt, "--lora", "4", "--steps", "4", "--seq", "64", "--lr", "1e-2"]
disk = fl.finetune(fl.parse_args(common + ["--host-memory", "min", "--offload-dir", tmp + "/off-disk",
                                            "--save", tmp + "/adapters"]))
ram = fl.finetune(fl.parse_args(common + ["--offload-dir", tmp + "/off-ram"]))

# the frozen weights after training, against the checkpoint's tensors, bit for bit
with open(ckpt + "/model.safetensors.index.json") as f:
    weight_map = json.load(f)["weight_map"]
sd = disk.module.state_dict()
frozen = {k: v for k, v in sd.items() if "lora_" not in k}
unchanged, compared = True, 0
for key, value in frozen.items():
    name = key.removeprefix("base_model.model.").replace(".base_layer", "")
    if name not in weight_map:
        continue
    with safe_open(ckpt + "/" + weight_map[name], "pt") as f:
        ref = f.get_tensor(name)
    unchanged &= torch.equal(value, ref.to(value.dtype))
    compared += 1
# the most a step may write for the adapters the plan put on disk: master and Adam state, shard
trainable_disk = sum(c.chunk_size * (12 * (c.optim_placement is Placement.DISK) + 2 * (c.shard_placement is Placement.DISK))
                     for c in disk.plan.chunks)
print(json.dumps({
    "disk_losses": disk.losses, "ram_losses": ram.losses,
    "disk_frozen": sorted({c.shard_placement.value for c in disk.plan.frozen_chunks}),
    "ram_frozen": sorted({c.shard_placement.value for c in ram.plan.frozen_chunks}),
    "frozen_resident": disk.module.memory_report()["frozen_shard_bytes"],
    "frozen_shard_bytes": sum(c.shard_size(1) * 2 for c in disk.plan.frozen_chunks),
    "trainable_disk_bytes": trainable_disk,
    "step_io": disk.step_io, "load_io": disk.load_io, "ram_step_io": ram.step_io,
    "unchanged": bool(unchanged), "compared": compared, "n_weights": len(weight_map),
}))
"""


def test_lora_frozen_base_streams_from_disk(trained):
    """--lora with --host-memory min: the plan puts the frozen base on disk; losses fall and
    equal, bit for bit, those of the same run with the base in RAM; the frozen weights are the
    checkpoint's, unchanged by training; each step reads the frozen shards from disk and writes
    none of them back; the adapters are saved alone."""
    pytest.importorskip("peft")
    tmp_path, proc = trained["lora"]
    out = _stdout(proc)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["disk_frozen"] == ["disk"] and got["ram_frozen"] != ["disk"], got
    assert got["frozen_resident"] == 0, got
    losses = got["disk_losses"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert got["disk_losses"] == got["ram_losses"], got
    assert got["unchanged"] and got["compared"] == got["n_weights"], got
    # loading wrote every frozen shard once; each step read them back (forward and backward)
    assert got["load_io"][1] >= got["frozen_shard_bytes"], got
    assert all(r >= got["frozen_shard_bytes"] for r, _ in got["step_io"]), got
    # and writes at most the adapters' disk state: no frozen shard is written back
    assert got["trainable_disk_bytes"] < got["frozen_shard_bytes"], got
    assert all(w <= got["trainable_disk_bytes"] for _, w in got["step_io"]), got
    assert all(r == w == 0 for r, w in got["ram_step_io"]), got
    adapters = tmp_path / "adapters"
    assert (adapters / "index.json").is_file()
    saved = sum(f.stat().st_size for f in adapters.rglob("*") if f.is_file())
    assert saved < got["frozen_shard_bytes"], (saved, got)  # the adapters and their state, not the base
    assert "frozen chunks" in out and "predicted per rank" in out
