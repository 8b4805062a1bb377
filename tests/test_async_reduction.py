"""Reductions and ZeRO-1/2 publishes left running on gloo's thread while backward goes on, and the
recycled gradient buffers (``elixir.chunk.GradBufferPool``) on a CPU device.

Deferring a collective changes when the host waits for it, never what it computes: every kind of
chunk (sharded, ZeRO-2, ZeRO-1, replicated, and a plan mixing them), with the separate and the
fused backward-and-step, must train bit for bit as with every reduction and publish completed at
once. The test also checks that the deferred path really ran (chunks seen ``REDUCING``, publishes
in flight) and that buffers were reused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elixir import distributed as edist
from elixir.chunk import Chunk, ChunkComm, GradBufferPool, GradState
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import train_wrapped
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer
from tests.chunk_kinds import uniform, with_kinds

STEPS = 3


def test_pool_reuses_buffers_and_keeps_out_views():
    pool = GradBufferPool(enabled=True)
    a = pool.take(1000, torch.float32, torch.device("cpu"))
    pool.give(a)
    assert pool.take(1000, torch.float32, torch.device("cpu")) is a  # same size and dtype: reused
    b = pool.take(1000, torch.bfloat16, torch.device("cpu"))
    assert b is not a and b.dtype == torch.bfloat16
    pool.give(a[:500])  # a view of a larger tensor is never taken in
    pool.give(torch.empty(2000)[1000:])
    assert pool.free_bytes == 0
    assert (pool.allocated, pool.reused) == (2, 1)
    off = GradBufferPool(enabled=False)
    c = off.take(10, torch.float32, torch.device("cpu"))
    off.give(c)
    assert off.take(10, torch.float32, torch.device("cpu")) is not c and off.free_bytes == 0



def _pool_after_steps(optim) -> tuple[list[int], list]:
    """Free bytes of the gradient-buffer pool after each of STEPS + 1 steps of a world-1 model whose
    chunks are all replicated with their optimizer state kept ``optim``, and its losses."""
    from elixir.plan import Sharding

    torch.manual_seed(0)
    model = build_model("gpt2")
    sr = uniform(minimum_waste_search(model, 1), Sharding.REPLICATED)
    sr = dataclasses.replace(sr, chunks=tuple(dataclasses.replace(c, optim_placement=optim) for c in sr.chunks))
    em = ElixirModule(model, sr)
    eo = ElixirOptimizer(em, torch.optim.AdamW(list(em.parameters()), lr=1e-2))
    free, losses = [], []
    for s in range(STEPS + 1):
        eo.zero_grad(set_to_none=True)
        loss = ZOO["gpt2"].loss(em, ZOO["gpt2"].make_batch(4, s))
        loss.backward()
        eo.step()
        free.append(em.grad_buffers.free_bytes)
        losses.append(loss.item())
    return free, losses


def test_host_state_shard_gradients_come_from_the_pool():
    # a replicated chunk with its optimizer state on the host keeps a shard gradient apart from its
    # gradient buffer; drop() gives it to the pool, so it must come from the pool too: allocated
    # outside it, every step added a copy of the chunks' gradients to the pool's free buffers
    # (GPT-2 354M: OOM-killed). The pool now holds as much after each step; the run trains as with the
    # state on the device.
    from elixir.plan import Placement

    host, host_losses = _pool_after_steps(Placement.HOST)
    _, device_losses = _pool_after_steps(Placement.DEVICE)
    assert host_losses == pytest.approx(device_losses, rel=1e-5)
    assert host[1:] == [host[1]] * STEPS, f"the pool grows step after step: {host}"


def _plan(model, world: int, kinds: str):
    from elixir.search import Sharding

    sr = minimum_waste_search(model, world)
    return with_kinds(sr, "mixed") if kinds == "mixed" else uniform(sr, Sharding(kinds))


def _run(kinds: str, fused: bool, deferred: bool) -> dict:
    seen = {"reducing": 0, "publishing": 0, "most_in_flight": 0}
    finish, publish = Chunk.finish_reduction, Chunk.publish
    held: list = []  # the module, once built

    def counting_finish(self):
        seen["reducing"] += self.grad_state is GradState.REDUCING
        if held:
            in_flight = sum(c.grad_state is GradState.REDUCING for c in held[0].chunks)
            seen["most_in_flight"] = max(seen["most_in_flight"], in_flight)
        finish(self)

    def counting_publish(self, async_op=False):
        publish(self, async_op)
        seen["publishing"] += self.publishing

    Chunk.finish_reduction, Chunk.publish = counting_finish, counting_publish
    if not deferred:
        ChunkComm.defers_reductions = property(lambda self: False)
    try:
        model = build_model("gpt2")
        em = ElixirModule(model, _plan(model, edist.get_world_size(), kinds))
        held.append(em)
        eo = ElixirOptimizer(em, torch.optim.AdamW(list(em.parameters()), lr=1e-2), fused_step=fused)
        run = train_wrapped(ZOO["gpt2"], em, eo, steps=STEPS, batch_size=4)
        state = em.state_dict()
        return {"losses": run.losses, "state": state, "seen": seen, "reused": em.grad_buffers.reused,
                "kinds": sorted({c.spec.sharding.value for c in em.chunks})}
    finally:
        Chunk.finish_reduction, Chunk.publish = finish, publish
        ChunkComm.defers_reductions = _DEFERS


_DEFERS = ChunkComm.__dict__["defers_reductions"]  # the property itself


def _worker(cases):
    return [(_run(k, f, True), _run(k, f, False)) for k, f in cases]


@pytest.mark.dist
def test_deferred_collectives_train_bitwise_as_synchronous():
    # a mixed plan cycles sharded / ZeRO-2 / ZeRO-1 / replicated chunks; pure ZeRO-1 publishes
    # every chunk from the fused step; pure sharded reduce-scatters straight into shard gradients;
    # replicated chunks without the fused step keep their reduced buffers, so their reductions
    # all stay in flight until backward's end (DDP's buckets), and with it one at a time
    cases = [("mixed", False), ("mixed", True), ("zero1", True), ("sharded", False),
             ("replicated", False), ("replicated", True)]
    res = run_distributed(_worker, 2, cases, timeout=600)
    errors = []
    for (kinds, fused), (deferred, sync) in zip(cases, res[0]):
        label = f"{kinds} fused={fused}"
        if deferred["losses"] != sync["losses"]:
            errors.append(f"{label}: losses {deferred['losses']} != {sync['losses']}")
        for name, v in sync["state"].items():
            if not torch.equal(deferred["state"][name], v):
                errors.append(f"{label}: {name} differs")
                break
        if deferred["seen"]["reducing"] == 0:
            errors.append(f"{label}: no reduction was deferred")
        if sync["seen"]["reducing"] or sync["seen"]["publishing"]:
            errors.append(f"{label}: the synchronous run deferred {sync['seen']}")
        if fused and kinds in ("zero1", "zero2") and deferred["seen"]["publishing"] == 0:
            errors.append(f"{label}: the fused step published nothing asynchronously")
        if kinds != "replicated" and deferred["reused"] == 0:
            errors.append(f"{label}: no gradient buffer was reused")
        # the limit: one buffer-holding reduction in flight besides the one just issued
        unbounded = kinds == "replicated" and not fused
        most = deferred["seen"]["most_in_flight"]
        if unbounded and most <= 2 or not unbounded and kinds != "mixed" and most > 2:
            errors.append(f"{label}: {most} reductions in flight at once")
    assert not errors, "\n".join(errors)
