"""The footprint rule (``elixir/plan/footprint.py``) is the runtime's and the cost model's alike.

At world size 2, for a few plans (ZeRO-3 with a cache too small to keep every chunk, so backward
gathers again; the four shardings mixed; sharded chunks with shards and optimizer state on the
host; a traced plan that prefetches), one training step of the runtime issues exactly the
collectives the cost model counts for the plan: its simulated gathers
(:func:`~elixir.search.cost_model.simulate_layout` under Belady, the runtime's eviction with a
known order), and per chunk the reduction and the publish :func:`~elixir.plan.footprint.collectives`
says. The runtime's count is :attr:`elixir.chunk.ChunkComm.issued`, summed over its chunks, on the
second step (the first learns the order of an untraced plan). Without ``prefetch`` the runtime
evicts the least recently used chunk instead, and gathers as the simulator's LRU twin says (the
``"lru"`` case): the cost model prices Belady's count, so a plan whose cache is smaller than its
step needs the runtime's ``prefetch`` for the predicted gathers. The bytes its ledger and optimizer
hold after backward are :func:`~elixir.plan.footprint.held_bytes` summed over the chunks (less
the padding's optimizer state, which the runtime's optimizer does not keep).

All cases run in one launch of two ranks (``tests/launch_jobs.py``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from elixir import distributed as edist
from elixir.plan import MeshLayout, Placement, SearchResult, Sharding
from elixir.plan.footprint import collectives, held_bytes, master_shares_shard, resident_sharding
from elixir.search import minimum_waste_search
from elixir.testing.reference import shard_batch
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer
from tests.chunk_kinds import with_kinds
from tests.launch_jobs import Job, Launches, result
from tests.matrix_cases import BATCH

MODEL = "gpt2"
CASES = ("sharded", "mixed", "host", "prefetch", "lru")


def _plan(case: str, model: torch.nn.Module, world: int) -> SearchResult:
    """``case``'s plan for ``model`` (built alike on every rank and in the test)."""
    zc = ZOO[MODEL]
    if case == "prefetch":  # traced: the runtime follows the tracer's order from the first step
        sr = minimum_waste_search(model, world, prefetch=True, inp=zc.make_batch(BATCH, 0), step_fn=zc.step_fn)
        return dataclasses.replace(sr, cache_blocks=2)
    sr = minimum_waste_search(model, world)
    if case == "mixed":
        return with_kinds(sr, "mixed")
    if case == "host":  # every other sharded chunk's shard and state on the host (HH), one DH
        chunks = [dataclasses.replace(c, shard_placement=Placement.HOST if i % 2 else Placement.DEVICE,
                                      optim_placement=Placement.HOST) if c.sharded else c
                  for i, c in enumerate(sr.chunks)]
        return dataclasses.replace(sr, chunks=tuple(chunks), cache_blocks=2)
    return dataclasses.replace(sr, cache_blocks=2)  # fewer blocks than chunks: backward gathers again


def _prefetch(case: str) -> bool:
    """The runtime follows an order (Belady's eviction, the cost model's) except in ``"lru"``:
    without ``prefetch`` it evicts the least recently used chunk."""
    return case != "lru"


def _worker(case: str) -> dict:
    rank, world = edist.get_rank(), edist.get_world_size()
    zc = ZOO[MODEL]
    model = build_model(MODEL)
    sr = _plan(case, model, world)
    em = ElixirModule(model, sr, prefetch=_prefetch(case))
    eo = ElixirOptimizer(em, torch.optim.AdamW(list(em.parameters()), lr=1e-3))
    for step in range(2):
        for c in em.all_chunks:
            c.comm.issued.clear()
        eo.zero_grad()
        zc.loss(em, shard_batch(zc.make_batch(BATCH, step), rank, world)).backward()
        held = em.memory_report()
        eo.step()
    issued = sum((c.comm.issued for c in em.all_chunks), Counter())
    return {"plan": sr.to_json(), "issued": dict(issued), "held": held}


