"""The search's pruning (issue 35): lower bounds skip candidates, never change what it picks.

Each check compares the pruned search with the full scan (``_Searcher.run(prune=False)``) on the
same profile and budgets: the winner, the runner-ups, the tied alternative and whether the budgets
ruled anything out (which decides whether the leaner configuration is tried) are the same.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elixir.hardware import load_profile
from elixir.search.bounds import memory_floor, step_time_floor
from elixir.search.cost_model import MemoryPolicy, replicate, simulate_layout
from elixir.search.optimal import (
    Budgets,
    DoesNotFitError,
    SearchRequest,
    _runner_ups,
    _Searcher,
    _tied_alternative,
    search_profile,
)
from elixir.search.step_profile import profile_from_module
from tests.search_cases import layer_stacks
from tests.search_cases import tiny_gpt as _tiny_gpt

HW = load_profile("cpu-box")
POLICY = MemoryPolicy()


def _both(prof, world, budgets, **kw):
    """(pruned, full) outcomes of one search: the evaluations that decide the report, or None."""
    out = []
    for prune in (True, False):
        s = _Searcher(SearchRequest(prof, world, HW, Budgets(*budgets), "adam", True, POLICY, None, **kw))
        try:
            best, results, _ = s.run(prune=prune)
        except DoesNotFitError:
            out.append((None, s))
            continue
        out.append(((best, _runner_ups(results, 5), _tied_alternative(s, best, results), s.rejected > 0), s))
    return out


def _assert_same(prof, world, budgets, **kw):
    (pruned, sp), (full, sf) = _both(prof, world, budgets, **kw)
    assert pruned == full
    return sp, sf


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prof=layer_stacks(), world=st.sampled_from([2, 4]), dev=st.integers(20_000, 400_000),
       host=st.integers(50_000, 2_000_000), disk=st.sampled_from([0, 1 << 30]), fused=st.booleans())
def test_pruned_search_picks_what_the_full_scan_picks(prof, world, dev, host, disk, fused):
    kw = dict(grad_dtype="bfloat16", fused_step=True) if fused and prof.dtype == "bfloat16" else {}
    _assert_same(prof, world, (dev, host, disk), **kw)


@pytest.mark.parametrize("world", [2, 4])
def test_pruning_skips_pricing_on_a_gpt_and_keeps_the_plan(world):
    prof = profile_from_module(_tiny_gpt(), activation_bytes=1 << 18, tokens=32)
    priced = []
    for budgets in ((1 << 30, 1 << 30, 0), (3 << 18, 1 << 20, 1 << 30), (6 << 20, 6 << 20, 0)):
        sp, sf = _assert_same(prof, world, budgets)
        priced.append((sp.priced, sf.priced))
    assert all(p <= f for p, f in priced) and any(p < f for p, f in priced)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prof=layer_stacks(), world=st.sampled_from([2, 4]), dev=st.integers(20_000, 400_000),
       host=st.integers(50_000, 2_000_000), disk=st.sampled_from([0, 1 << 30]))
def test_step_time_floor_is_below_every_priced_candidate(prof, world, dev, host, disk):
    s = _Searcher(SearchRequest(prof, world, HW, Budgets(dev, host, disk), "adam", True, POLICY, None))
    try:
        _, results, _ = s.run(prune=False)
    except DoesNotFitError:
        return
    for ev in results:
        lay = s.layout(ev.chunk_size, ev.shard_shared, ev.zero)
        if s.layout_of(ev) is not lay:  # the fully replicated twin: priced apart, never pruned
            assert replicate(prof, lay).n_sharded == 0
            continue
        floor = step_time_floor(prof, lay, s.setting, ev.prefetch_depth, simulate_layout(lay, ev.blocks))
        assert floor <= ev.step_time * (1 + 1e-12)


def test_a_budget_below_the_memory_floor_is_refused_before_pricing():
    prof = profile_from_module(_tiny_gpt(), activation_bytes=64 << 20, tokens=32)
    s = _Searcher(SearchRequest(prof, 2, HW, Budgets(32 << 20, 1 << 30), "adam", True, POLICY, None))
    assert memory_floor(prof, s.setting)[0] > s.usable[0]
    with pytest.raises(DoesNotFitError, match="activations alone need"):
        s.run()
    assert s.priced == 0
    # and the diagnostics still name the change that fits, each checked by a search
    with pytest.raises(DoesNotFitError) as e:
        search_profile(prof, 2, hardware=HW, device_memory=32 << 20, host_memory=1 << 30)
    need = e.value.needs.get("device_memory") or e.value.needs.get("memory")
    assert need and need > 64 << 20
    search_profile(prof, 2, hardware=HW, device_memory=need, host_memory=max(need, 1 << 30))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prof=layer_stacks(), world=st.sampled_from([2, 4]), dev=st.integers(20_000, 400_000),
       host=st.integers(50_000, 2_000_000), disk=st.sampled_from([0, 1 << 30]))
def test_fastest_below_finds_the_full_scans_winner_when_it_is_faster(prof, world, dev, host, disk):
    """The report's unconstrained search (``run(fastest_below=...)``: a global bound, layouts
    skipped by their floor at the most blocks) finds the full scan's winner whenever that beats
    the bound, and refuses exactly when nothing does."""
    free = _Searcher(SearchRequest(prof, world, HW, Budgets(1 << 60, 1 << 60, disk), "adam", True, MemoryPolicy(0.0, 0.0, 0.0), None))
    full, _, _ = free.run(prune=False)
    try:
        budgeted, _, _ = _Searcher(SearchRequest(prof, world, HW, Budgets(dev, host, disk), "adam", True, POLICY, None)).run()
        bound = budgeted.step_time
    except DoesNotFitError:
        bound = full.step_time * 1.5
    for b in (bound, full.step_time * (1 + 1e-12)):
        fast = _Searcher(SearchRequest(prof, world, HW, Budgets(1 << 60, 1 << 60, disk), "adam", True,
                         MemoryPolicy(0.0, 0.0, 0.0), None))
        got, _, _ = fast.run(fastest_below=b)
        assert got.step_time == full.step_time
    with pytest.raises(DoesNotFitError):
        free.run(fastest_below=full.step_time * (1 - 1e-6))


def test_a_refusal_on_a_one_gpu_profile_names_its_changes_instead_of_crashing():
    """A profile without collective measurements (one GPU) cannot price more ranks: the
    diagnostics used to try world sizes 2, 4, ... on it and crash with the profile's ValueError
    (`elixir plan opt-175b --world-size 1 --device-memory 8GiB --host-memory 16GiB`)."""
    hw = load_profile("1x24GB-workstation")
    assert hw.reduce_scatter is None
    prof = profile_from_module(_tiny_gpt(), activation_bytes=64 << 20, tokens=32)
    with pytest.raises(DoesNotFitError) as e:
        search_profile(prof, 1, hardware=hw, device_memory=32 << 20, host_memory=1 << 30)
    assert "world_size" not in e.value.needs and e.value.needs.get("device_memory", 0) > 64 << 20
