"""elixir.checkpoint: exact resume in new processes, resharding 2 -> 1 and 2 -> 4, full
HF-compatible checkpoints, crash safety under SIGKILL, and clear errors on bad input with nothing
modified. Spawned runs: one world-2 run trains 6 steps and saves at step 3, a second world-2 run
(new processes) loads and trains 3 more, a world-4 run reshards; the rest runs in-process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from elixir import checkpoint
from elixir import distributed as edist
from elixir.checkpoint import CheckpointError
from elixir.checkpoint.checksum import file_checksum
from elixir.testing import run_distributed
from elixir.testing.zoo import build_model
from tests.checkpoint_cases import (
    MODEL,
    bitwise_diff,
    chunk_and_optimizer_state,
    expect_error,
    make,
    snapshot,
    train,
)

# --------------------------------------------------------------------------------------------
# exact resume and resharding


def _train_and_save(root: str, names: tuple) -> dict:
    out = {}
    for name in names:
        em, opt = make(2, name, groups=True)
        train(em, opt, range(3), name)
        checkpoint.save(os.path.join(root, name, "sharded"), em, opt, extra={"step": 3, "note": "hi"})
        checkpoint.save(os.path.join(root, name, "full"), em, opt, shard=False)
        at3 = snapshot(em, opt)
        train(em, opt, range(3, 6), name)
        out[name] = {"at3": at3, "at6": snapshot(em, opt)}
    return out


def _load_and_train(root: str, name: str, kinds: tuple) -> dict:
    out = {}
    world = edist.get_world_size()
    for kind in kinds:
        em, opt = make(world, name, groups=True)
        path = os.path.join(root, name, kind)
        extra = checkpoint.load(path, em, opt)
        loaded = snapshot(em, opt)
        train(em, opt, range(3, 6), name)
        out[kind] = {"extra": extra, "loaded": loaded, "at6": snapshot(em, opt), "files": sorted(os.listdir(path))}
    return out


@pytest.mark.dist
def test_exact_resume_in_new_processes_and_resharding(tmp_path):
    """gpt2 resumes at world 2 in new processes; the toy tied model (a replicated chunk, params
    split across shards) reshards 2 -> 4 in new processes (no transformers import in 4 ranks) and
    both reshard 2 -> 1 in this process."""
    root = str(tmp_path)
    first = run_distributed(_train_and_save, 2, root, (MODEL, "tied"), timeout=300)[0]
    resumed = run_distributed(_load_and_train, 2, root, MODEL, ("sharded", "full"), timeout=300)[0]
    assert resumed["sharded"]["files"] == ["extra.pt", "index.json", "rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"]
    assert resumed["sharded"]["extra"] == {"step": 3, "note": "hi"}
    for kind in ("sharded", "full"):
        assert bitwise_diff(resumed[kind]["loaded"], first[MODEL]["at3"]) == [], kind
        assert bitwise_diff(resumed[kind]["at6"], first[MODEL]["at6"]) == [], kind  # exact resume, fp32
    # offline consolidation of the world-2 shards (no model, no process group) gives the same state
    for kind in ("sharded", "full"):
        full = checkpoint.consolidate(os.path.join(root, MODEL, kind))
        assert full["model"].keys() <= first[MODEL]["at3"]["model"].keys()
        assert "transformer.wte.weight" in full["model"]
        merged = {**first[MODEL]["at3"]["model"], **full["model"]}
        assert bitwise_diff({"model": merged, "optim": full["optimizer"]}, first[MODEL]["at3"]) == [], kind
    # 2 -> 4 (new processes) and 2 -> 1 (in this process): the loaded state is bitwise the saved one
    runs = [("tied", run_distributed(_load_and_train, 4, root, "tied", ("sharded",), timeout=300)[0])]
    runs += [(name, _load_and_train(root, name, ("sharded", "full"))) for name in (MODEL, "tied")]
    for name, got_kinds in runs:
        for kind, got in got_kinds.items():
            assert bitwise_diff(got["loaded"], first[name]["at3"]) == [], (name, kind)
            # training on at another world size sums gradients in another order: close, not bitwise
            for k, v in first[name]["at6"]["model"].items():
                assert torch.allclose(got["at6"]["model"][k], v, rtol=1e-3, atol=2e-4), (name, kind, k)


# --------------------------------------------------------------------------------------------
# full checkpoints are Hugging Face and torch compatible


def test_full_checkpoint_is_hf_and_torch_compatible(tmp_path):
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    em, opt = make()
    train(em, opt, range(2))
    path = str(tmp_path / "full")
    checkpoint.save(path, em, opt, shard=False)
    sd = em.state_dict()
    plain = build_model(MODEL)
    plain.save_pretrained(str(tmp_path / "hf"))
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as a, safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())  # tied weights stored once, as HF stores them
    hf = GPT2LMHeadModel.from_pretrained(path)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, sd[k]), k
    osd = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)
    torch_opt = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    torch_opt.load_state_dict(osd)
    assert bitwise_diff({"model": sd, "optim": osd}, snapshot(em, opt)) == []


def test_fp16_scaler_and_extra_roundtrip(tmp_path):
    em, opt = make(dtype=torch.float16, growth_interval=2, initial_scale=2.0**8)
    train(em, opt, range(3))
    assert opt.loss_scale == 2.0**9
    for shard in (True, False):
        path = str(tmp_path / f"ck{shard}")
        checkpoint.save(path, em, opt, extra={"rng": torch.get_rng_state(), "epoch": 1}, shard=shard)
        em2, opt2 = make(dtype=torch.float16, growth_interval=2, initial_scale=2.0**8)
        extra = checkpoint.load(path, em2, opt2)
        assert torch.equal(extra["rng"], torch.get_rng_state()) and extra["epoch"] == 1
        assert opt2.scaler.state_dict() == opt.scaler.state_dict()
        for a, b in zip(em.chunks, em2.chunks):
            assert torch.equal(a.master, b.master) and torch.equal(a.shard, b.shard)
    with pytest.raises(CheckpointError, match="extra"):
        checkpoint.save(str(tmp_path / "bad"), em, opt, extra={"opt": opt})
    assert not os.path.exists(tmp_path / "bad")


# --------------------------------------------------------------------------------------------
# bad input: clear errors, nothing modified


@pytest.mark.dist
def test_bad_checkpoints_raise_clear_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    em, opt = make()
    train(em, opt, range(2))
    good = str(tmp_path / "good")
    checkpoint.save(good, em, opt)
    target, topt = make()
    train(target, topt, range(1))
    shard_file = os.path.join(good, "rank00000-of-00001.safetensors")

    def variant(name: str) -> str:
        dst = str(tmp_path / name)
        subprocess.run(["cp", "-r", good, dst], check=True)
        return dst

    # missing shard
    p = variant("missing")
    os.remove(os.path.join(p, "rank00000-of-00001.safetensors"))
    expect_error(p, target, topt, "missing")
    # truncated file
    p = variant("truncated")
    f = os.path.join(p, "rank00000-of-00001.safetensors")
    os.truncate(f, os.path.getsize(f) // 2)
    expect_error(p, target, topt, "truncated")
    # truncated file whose index was "fixed" to match: the safetensors header catches it
    p = variant("truncated2")
    f = os.path.join(p, "rank00000-of-00001.safetensors")
    os.truncate(f, os.path.getsize(f) - 64)
    idx = json.load(open(os.path.join(p, "index.json")))
    idx["files"]["rank00000-of-00001.safetensors"] = os.path.getsize(f)
    idx["checksums"]["rank00000-of-00001.safetensors"] = file_checksum(f)  # index "fixed" to match
    json.dump(idx, open(os.path.join(p, "index.json"), "w"))
    expect_error(p, target, topt, "corrupt or truncated")
    # mismatched dtype
    p = variant("dtype")
    f = os.path.join(p, "rank00000-of-00001.safetensors")
    tensors = load_file(f)
    key = next(k for k in tensors if k.startswith("param/"))
    tensors[key] = tensors[key].half()
    save_file(tensors, f, metadata={"format": "pt"})
    idx = json.load(open(os.path.join(p, "index.json")))
    idx["files"]["rank00000-of-00001.safetensors"] = os.path.getsize(f)
    idx["checksums"]["rank00000-of-00001.safetensors"] = file_checksum(f)  # index "fixed" to match
    json.dump(idx, open(os.path.join(p, "index.json"), "w"))
    expect_error(p, target, topt, "dtype")
    # another model's checkpoint
    other, oopt = make(name="llama")
    checkpoint.save(str(tmp_path / "llama"), other, oopt)
    expect_error(str(tmp_path / "llama"), target, topt, "does not match this model")
    # another optimizer layout
    g_em, g_opt = make(groups=True)
    before = chunk_and_optimizer_state(g_em, g_opt)
    with pytest.raises(CheckpointError, match="param groups"):
        checkpoint.load(good, g_em, g_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, chunk_and_optimizer_state(g_em, g_opt)))
    # a model-only checkpoint loads into a model, and says so when asked for optimizer state
    checkpoint.save(str(tmp_path / "model_only"), em)
    m_only, _ = make()
    checkpoint.load(str(tmp_path / "model_only"), m_only)
    assert all(torch.equal(a.master, b.master) for a, b in zip(em.chunks, m_only.chunks))
    expect_error(str(tmp_path / "model_only"), target, topt, "no optimizer state")
    # not a checkpoint at all; and save refuses to replace a directory that is not a checkpoint
    os.makedirs(tmp_path / "notckpt")
    (tmp_path / "notckpt" / "keep.txt").write_text("mine")
    expect_error(str(tmp_path / "notckpt"), target, topt, "not an elixir checkpoint")
    with pytest.raises(CheckpointError, match="refusing"):
        checkpoint.save(str(tmp_path / "notckpt"), target, topt)
    assert (tmp_path / "notckpt" / "keep.txt").read_text() == "mine"
    assert os.path.getsize(shard_file) > 0  # the good one is untouched by all this


# --------------------------------------------------------------------------------------------
# crash safety


_CRASH_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    import checkpoint_cases as t
    from elixir import checkpoint
    em, opt = t.make()
    t.train(em, opt, range(1))
    checkpoint.save({path!r}, em, opt)
    torch.save(em.state_dict(), {expected!r})
    t.train(em, opt, range(1, 2))
    from elixir.checkpoint import format as tensor_files
    real = tensor_files.write_tensors
    def slow(path, tensors):
        size = real(path, tensors)
        print("WRITING", flush=True)
        time.sleep(60)
        return size
    tensor_files.write_tensors = slow
    checkpoint.save({path!r}, em, opt)
    """
)


@pytest.mark.dist
def test_kill_mid_save_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    expected = str(tmp_path / "expected.pt")
    code = _CRASH_CHILD.format(tests=os.path.dirname(__file__), path=path, expected=expected)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "WRITING" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "WRITING" in line, "the child never reached the second save"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    stale = [n for n in os.listdir(tmp_path) if n.startswith(".ck.tmp-")]
    assert stale, "the killed save should have left its temporary directory behind"
    em, opt = make()
    checkpoint.load(path, em, opt)
    want = torch.load(expected, weights_only=True)
    got = em.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    # the next save cleans the debris up; a crash between the final renames is recovered by load
    checkpoint.save(path, em, opt)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ck.tmp-")]
    os.rename(path, str(tmp_path / ".ck.old-deadbeef"))
    em2, opt2 = make()
    with pytest.warns(UserWarning, match="interrupted"):
        checkpoint.load(path, em2, opt2)
    assert all(torch.equal(a.master, b.master) for a, b in zip(em.chunks, em2.chunks))
