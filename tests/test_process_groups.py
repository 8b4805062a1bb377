"""Two data-parallel process groups side by side (issue 36 item 11): world 4 split into groups
{0, 1} and {2, 3}, each training its own model on its own data with ElixirModule(..., group),
each matching torch DDP over the same group in the same run. This exercises the group resolution
in elixir/wrapper/mesh.py on a group other than the whole world (the README passes `group`)."""

from __future__ import annotations

import pytest
import torch

STEPS = 3
BATCH = 4


def _two_groups() -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elixir.search import minimum_waste_search
    from elixir.testing.reference import shard_batch
    from elixir.testing.zoo import build_model, get_case
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in order
    g = rank // 2
    group = groups[g]
    zc = get_case("gpt2")
    out = {"group": g}
    for name in ("elixir", "ddp"):
        model = build_model("gpt2", seed=10 + g)  # each group its own model
        if name == "elixir":
            model = ElixirModule(model, minimum_waste_search(model, 2), group)
            opt = ElixirOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        else:
            model = DistributedDataParallel(model, process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(STEPS):
            batch = shard_batch(zc.make_batch(BATCH, 100 * g + step), rank % 2, 2)  # each group its own data
            opt.zero_grad()
            loss = zc.loss(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        state = model.state_dict() if name == "elixir" else model.module.state_dict()
        out[name] = (losses, {k: v.detach().clone() for k, v in state.items()})
        if name == "elixir":
            out["sharded_over"] = model.world_size
    return out


@pytest.mark.dist
def test_two_groups_side_by_side_each_match_ddp():
    from elixir.testing import run_distributed

    results = run_distributed(_two_groups, 4, timeout=600)
    assert [r["group"] for r in results] == [0, 0, 1, 1]
    for r in results:
        assert r["sharded_over"] == 2
        torch.testing.assert_close(r["elixir"][0], r["ddp"][0], rtol=1e-5, atol=1e-6)
        for k, v in r["ddp"][1].items():
            torch.testing.assert_close(r["elixir"][1][k], v, rtol=1e-5, atol=1e-6, msg=k)
    # the groups really trained different models on different data
    assert results[0]["ddp"][0] != results[2]["ddp"][0]
    for a, b in ((0, 1), (2, 3)):  # the two ranks of a group end with the same model
        for k, v in results[a]["elixir"][1].items():
            assert torch.equal(v, results[b]["elixir"][1][k]), k
    assert not torch.equal(results[0]["elixir"][1]["lm_head.weight"], results[2]["elixir"][1]["lm_head.weight"])
