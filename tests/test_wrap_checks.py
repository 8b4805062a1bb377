"""What ElixirModule checks when it wraps a model: plans given by path, the same plan on every rank,
and trainable parameters of dtypes a chunk cannot hold (issue 20, items 6-8)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import default_optimizer
from elixir.testing.zoo import ZOO
from elixir.wrapper import ElixirModule, ElixirOptimizer, PlanMismatch


def _train(em: ElixirModule, zc, steps: int = 2) -> list[float]:
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    losses = []
    for s in range(steps):
        loss = zc.loss(em, zc.make_batch(4, s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_plan_given_by_path_trains_like_the_plan_object(tmp_path):
    zc = ZOO["tied"]
    torch.manual_seed(0)
    model = zc.build()
    plan = minimum_waste_search(model, 1)
    path = tmp_path / "plan.json"
    plan.save(path)
    torch.manual_seed(0)
    by_object = _train(ElixirModule(zc.build(), plan), zc)
    torch.manual_seed(0)
    by_str = _train(ElixirModule(zc.build(), str(path)), zc)
    torch.manual_seed(0)
    em = ElixirModule(zc.build(), path)  # a pathlib.Path too
    assert em.plan == plan
    assert by_str == by_object


def test_a_plan_of_the_wrong_type_is_a_clear_type_error():
    model = ZOO["tied"].build()
    with pytest.raises(TypeError, match="SearchResult.*path"):
        ElixirModule(model, {"chunks": []})


def test_readme_documents_loading_a_plan_file():
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "SearchResult.load" in readme and "elixir plan" in readme and "--out" in readme


class _ComplexFilter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.filter = nn.Parameter(torch.randn(8, dtype=torch.complex64))

    def forward(self, x):
        return self.proj(x) * self.filter.abs()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64])
def test_trainable_param_of_unsupported_dtype_is_refused_at_wrap_time(dtype):
    """Such a parameter used to be cast to float32 silently, and forward then failed with a dtype
    mismatch far from the cause; the error now names the parameter and the fix at wrap time."""
    model = _ComplexFilter()
    model.filter = nn.Parameter(torch.randn(8, dtype=dtype))
    plan = minimum_waste_search(model, 1)
    with pytest.raises(TypeError, match=r"filter \(torch\.(complex64|float64)\).*requires_grad=False"):
        ElixirModule(model, plan)
    model.filter.requires_grad_(False)  # frozen: not chunked, so allowed
    em = ElixirModule(model, minimum_waste_search(model, 1))
    assert em(torch.randn(2, 8)).shape == (2, 8)


def _different_plans() -> str:
    """Rank 1 holds a plan with one more cache block than ranks 0 and 2."""
    zc = ZOO["tied"]
    torch.manual_seed(0)
    model = zc.build()
    plan = minimum_waste_search(model, edist.get_world_size())
    if edist.get_rank() == 1:
        plan = dataclasses.replace(plan, cache_blocks=plan.cache_blocks + 1)
    plan = dataclasses.replace(plan, info={"search_time_s": float(edist.get_rank())})  # timings may differ
    try:
        ElixirModule(model, plan)
    except PlanMismatch as e:
        return str(e)
    return ""


@pytest.mark.dist
def test_ranks_holding_different_plans_all_raise_naming_the_ranks():
    errors = run_distributed(_different_plans, 3, timeout=120)
    for rank, msg in enumerate(errors):
        assert "different plans" in msg, (rank, msg)
        assert "ranks 0, 2:" in msg and "ranks 1:" in msg, (rank, msg)
        assert f"this is rank {rank}" in msg, (rank, msg)


def _same_plan_apart_from_timings() -> list[float]:
    zc = ZOO["tied"]
    torch.manual_seed(0)
    model = zc.build()
    plan = minimum_waste_search(model, edist.get_world_size())
    plan = dataclasses.replace(plan, info={"search_time_s": float(edist.get_rank())})
    em = ElixirModule(model, plan)
    return [em.world_size]


@pytest.mark.dist
def test_plans_differing_only_in_search_timings_agree():
    assert run_distributed(_same_plan_apart_from_timings, 2, timeout=120) == [[2], [2]]
