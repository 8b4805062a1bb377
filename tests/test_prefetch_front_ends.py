"""Prefetch takes effect from every front end (issue 36 item 11). The front ends plan without a
traced step (``placement_policy="auto"``, ``plugin="auto"``, the Lightning strategy), so their
plans have no parameter order; before, ``max_prefetch`` / ``prefetch=True`` then prefetched
nothing. The runtime now follows the order the first training iteration took, from the second on,
``max_prefetch`` (the plan's ``prefetch_depth``) steps ahead. One world-2 run: each front end
trains a small GPT-2 for 3 steps, and its losses match torch DDP's in the same run."""

from __future__ import annotations

import pytest
import torch

STEPS = 3
BATCH = 4


def _ddp_losses(case: str) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    from elixir import distributed as edist
    from elixir.testing.reference import default_optimizer, shard_batch
    from elixir.testing.zoo import build_model, get_case

    zc = get_case(case)
    model = DistributedDataParallel(build_model(case, seed=0))
    opt = default_optimizer(model.parameters())
    out = []
    for step in range(STEPS):
        batch = shard_batch(zc.make_batch(BATCH, step), edist.get_rank(), edist.get_world_size())
        opt.zero_grad()
        loss = zc.loss(model, batch)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _booster_run(case: str, plugin) -> dict:
    from elixir import distributed as edist
    from elixir.booster import Booster
    from elixir.testing.reference import default_optimizer, shard_batch
    from elixir.testing.zoo import build_model, get_case

    zc = get_case(case)
    model = build_model(case, seed=0)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, default_optimizer(model.parameters()))
    losses = []
    for step in range(STEPS):
        batch = shard_batch(zc.make_batch(BATCH, step), edist.get_rank(), edist.get_world_size())
        opt.zero_grad()
        loss = zc.loss(model, batch)
        booster.backward(loss, opt)
        opt.step()
        losses.append(loss.item())
    sched = model.schedule
    return {"losses": losses, "prefetches": model.cache.prefetches, "lookahead": None if sched is None else sched.lookahead,
            "sharded": sum(c.spec.sharded for c in model.chunks), "plan_order": model.plan.param_order is not None}


def _lightning_run(case: str, **strategy_kw) -> dict:
    import lightning as L

    from elixir.integrations.lightning import ElixirStrategy
    from elixir.testing.zoo import build_model, get_case

    zc = get_case(case)

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(case, seed=0)
            self.losses = []

        def training_step(self, batch, idx):
            loss = zc.loss(self.model, batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            from elixir.testing.reference import default_optimizer

            return default_optimizer(self.parameters())

        def train_dataloader(self):
            from elixir import distributed as edist
            from elixir.testing.reference import shard_batch

            batches = [shard_batch(zc.make_batch(BATCH, s), edist.get_rank(), edist.get_world_size()) for s in range(STEPS)]
            return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    lm = LM()
    strategy = ElixirStrategy(**strategy_kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(lm)
    em = strategy.elixir_module
    return {"losses": lm.losses, "prefetches": em.cache.prefetches,
            "lookahead": None if em.schedule is None else em.schedule.lookahead,
            "sharded": sum(c.spec.sharded for c in em.chunks), "plan_order": em.plan.param_order is not None}


def _scenarios() -> dict:
    from elixir.booster import GeminiPlugin

    case = "gpt2"
    out = {"ddp": _ddp_losses(case)}
    out["gemini_static_depth2"] = _booster_run(case, GeminiPlugin(placement_policy="static", max_prefetch=2, precision="fp32"))
    out["gemini_cuda_depth1"] = _booster_run(case, GeminiPlugin(placement_policy="cuda", max_prefetch=1, precision="fp32"))
    out["lightning_prefetch"] = _lightning_run(case, prefetch=True)
    return out


@pytest.fixture(scope="module")
def results():
    from elixir.testing import run_distributed

    return run_distributed(_scenarios, 2, timeout=600)


@pytest.mark.dist
@pytest.mark.parametrize("name, depth", [("gemini_static_depth2", 2), ("gemini_cuda_depth1", 1), ("lightning_prefetch", 1)])
def test_prefetch_depth_takes_effect(results, name, depth):
    for got in results:
        r = got[name]
        assert not r["plan_order"] and r["sharded"] > 1, r  # an untraced plan with chunks to prefetch
        assert r["lookahead"] == depth, r
        assert r["prefetches"] > 0, r  # gathers issued ahead of use: before, none
        torch.testing.assert_close(r["losses"], got["ddp"], rtol=1e-5, atol=1e-6)


def test_learned_schedule_follows_the_order_it_saw():
    from elixir.chunk import learned_schedule

    s = learned_schedule([frozenset({0}), frozenset({0}), frozenset(), frozenset({1}), frozenset({2}), frozenset({1})], 2)
    assert s.steps == [frozenset({0}), frozenset({1}), frozenset({2}), frozenset({1})] and s.lookahead == 2
    assert s.observe(frozenset({0})) and s.upcoming() == [1, 2]
    assert learned_schedule([frozenset(), frozenset()], 3) is None  # no sharded chunk: nothing to follow
