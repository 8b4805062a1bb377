"""Checkpoints that detect damage (issue 18 item 3): every file's checksum is in the index, ``load``
checks each file before using it and before changing anything, on every rank, and names the bad
file; ``verify`` and ``elixir checkpoint verify`` check a checkpoint without loading it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from elixir import checkpoint
from elixir.checkpoint import CheckpointError
from elixir.cli import main
from elixir.testing import run_distributed
from tests.checkpoint_cases import expect_error, make, train

SHARD = "rank00000-of-00001.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained gpt2 checkpoint (sharded, with extra) and the state it holds."""
    root = tmp_path_factory.mktemp("damage")
    em, opt = make()
    train(em, opt, range(2))
    good = str(root / "good")
    checkpoint.save(good, em, opt, extra={"step": 2})
    return root, good, [c.master.clone() for c in em.chunks]


def _copy(saved, name: str) -> str:
    root, good, _ = saved
    dst = str(root / name)
    shutil.copytree(good, dst)
    return dst


def _flip_byte(path: str, offset_from_end: int = 5) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - offset_from_end)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``elixir checkpoint ARGS`` through the real command-line entry point, in this process."""
    capsys.readouterr()
    rc = main(["checkpoint", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_index_records_checksums_and_verify_passes(saved, capsys):
    _, good, _ = saved
    idx = json.load(open(os.path.join(good, "index.json")))
    assert set(idx["checksums"]) == set(idx["files"]) == {SHARD, "extra.pt"}
    result = checkpoint.verify(good)
    assert result.checked and result.files == idx["files"]
    rc, out, _ = _cli(capsys, "verify", good)
    assert rc == 0 and "checksums match" in out


def test_flipped_byte_is_named_and_nothing_changes(saved, capsys):
    p = _copy(saved, "flipped")
    _flip_byte(os.path.join(p, SHARD))  # in the tensor data: the header and the size stay valid
    with pytest.raises(CheckpointError, match=f"{SHARD} .*damaged"):
        checkpoint.verify(p)
    target, topt = make()
    expect_error(p, target, topt, f"{SHARD} .*damaged")
    rc, _, err = _cli(capsys, "verify", p)
    assert rc == 1 and SHARD in err and "damaged" in err
    # a flipped byte in extra.pt too
    p = _copy(saved, "flipped_extra")
    _flip_byte(os.path.join(p, "extra.pt"), offset_from_end=30)
    expect_error(p, target, topt, "extra.pt .*damaged")


def test_truncated_and_missing_files_are_named(saved, capsys):
    target, topt = make()
    p = _copy(saved, "truncated")
    f = os.path.join(p, SHARD)
    os.truncate(f, os.path.getsize(f) - 100)
    expect_error(p, target, topt, f"{SHARD} has .* bytes.*truncated")
    with pytest.raises(CheckpointError, match=SHARD):
        checkpoint.verify(p)
    p = _copy(saved, "missing")
    os.remove(os.path.join(p, SHARD))
    expect_error(p, target, topt, f"{SHARD} is missing")
    assert _cli(capsys, "verify", p)[0] == 1


def test_index_from_another_model(saved):
    root, _, _ = saved
    other, oopt = make(name="llama")
    checkpoint.save(str(root / "llama"), other, oopt)
    p = _copy(saved, "foreign_index")
    shutil.copy(os.path.join(root, "llama", "index.json"), os.path.join(p, "index.json"))
    target, topt = make()
    expect_error(p, target, topt, "does not match this model")


def test_checkpoint_without_checksums_still_loads(saved, capsys):
    _, _, masters = saved
    p = _copy(saved, "old")
    ipath = os.path.join(p, "index.json")
    idx = json.load(open(ipath))
    del idx["checksums"]  # as written before checksums
    json.dump(idx, open(ipath, "w"))
    result = checkpoint.verify(p)
    assert not result.checked and "cannot check" in result.summary()
    target, topt = make()
    assert checkpoint.load(p, target, topt) == {"step": 2}
    assert all(torch.equal(c.master, m) for c, m in zip(target.chunks, masters))
    rc, out, _ = _cli(capsys, "verify", p)
    assert rc == 0 and "cannot check" in out


def test_full_checkpoint_damage_is_named(tmp_path):
    em, opt = make()
    train(em, opt, range(1))
    p = str(tmp_path / "full")
    checkpoint.save(p, em, opt, shard=False)
    assert checkpoint.verify(p).checked
    _flip_byte(os.path.join(p, "model.safetensors"))
    target, topt = make()
    expect_error(p, target, topt, "model.safetensors .*damaged")


def _load_damaged_two_ranks(good: str, bad: str) -> str:
    em, opt = make(world=2)
    train(em, opt, range(1))
    checkpoint.save(good, em, opt)
    if em.rank == 0:
        shutil.copytree(good, bad)
        _flip_byte(os.path.join(bad, "rank00001-of-00002.safetensors"))
    torch.distributed.barrier()
    before = [c.master.clone() for c in em.chunks]
    try:
        checkpoint.load(bad, em, opt)
    except CheckpointError as e:
        assert all(torch.equal(c.master, b) for c, b in zip(em.chunks, before))
        return str(e)
    return "loaded"


@pytest.mark.dist
def test_damage_seen_by_one_rank_fails_every_rank(tmp_path):
    msgs = run_distributed(_load_damaged_two_ranks, 2, str(tmp_path / "good"), str(tmp_path / "bad"), timeout=120)
    assert len(msgs) == 2
    for m in msgs:
        assert "rank00001-of-00002.safetensors" in m and "damaged" in m, m