def _predicted(plan: SearchResult, case: str) -> dict[str, int]:
    """The cost model's collectives per step for ``plan`` (gathers under LRU, the simulator's
    other policy, in ``"lru"``)."""
    from elixir.hardware import load_profile
    from elixir.search.cost_model import Setting, collective_counts, evaluate_plan, layout_from_plan
    from elixir.search.simulator import simulate
    from elixir.search.step_profile import profile_step

    zc = ZOO[MODEL]
    profile = profile_step(build_model(MODEL), zc.make_batch(BATCH, 0), zc.step_fn, torch.float32)
    w = plan.world_size
    st = Setting(layout=MeshLayout.data_parallel(w), elem=4, reduce_elem=4, opt_bytes=8,
                 hardware=load_profile("cpu-box"), dtype="float32")
    counts = collective_counts(evaluate_plan(profile, plan, st), w)
    if not _prefetch(case):
        counts["all_gather"] = simulate(layout_from_plan(profile, plan).trace, plan.cache_blocks, "lru").gathers
    return counts


def _held(plan: SearchResult, rank: int) -> int:
    """What the footprint rule says ``rank`` holds between uses (fp32 Adam, fp32 gradients), less
    the optimizer state of the padding in its part of each chunk: the runtime's optimizer keeps
    state per parameter, where the cost model prices the whole padded shard (a few bytes more)."""
    w, adam = plan.world_size, 8
    total = 0
    for c in plan.chunks:
        n = c.state_size(w)
        total += sum(held_bytes(c.shard_size(w), n, c.dtype, c.shard_placement, c.optim_placement, 4, adam))
        lo = rank * n if c.state_sharded else 0
        total -= max(0, lo + n - max(lo, c.used)) * adam
    return total


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES)
def test_runtime_issues_the_collectives_the_cost_model_counts(case, launched):
    got = result(launched[2], case)
    plan = SearchResult.from_json(got[0]["plan"])
    counts = _predicted(plan, case)
    assert counts["all_gather"] > 0 and counts["reduce_scatter"] > 0  # each case gathers and reduces
    if case in ("sharded", "lru"):  # the cache is too small for the step: chunks are gathered again
        assert counts["all_gather"] > sum(c.sharded for c in plan.chunks)
    for rank, r in enumerate(got):
        issued = {k: r["issued"].get(k, 0) for k in counts}
        assert issued == counts, (case, rank, issued, counts)
        h = r["held"]  # after backward: shards, masters, shard gradients, and the state from step 1
        ledger = h["shard_bytes"] + h["master_bytes"] + h["shard_grad_bytes"] + h["optimizer_state_bytes"]
        assert ledger == _held(plan, rank), (case, rank, ledger, _held(plan, rank), h)


def test_the_rules_the_runtime_and_the_search_share():
    """What each rule says, against the runtime's own decisions on a chunk spec."""
    from elixir.chunk import ChunkSpec
    from elixir.chunk.storage import master_is_shard

    for world in (1, 2):
        for sharding in Sharding:
            for shard in (Placement.DEVICE, Placement.HOST):
                if not sharding.params_sharded and shard is not Placement.DEVICE:
                    continue
                kept = resident_sharding(sharding, shard, world)
                spec = ChunkSpec(index=0, capacity=64, sharding=kept, layout=world, rank=0, shard_placement=shard,
                                 optim_placement=Placement.HOST)
                c = collectives(sharding, world, shard)
                assert c.publishes == spec.publishes
                assert c.gathers_per_use == spec.sharded
    for dtype, master in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        for shard, optim in ((Placement.DEVICE, Placement.DEVICE), (Placement.HOST, Placement.HOST),
                             (Placement.DEVICE, Placement.HOST), (Placement.HOST, Placement.DISK)):
            spec = ChunkSpec(index=0, capacity=64, sharding=Sharding.SHARDED, layout=2, rank=0, dtype=dtype,
                             shard_placement=shard, optim_placement=optim, master_dtype=master)
            assert master_is_shard(spec) == master_shares_shard(dtype, master, shard, optim)
            assert master_is_shard(spec) == (dtype == master and shard is optim and optim is not Placement.DISK)
    # a shared master holds no bytes of its own: an fp32 shard on the device holds its value,
    # gradient and state; a bf16 one its value and an fp32 master beside them
    for dtype in (torch.float32, torch.bfloat16):
        e = torch.empty((), dtype=dtype).element_size()
        master = 0 if dtype == torch.float32 else 4
        assert held_bytes(10, 10, dtype, Placement.DEVICE, Placement.DEVICE, 4, 8) == (10 * (e + master + 4 + 8), 0, 0)


def _jobs(world: int) -> dict[str, Job]:
    return {case: Job(_worker, (case,)) for case in CASES}


@pytest.fixture(scope="module")
def launched() -> Launches:
    return Launches(_jobs, timeout=600)
