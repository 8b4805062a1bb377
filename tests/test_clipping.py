"""Global-norm clipping: ElixirOptimizer.clip_grad_norm_ (and the ``max_norm`` option) against
``torch.nn.utils.clip_grad_norm_`` on the unwrapped model, at worlds 1, 2 and 4, for L2 and inf
norms, on models with tied parameters (a replicated chunk), a plan that replicates ordinary
parameters, a parameter used twice and a parameter without gradient (each counted exactly once).

The reference sums the per-rank batch slices' gradients in the order data-parallel ranks do, so
the comparison isolates clipping from reduction-order rounding; SGD keeps the update linear in
the clipped gradient, so parameters are compared at the same rtol as the norms (1e-6)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elixir import distributed as edist
from elixir.search import Sharding, minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import shard_batch
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer
from tests.chunk_kinds import with_kinds

STEPS = 3
BATCH = 4
MAX_NORM = {2.0: 0.02, float("inf"): 0.002}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    norm_type: float
    replicate_first: bool = False  # force the first sharded chunk to be replicated
    via_ctor: bool = False  # clip with ElixirOptimizer(max_norm=...) instead of clip_grad_norm_
    kinds: str = ""  # "zero2": every chunk ZeRO-2; "mixed": chunks cycle sharded/zero2/zero1/replicated

    @property
    def label(self) -> str:
        return (f"{self.model}-L{self.norm_type}{'-replicated' if self.replicate_first else ''}"
                f"{'-ctor' if self.via_ctor else ''}{'-' + self.kinds if self.kinds else ''}")


CASES = [
    Case("gpt2", 2.0), Case("gpt2", float("inf")),
    Case("tied", 2.0), Case("tied", float("inf"), via_ctor=True),
    Case("shared", 2.0, replicate_first=True), Case("llama", float("inf"), replicate_first=True),
    Case("routed", 2.0, via_ctor=True),
    # per-chunk ZeRO stage: each rank's norm part is its slice of a ZeRO-1/2 chunk, counted once
    Case("tied", 2.0, kinds="zero2"), Case("shared", float("inf"), via_ctor=True, kinds="mixed"),
    Case("gpt2", 2.0, kinds="mixed"),
]

def _plan(model, world: int, replicate_first: bool, kinds: str = ""):
    sr = with_kinds(minimum_waste_search(model, world), kinds)
    if not replicate_first:
        return sr
    chunks = list(sr.chunks)
    i = next(i for i, c in enumerate(chunks) if c.sharded)
    chunks[i] = dataclasses.replace(chunks[i], sharding=Sharding.REPLICATED, chunk_size=chunks[i].used)
    sharded = sum(c.sharded for c in chunks)
    return dataclasses.replace(sr, chunks=tuple(chunks), cache_blocks=min(sr.cache_blocks, sharded))


def _run_case(case: Case) -> dict:
    rank, world = edist.get_rank(), edist.get_world_size()
    zc = ZOO[case.model]
    model = build_model(case.model)
    em = ElixirModule(model, _plan(model, world, case.replicate_first, case.kinds))
    max_norm = MAX_NORM[case.norm_type]
    kw = dict(max_norm=max_norm, norm_type=case.norm_type) if case.via_ctor else {}
    opt = ElixirOptimizer(em, sgd([p for p in em.parameters() if p.requires_grad]), **kw)
    norms = []
    replicated = sum(not c.spec.sharded for c in em.chunks)
    for step in range(STEPS):
        opt.zero_grad()
        zc.loss(em, shard_batch(zc.make_batch(BATCH, step), rank, world)).backward()
        if not case.via_ctor:
            norms.append(opt.clip_grad_norm_(max_norm, case.norm_type).item())
        opt.step()
    return {"norms": norms, "state": em.state_dict(rank0_only=True), "replicated": replicated}


def cases_for(world: int) -> list[Case]:
    """Hugging Face models up to world 2 (importing transformers in 4 ranks on 2 cores costs more
    than the cases are worth); the toys, which carry the tied/replicated/unused cases, everywhere."""
    return [c for c in CASES if world <= 2 or c.model not in ("gpt2", "llama")]


def _worker(cases):
    return [_run_case(c) for c in cases]


def _reference(case: Case, world: int) -> dict:
    zc = ZOO[case.model]
    model = build_model(case.model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = sgd(params)
    norms = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        batch = zc.make_batch(BATCH, step)
        for r in range(world):  # data-parallel summation order (each loss / world: exact, power of 2)
            (zc.loss(model, shard_batch(batch, r, world)) / world).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM[case.norm_type], case.norm_type).item())
        opt.step()
    return {"norms": norms, "state": model.state_dict()}


def _check(results, world: int) -> list[str]:
    errs = []
    for case, got in zip(cases_for(world), results):
        ref = _reference(case, world)
        if not all(n > MAX_NORM[case.norm_type] for n in ref["norms"]):
            errs.append(f"{case.label}: reference norms {ref['norms']} do not all trigger clipping")
        if case.replicate_first or case.model in ("gpt2", "tied"):
            if got["replicated"] == 0:
                errs.append(f"{case.label}: expected a replicated chunk")
        for a, b in zip(got["norms"], ref["norms"]):
            if abs(a - b) > 1e-6 * abs(b):
                errs.append(f"{case.label}: norm {a} vs torch {b} (rel {abs(a - b) / b:.2g})")
        for k, v in ref["state"].items():
            mine = got["state"][k]
            if not torch.allclose(mine, v, rtol=1e-6, atol=1e-7):
                errs.append(f"{case.label}: {k} differs by {(mine - v).abs().max().item():.3g}")
    return errs


def test_clip_world1():
    errs = _check(_worker(cases_for(1)), 1)
    assert not errs, "\n".join(errs)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_clip_multi_rank(world):
    cases = cases_for(world)
    res = run_distributed(_worker, world, cases, timeout=300)
    errs = _check(res[0], world)
    for r in range(1, world):
        for case, a, b in zip(cases, res[0], res[r]):
            if a["norms"] != b["norms"]:
                errs.append(f"{case.label}: rank {r} norms {b['norms']} != rank 0 {a['norms']}")
    assert not errs, "\n".join(errs)


def test_bad_norm_type():
    model = build_model("shared")
    em = ElixirModule(model, minimum_waste_search(model, 1))
    opt = ElixirOptimizer(em, sgd(em.parameters()))
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, -1.0)
