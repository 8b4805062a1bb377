"""The mesh layout (issue 30, step 1): a plan carries the layout it was made for, the runtime takes
its groups from it, and a one-axis layout is today's data parallelism bit for bit.

- layout arithmetic: coordinates, groups along each axis, JSON, aliases and bad input;
- a plan records its layout; plans written before layouts load as data parallel;
- a plan used on another layout is refused, naming both;
- the searches and the runtime refuse axes they do not run yet (pipeline, replica; tensor for optimal_search);
- at world 2, ElixirModule given a one-axis ``DeviceMesh`` trains bit for bit as given the
  process group, and a mesh with a tensor axis but a model with no DTensor parameter is refused on every rank.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from elixir import distributed as edist
from elixir.plan import AXES, LayoutMismatchError, MeshLayout, SearchResult
from elixir.search import minimum_waste_search, optimal_search
from elixir.testing import run_distributed
from elixir.testing.zoo import ZOO
from elixir.wrapper import ElixirModule, ElixirOptimizer, PlanMismatch

ZC = ZOO["gpt2"]


def test_coordinates_are_row_major_in_axis_order():
    lay = MeshLayout(pp=2, dp_replicate=1, dp_shard=3, tp=2)
    assert lay.world_size == 12 and lay.dp_size == 3 and lay.shape == (2, 1, 3, 2)
    seen = set()
    for r in range(lay.world_size):
        c = lay.coordinates(r)
        assert list(c) == list(AXES) and lay.rank_at(c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == 12
    # tp innermost: a tensor-parallel group is adjacent ranks; pp outermost
    assert lay.axis_ranks("tp", 5) == (4, 5)
    assert lay.axis_ranks("dp_shard", 5) == (1, 3, 5)
    assert lay.axis_ranks("pp", 5) == (5, 11)
    for axis in AXES:
        groups = lay.axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(12)), axis
        assert all(len(g) == getattr(lay, axis) for g in groups)


def test_layout_json_aliases_and_bad_input():
    lay = MeshLayout.of({"pp": 2, "dp": 4})
    assert lay == MeshLayout(pp=2, dp_shard=4) and MeshLayout.from_json(json.loads(json.dumps(lay.to_json()))) == lay
    assert MeshLayout.of(3) == MeshLayout(dp_shard=3) and MeshLayout.of(3).is_data_parallel
    assert not lay.is_data_parallel and lay.describe() == "pp 2 x dp_shard 4"
    with pytest.raises(ValueError, match="unknown mesh axis 'cp'; elixir's axes are pp, dp_replicate, dp_shard, tp"):
        MeshLayout.of({"cp": 2})
    with pytest.raises(ValueError, match="dp_shard given twice"):
        MeshLayout.of({"dp": 2, "dp_shard": 2})
    with pytest.raises(ValueError, match="mesh axis tp must be a positive int, got 0"):
        MeshLayout(tp=0)
    with pytest.raises(ValueError, match="rank 8 is outside a mesh of 8 ranks"):
        MeshLayout(dp_shard=8).coordinates(8)


def test_plan_records_its_layout_and_old_plans_load_as_data_parallel(tmp_path):
    sr = minimum_waste_search(ZC.build(), 2)
    assert sr.layout == MeshLayout(dp_shard=2)
    sr.save(tmp_path / "plan.json")
    d = json.loads((tmp_path / "plan.json").read_text())
    assert d["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert SearchResult.load(tmp_path / "plan.json") == sr
    del d["layout"]  # a plan written before layouts
    assert SearchResult.from_json(d).layout == MeshLayout(dp_shard=2)
    with pytest.raises(ValueError, match="world_size 2 is not the dp_shard axis of its layout"):
        dataclasses.replace(sr, layout=MeshLayout(dp_shard=4))


def test_plan_on_another_layout_is_refused_naming_both():
    model = ZC.build()
    sr = minimum_waste_search(model, 4)
    with pytest.raises(PlanMismatch, match=r"made for a mesh of dp_shard 4 \(4 ranks\) but this run is a single rank"):
        ElixirModule(model, sr)
    with pytest.raises(LayoutMismatchError, match=r"pp 2 x dp_shard 2 \(4 ranks\) but this run is a mesh of dp_shard 4"):
        MeshLayout(pp=2, dp_shard=2).require_same(MeshLayout(dp_shard=4), "the plan", "re-plan")


def test_searches_refuse_axes_they_do_not_plan_yet():
    model = ZC.build()
    with pytest.raises(NotImplementedError, match="runs on a mesh of one dp_shard axis; this mesh is dp_shard 2 x tp 2"):
        optimal_search(model, MeshLayout(dp_shard=2, tp=2))
    with pytest.raises(NotImplementedError, match="plans dp_shard and tp axes; this mesh is pp 2 x dp_shard 2"):
        minimum_waste_search(model, MeshLayout(pp=2, dp_shard=2))
    by_layout = minimum_waste_search(model, MeshLayout(dp_shard=2))
    assert dataclasses.replace(by_layout, info={}) == dataclasses.replace(minimum_waste_search(model, 2), info={})


def _mesh_worker():
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = edist.get_rank(), edist.get_world_size()
    out = {}
    for how in ("group", "mesh"):
        torch.manual_seed(0)
        model = ZC.build()
        sr = minimum_waste_search(model, world)
        kw = {"mesh": init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))} if how == "mesh" else {}
        em = ElixirModule(model, sr, **kw)
        opt = ElixirOptimizer(em, torch.optim.SGD(em.parameters(), lr=0.1))
        losses = []
        for step in range(3):
            loss = ZC.step_fn(em, ZC.make_batch(2, 100 * step + rank))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[how] = (losses, {k: v.clone() for k, v in em.state_dict().items()})
    try:
        ElixirModule(ZC.build(), minimum_waste_search(ZC.build(), 1),
                     mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp")))
        refused = ""
    except ValueError as e:  # a tensor axis, but no DTensor parameter to run on it
        refused = str(e)
    same = out["group"][0] == out["mesh"][0] and all(
        torch.equal(out["group"][1][k], out["mesh"][1][k]) for k in out["group"][1])
    return {"same": same, "losses": out["mesh"][0], "refused": refused}


@pytest.mark.dist
def test_one_axis_device_mesh_is_the_process_group_bit_for_bit():
    res = run_distributed(_mesh_worker, 2, timeout=240)
    for r in res:
        assert r["same"], r
        assert "the mesh has a tensor axis of 2 ranks, but the model has no DTensor parameter" in r["refused"], r
        assert "elixir.parallel.tensor_parallel(model, mesh)" in r["refused"]
