"""Compute shards placed on disk (``shard_placement == DISK``): the whole chunk lives in the offload
file between uses, so a rank holds none of its bytes, and the file holds no shard either: the shard
is derived from the fp32 master at each read (``elixir.offload.derived``).

One spawned run per world size (1 and 2) trains a plan whose chunks keep shard, master and
optimizer state on disk ("KK"), and the same plan with the shards on the host ("HK"): losses,
weights and optimizer state must be bit for bit equal (fp32 AdamW, with forward's read-ahead of
the next shard; bf16 fused CPUAdam; and the fused backward-and-step), a checkpoint saved and loaded mid-run must resume exactly, and between
steps no shard byte may be resident, nor any shard byte stored. A plan asking for a disk shard without a disk master is refused.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from elixir import checkpoint
from elixir import distributed as edist
from elixir.optim import CPUAdam
from elixir.plan import ChunkPlan, Placement
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import default_optimizer, train_wrapped
from elixir.testing.zoo import ZOO
from elixir.wrapper import ElixirModule, ElixirOptimizer

MODEL = "gpt2"
BATCH = 4


def _placed(plan, shard: Placement):
    """Every sharded chunk's optimizer state on disk, its shard at ``shard``."""
    chunks = [dataclasses.replace(c, optim_placement=Placement.DISK, shard_placement=shard) if c.sharded else c
              for c in plan.chunks]
    return dataclasses.replace(plan, chunks=tuple(chunks))


def _build(shard: Placement, dtype=torch.float32, fused=False, fused_step=False):
    torch.manual_seed(0)
    model = ZOO[MODEL].build()
    plan = _placed(minimum_waste_search(model, edist.get_world_size()), shard)
    em = ElixirModule(model, plan, dtype=dtype, output_fp32=dtype != torch.float32)
    em.train()
    params = [p for p in em.parameters() if p.requires_grad]
    inner = CPUAdam(params, lr=1e-2, weight_decay=0.01) if fused else default_optimizer(params)
    return em, ElixirOptimizer(em, inner, fused_step=fused_step)


def _close(em) -> None:
    for store in (em.disk_store, em.shard_store, em.derived_shards):
        if store is not None:
            store.close()


def _run(shard: Placement, steps: int = 3, **kw) -> dict:
    em, eo = _build(shard, **kw)
    run = train_wrapped(ZOO[MODEL], em, eo, steps=steps, batch_size=BATCH)
    rep = em.memory_report()
    store = em.derived_shards
    masters = em.disk_store
    out = {
        "losses": run.losses, "state": em.state_dict(), "optim": eo.state_dict(),
        "shard_host_bytes": rep["shard_host_bytes"],
        "disk_shards": len(store.chunks) if store is not None else 0,
        "shard_store": store.report() if store is not None else {},
        "shard_states": sorted({r.state.value for r in store.chunks.values()}) if store is not None else [],
        "separate_shard_file": em.shard_store is not None,
        # forward's read-ahead (fp32 shards only: a bf16 shard is cast from its fp32 master)
        "read_ahead": (store.read_ahead_bytes, store.wasted_read_ahead_bytes) if store is not None else (0, 0),
        "shard_peak": store.peak_staged_bytes if store is not None else 0,
        "one_shard": store.report()["max_chunk_staged_bytes"] if store is not None else 0,
        # the offload file holds master and optimizer state only: 4 + 8 bytes per element (AdamW)
        "file_bytes_per_element": (sum(r.staged_bytes for r in masters.chunks.values()) / sum(r.numel for r in masters.chunks.values())
                                   if masters is not None else 0.0),
    }
    _close(em)
    return out


def _resume(root: str) -> dict:
    """2 steps, a sharded checkpoint, a fresh model and optimizer load it, 2 more steps."""
    path = os.path.join(root, "ckpt")
    em, eo = _build(Placement.DISK)
    first = train_wrapped(ZOO[MODEL], em, eo, steps=2, batch_size=BATCH)
    checkpoint.save(path, em, eo)
    _close(em)
    em2, eo2 = _build(Placement.DISK)
    checkpoint.load(path, em2, eo2)
    losses = train_wrapped(ZOO[MODEL], em2, eo2, steps=2, batch_size=BATCH, first_step=2).losses
    out = {"losses": first.losses + losses, "state": em2.state_dict(), "optim": eo2.state_dict()}
    _close(em2)
    return out


def _worker(root: str) -> dict:
    return {
        "disk": _run(Placement.DISK),
        "host": _run(Placement.HOST),
        "disk_bf16_fused": _run(Placement.DISK, dtype=torch.bfloat16, fused=True),
        "host_bf16_fused": _run(Placement.HOST, dtype=torch.bfloat16, fused=True),
        "disk_fused_step": _run(Placement.DISK, dtype=torch.bfloat16, fused=True, fused_step=True),
        "host_fused_step": _run(Placement.HOST, dtype=torch.bfloat16, fused=True, fused_step=True),
        "four": _run(Placement.DISK, steps=4),
        "resume": _resume(root),
    }


def _differences(a: dict, b: dict) -> list[str]:
    errs = [] if a["losses"] == b["losses"] else [f"losses {a['losses']} != {b['losses']}"]
    errs += [f"weight {k} differs" for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
    for i, st in a["optim"]["state"].items():
        for k, v in st.items():
            w = b["optim"]["state"][i][k]
            if not (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w):
                errs.append(f"optimizer state {i}/{k} differs")
    return errs


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_disk_shards_step_like_host_shards_and_resume(world, tmp_path):
    results = run_distributed(_worker, world, str(tmp_path), timeout=300)
    got = results[0]
    errors = []
    for disk, host in (("disk", "host"), ("disk_bf16_fused", "host_bf16_fused"), ("disk_fused_step", "host_fused_step")):
        errors += [f"{disk}: {e}" for e in _differences(got[disk], got[host])]
    errors += [f"resume: {e}" for e in _differences(got["resume"], got["four"])]
    assert not errors, "\n".join(errors)
    for r in results:
        for name in ("disk", "disk_bf16_fused", "disk_fused_step"):
            res = r[name]
            assert res["disk_shards"] > 0
            # between steps a disk shard holds no host bytes; the ledger agrees with the store
            assert res["shard_host_bytes"] == 0 and res["shard_store"]["staged_bytes"] == 0, res
            assert res["shard_states"] == ["offloaded"]
            assert res["shard_store"]["bytes_read"] > 0 and res["shard_store"]["bytes_written"] == 0
            assert not res["separate_shard_file"]
            assert res["file_bytes_per_element"] == 12, res["file_bytes_per_element"]
        assert r["host"]["shard_host_bytes"] > 0  # the twin does keep its shards resident
        # fp32: every forward after the first reads each next shard ahead, all of it used; one
        # shard staged at a time all the same (the read-ahead is queued once the last is dropped)
        used, wasted = r["disk"]["read_ahead"]
        assert used > 0 and wasted == 0 and r["disk"]["shard_peak"] == r["disk"]["one_shard"], r["disk"]
        assert r["disk_bf16_fused"]["read_ahead"] == (0, 0)


def test_disk_shard_needs_disk_master():
    with pytest.raises(ValueError, match="optimizer state on disk too"):
        ChunkPlan(params=("w",), shapes=((4,),), chunk_size=4, shard_placement=Placement.DISK,
                  optim_placement=Placement.HOST)
    ChunkPlan(params=("w",), shapes=((4,),), chunk_size=4, shard_placement=Placement.DISK, optim_placement=Placement.DISK)
