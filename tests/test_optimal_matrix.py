"""Plans from optimal_search pass the runtime's correctness matrix (tests/test_runtime.py), with the
search swapped: each case runs under an ample budget (everything on device, many blocks) and under
the tightest budget that fits (host placement, fewest blocks), with the budget enforced by the
runtime's own accounting."""


import pytest

from elixir import distributed as edist
from elixir.hardware import load_profile
from elixir.search import DoesNotFitError, optimal_search
from elixir.testing import run_distributed
from elixir.testing.reference import train_wrapped
from elixir.wrapper import ElixirModule, ElixirOptimizer
from tests.matrix_cases import BATCH, CASES, STEPS, Case, build, compare, opt_fn

HW = load_profile("cpu-box")


def _plan(case: Case, model, world: int, tight: bool):
    zc = CASES[case.model]
    kw = dict(hardware=HW, host_memory=1 << 30, overlap=case.prefetch)
    if case.prefetch or tight:  # a tight budget needs the traced step (activations, recomputation)
        kw.update(inp=zc.make_batch(BATCH // world, 0), step_fn=zc.step_fn)
    if not tight:
        return optimal_search(model, world, device_memory=1 << 30, **kw), None
    try:
        optimal_search(model, world, device_memory=1, **kw)
        raise AssertionError("a 1-byte budget fitted")
    except DoesNotFitError as e:
        need = e.needs["device_memory"]
    plan = optimal_search(model, world, device_memory=need, **kw)
    usable = plan.info["usable_after_margins"]["device"]
    mem = plan.info["predicted_memory"]
    mv = sum((c.chunk_size // world if c.sharded else c.chunk_size) * 8
             for c in plan.chunks if c.optim_placement.value == "device")
    return plan, usable - mem["activations"] - mem["buffers"] - mv  # the runtime's share of the budget


def _train(case: Case, tight: bool) -> dict:
    zc = CASES[case.model]
    rank, world = edist.get_rank(), edist.get_world_size()
    model = build(case)
    plan, limit = _plan(case, model, world, tight)
    em = ElixirModule(model, plan, prefetch=case.prefetch, memory_limit=limit)
    em.train()
    opt = ElixirOptimizer(em, opt_fn(case)([p for p in em.parameters() if p.requires_grad]))
    run = train_wrapped(zc, em, opt, steps=STEPS, batch_size=BATCH)
    losses, grads = run.losses, run.first_grads
    placements = sorted({(c.shard_placement.value, c.optim_placement.value) for c in plan.chunks if c.sharded})
    return {
        "losses": losses, "grads": grads if rank == 0 else None, "state": em.state_dict(rank0_only=True),
        "memory": em.memory_report(), "warnings": run.warnings,
        "placements": placements, "blocks": plan.cache_blocks,
    }


def _worker(cases: list) -> list:
    return [_train(c, tight) for c, tight in cases]


def _cases(world: int) -> list:
    names = ["gpt2", "opt", "llama", "bert", "tied", "frozen", "routed", "shared", "convnet"]
    if world == 1:
        names.append("buffers")
    out = []
    for i, n in enumerate(names):
        out.append((Case(n, prefetch=bool(i % 2)), False))
        out.append((Case(n, prefetch=not bool(i % 2)), True))
    out.append((Case("gpt2", True, "nonreentrant"), True))
    out.append((Case("llama", False, "reentrant"), True))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_optimal_plans_match_the_reference(world):
    cases = _cases(world)
    results = run_distributed(_worker, world, cases, timeout=600)
    errors = []
    for (case, tight), got in zip(cases, results[0]):
        errors += [f"{'tight' if tight else 'ample'} {e}" for e in compare(case, got, world)]
    assert not errors, "\n".join(errors)
    # the tight budgets really moved state to the host somewhere
    tight_places = {p for (c, tight), got in zip(cases, results[0]) if tight for p in got["placements"]}
    assert any(s == "host" or o == "host" for s, o in tight_places), tight_places


def _fast_all_reduce():
    """cpu-box with an all-reduce ten times faster than a reduce-scatter plus an all-gather, so that
    replicating every chunk (data parallel) is the fastest plan wherever memory allows it."""
    import dataclasses

    from elixir.hardware import BandwidthCurve

    rs = HW.reduce_scatter
    return dataclasses.replace(HW, all_reduce=BandwidthCurve(rs.sizes, tuple(20 * b for b in rs.bytes_per_s)))


def _train_replicated(case: Case) -> dict:
    zc = CASES[case.model]
    rank, world = edist.get_rank(), edist.get_world_size()
    model = build(case)
    plan = optimal_search(model, world, hardware=_fast_all_reduce(), device_memory=1 << 30, host_memory=1 << 30,
                          inp=zc.make_batch(BATCH // world, 0), step_fn=zc.step_fn)
    em = ElixirModule(model, plan, prefetch=case.prefetch)
    opt = ElixirOptimizer(em, opt_fn(case)([p for p in em.parameters() if p.requires_grad]))
    run = train_wrapped(zc, em, opt, steps=STEPS, batch_size=BATCH)
    return {"losses": run.losses, "grads": run.first_grads if rank == 0 else None,
            "state": em.state_dict(rank0_only=True), "memory": em.memory_report(), "warnings": run.warnings,
            "sharded": sum(c.sharded for c in plan.chunks)}


def _worker_replicated(cases: list) -> list:
    return [_train_replicated(c) for c in cases]


@pytest.mark.dist
def test_replicated_plans_match_the_reference():
    """Where all-reduce is cheap and memory ample, the search replicates every chunk; the runtime
    then trains exactly like the reference (tied, frozen and routed parameters included)."""
    cases = [Case("gpt2", prefetch=True), Case("tied", prefetch=False), Case("frozen", prefetch=True),
             Case("routed", prefetch=False)]
    results = run_distributed(_worker_replicated, 2, cases, timeout=600)
    errors = []
    for case, got in zip(cases, results[0]):
        assert got["sharded"] == 0, (case, got["sharded"])
        errors += compare(case, got, 2)
    assert not errors, "\n".join(errors)
    # and with too little memory to replicate, the same search shards
    from elixir.testing.zoo import build_model

    m = build_model("gpt2")
    try:
        optimal_search(m, 2, hardware=_fast_all_reduce(), device_memory=1, host_memory=1 << 30)
        raise AssertionError("a 1-byte budget fitted")
    except DoesNotFitError as e:
        need = e.needs["device_memory"]
    tight = optimal_search(m, 2, hardware=_fast_all_reduce(), device_memory=need, host_memory=1 << 30)
    assert any(c.sharded for c in tight.chunks)
