"""Modules that read a child's parameters without calling the child (nn.MultiheadAttention reads
``out_proj.weight`` functionally): the child's parameters belong to the parent's step in the tracer,
the search and the runtime alike, so the chunk is gathered when the parent runs."""

import pytest
import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import shard_batch
from elixir.tracer.hooks import param_owning_modules
from elixir.wrapper import ElixirModule, ElixirOptimizer

STEPS = 3


class EncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.head = nn.Linear(32, 64)

    def forward(self, x, y):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randint(0, 64, (4, 8), generator=g), "y": torch.randint(0, 64, (4, 8), generator=g)}


def _step(model, batch):
    loss = model(**batch)
    loss.backward()
    return loss


def test_out_proj_belongs_to_the_attention_step():
    steps = {name: owned for name, _, owned in param_owning_modules(EncoderLM())}
    assert "layers.0.self_attn.out_proj" not in steps
    assert "layers.0.self_attn.out_proj.weight" in steps["layers.0.self_attn"]


def _train(world_unused=None) -> dict:
    rank, world = edist.get_rank(), edist.get_world_size()
    torch.manual_seed(0)
    model = EncoderLM()
    plan = minimum_waste_search(model, world, prefetch=True, inp=shard_batch(_batch(0), rank, world), step_fn=_step)
    # small chunks, one cache block: every chunk is released between uses
    em = ElixirModule(model, plan, prefetch=True)
    opt = ElixirOptimizer(em, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for s in range(STEPS):
        loss = _step(em, shard_batch(_batch(s), rank, world))
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        edist.all_reduce(t)
        losses.append(t.item() / world)
    return {"losses": losses, "state": em.state_dict(rank0_only=True), "blocks": plan.cache_blocks,
            "sharded": sum(c.sharded for c in plan.chunks)}


@pytest.mark.dist
def test_encoder_layers_train_like_the_reference_at_world_2():
    torch.manual_seed(0)
    ref = EncoderLM()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for s in range(STEPS):
        ref_losses.append(_step(ref, _batch(s)).item())
        opt.step()
        opt.zero_grad()
    got = run_distributed(_train, 2, timeout=300)[0]
    assert got["sharded"] > 0
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
