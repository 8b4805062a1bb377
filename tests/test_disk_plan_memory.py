"""The predicted host bytes of disk plans against what the runtime really stages (issue 21).

A plan whose chunks keep their optimizer state on disk (``DK``; at world size 1 the shard is then
the resident chunk) or everything on disk (``KK``) holds, on the host, only what it stages: the
model's construction (a chunk-sized fp32 flat and one initialisation unit's values), then, in
training, the masters + moments of the disk chunks being streamed and the disk shards being read.
The prediction must cover the larger of the two without adding them: they never coexist (the
construction's staging is freed, and with disk chunks malloc gives it back, before the first step).
Counting both over-predicted measured peak RSS by two fp32 chunks (0.84 at a 0.44B plan with every
chunk on disk, 0.86 at 5.2B). The figures compared here are the runtime's own byte counts (the disk
stores' peak staged bytes, the materializer's), which are deterministic, not RSS.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elixir.hardware import load_profile
from elixir.optim import CPUAdam
from elixir.search import minimum_waste_search
from elixir.search.cost_model import Setting, evaluate_plan
from elixir.search.plan import Placement
from elixir.search.step_profile import profile_from_module
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer

MODEL = "llama"


def _plan(model, shard: Placement, prefetch: bool = False):
    case = ZOO[MODEL]
    # traced, so that the runtime can follow the plan's order and gather ahead
    plan = minimum_waste_search(model, 1, prefetch=prefetch, inp=case.make_batch(4, 0), step_fn=case.step_fn) \
        if prefetch else minimum_waste_search(model, 1)
    chunks = tuple(dataclasses.replace(c, optim_placement=Placement.DISK, shard_placement=shard) for c in plan.chunks)
    extra = dict(cache_blocks=len(chunks), prefetch_depth=2) if prefetch else {}  # room to gather ahead
    return dataclasses.replace(plan, chunks=chunks, grad_dtype="bfloat16", fused_step=True, **extra)


def _measure(plan, tmp_path, prefetch: bool = False) -> dict:
    with torch.device("meta"):
        model = build_model(MODEL)
    em = ElixirModule(model, plan, dtype=torch.bfloat16, offload_dir=str(tmp_path), prefetch=prefetch)
    # what construction staged at once: the fp32 flat a chunk is assembled in, and one unit's values
    construction = max(c.chunk_size for c in plan.chunks) * 4 + em.materializer.peak_staged_bytes
    eo = ElixirOptimizer(em, CPUAdam(list(em.parameters()), lr=1e-3))
    assert eo.backward_step is not None  # the plan's fused backward-and-step
    case = ZOO[MODEL]
    for step in range(2):
        eo.zero_grad()
        case.loss(em, case.make_batch(4, step)).backward()
        eo.step()
    stores = em.offload_stores
    out = {"construction": construction,
           "staged": sum(s.peak_staged_bytes for s in stores) + sum(getattr(s, "read_buffer_bytes", 0) for s in stores),
           "shard_staged": sum(s.peak_staged_bytes for s in (em.shard_store, em.derived_shards) if s is not None),
           "one_shard": max(c.spec.shard_numel for c in em.chunks) * 2, "prefetches": em.cache.prefetches,
           # the two fp32 buffers a KK shard's derivation reads its master through, held once used
           "read_buffers": em.derived_shards.read_buffer_bytes if em.derived_shards is not None else 0}
    for s in stores:
        s.close()
    return out


@pytest.mark.parametrize("shard,prefetch", [(Placement.DEVICE, False), (Placement.DISK, False), (Placement.DISK, True)],
                         ids=["DK", "KK", "KK-prefetch"])
def test_disk_plan_host_prediction_is_its_staging_not_staging_plus_construction(shard, prefetch, tmp_path):
    with torch.device("meta"):
        model = build_model(MODEL)
    plan = _plan(model, shard, prefetch)
    st = Setting(world=1, elem=2, reduce_elem=2, opt_bytes=8, hardware=load_profile("cpu-box"), dtype="bfloat16")
    ev = evaluate_plan(profile_from_module(model), plan, st)  # process_bytes 0: only elixir's own bytes
    got = _measure(plan, tmp_path, prefetch)
    # fused step: no shard gradient is kept, so a disk plan's host bytes are all staging (a KK
    # chunk keeps nothing resident; a DK one at world size 1 keeps its shard as the device part)
    assert ev.memory["placed_host"] == 0 and ev.memory["staging"] == ev.host_bytes
    predicted = ev.host_bytes
    assert got["construction"] <= predicted, (got, predicted)
    assert got["staged"] <= predicted, (got, predicted)
    # within 10% of what the stores really held at most (before: construction + staging, 1.33x
    # the staging for DK, 1.38x for KK)
    assert predicted <= 1.1 * got["staged"], (got, predicted)
    if shard is Placement.DISK:
        # one disk shard staged at a time, as priced, also when chunks are gathered ahead (a
        # prefetched chunk's staged shard used to wait for its use beside the one a step staged)
        assert got["shard_staged"] == got["one_shard"] and got["read_buffers"] > 0, got
        assert (got["prefetches"] > 0) == prefetch, got
