"""A small checkpointed run (GPT-2 from the zoo, AdamW) and the checks on its state: shared by the
checkpoint tests, the damaged-checkpoint tests, the disk-fault tests and the rank-death tests."""

from __future__ import annotations

import pytest
import torch

from elixir import checkpoint
from elixir import distributed as edist
from elixir.checkpoint import CheckpointError
from elixir.search import minimum_waste_search
from elixir.testing.reference import shard_batch
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer

BATCH = 4
MODEL = "gpt2"


def make(world: int = 1, name: str = MODEL, dtype=torch.float32, groups: bool = False, **kw):
    model = build_model(name)
    em = ElixirModule(model, minimum_waste_search(model, world), dtype=dtype, output_fp32=dtype != torch.float32)
    params = [p for p in em.parameters() if p.requires_grad]
    if groups:  # two groups: no weight decay on biases and norms
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        inner = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.05)
    else:
        inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return em, ElixirOptimizer(em, inner, **kw)


def train(em, opt, steps, name: str = MODEL) -> None:
    zc = ZOO[name]
    rank, world = edist.get_rank(), edist.get_world_size()
    for s in steps:
        opt.zero_grad()
        zc.loss(em, shard_batch(zc.make_batch(BATCH, s), rank, world)).backward()
        opt.step()


def snapshot(em, opt) -> dict:
    """Full model and optimizer state (collective), on every rank."""
    return {"model": em.state_dict(), "optim": opt.state_dict()}


def bitwise_diff(a: dict, b: dict) -> list[str]:
    errs = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    if set(sa) != set(sb):
        errs.append("optimizer state indices differ")
    for i in sa:
        for k in sa[i]:
            if not torch.equal(sa[i][k], sb[i][k]):
                errs.append(f"optim {i}.{k}")
    if a["optim"]["param_groups"] != b["optim"]["param_groups"]:
        errs.append("param groups")
    return errs


def chunk_and_optimizer_state(em, opt) -> list[torch.Tensor]:
    out = [c.master.clone() for c in em.chunks]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def expect_error(path, em, opt, match):
    before = chunk_and_optimizer_state(em, opt)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(path, em, opt)
    after = chunk_and_optimizer_state(em, opt)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
