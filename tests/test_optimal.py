"""optimal_search: terminates, respects budgets, raises exactly when nothing fits, explains itself."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elixir.hardware import load_profile
from elixir.plan import MeshLayout, Placement, SearchResult
from elixir.plan.placement import DD, DH, DK, HH, HK, KK
from elixir.search.cost_model import (
    MemoryPolicy,
    Setting,
    fixed_device_bytes,
    layout_from_plan,
    pack,
    per_chunk_bytes,
    place,
    price,
    replicated_optimizer_bytes,
    simulate_layout,
    transient_host_bytes,
    unified_memory,
    zero_chunk_bytes,
)
from elixir.search.optimal import (
    DoesNotFitError,
    chunk_size_candidates,
    optimal_search,
    search_profile,
    zero_candidates,
)
from elixir.search.step_profile import BACKWARD, FORWARD, StepProfile
from tests.search_cases import disk_shard_evaluation, layer_stacks, ramped_stack
from tests.search_cases import tiny_gpt as _tiny_gpt

HW = load_profile("cpu-box")
POLICY = MemoryPolicy()


def oracle_fits(profile: StepProfile, world: int, budgets: tuple[int, int, int]) -> bool:
    """Exhaustive: any chunk size, the fewest blocks, any count of each placement, and the
    search's counts of ZeRO-1/2 chunks (state on the device)."""
    dev, host, disk = POLICY.usable(*budgets)
    elem = 4 if profile.dtype == "float32" else 2
    stt = Setting(layout=MeshLayout.data_parallel(world), elem=elem, reduce_elem=elem, opt_bytes=8, hardware=HW, dtype=profile.dtype)
    types = [DD, DH, HH] + ([DK, HK, KK] if disk > 0 else [])
    tied_modes = (False, True) if profile.shared and world > 1 else (False,)
    layouts = [pack(profile, c, world, tied, z) for c, tied in itertools.product(chunk_size_candidates(profile, world), tied_modes)
               for z in zero_candidates(pack(profile, c, world, tied), world)]
    for lay in layouts:
        c = lay.chunk_size
        n = lay.n_sharded - lay.own  # sharded tied chunks stay DD, in the fixed bytes
        zd = sum(zero_chunk_bytes(stt, z, Placement.DEVICE)[0] for z in lay.zero_capacities)
        cb = per_chunk_bytes(stt, c // world if n else 0)
        # at world size 1 device shards stay whole and need no block: 0 blocks when all are there
        block_options = ([0] if world == 1 or not lay.n_sharded else []) + ([max(1, lay.min_blocks)] if lay.n_sharded else [])
        for blocks, rw in itertools.product(block_options, (Placement.DEVICE, Placement.HOST)):
            base = sum(fixed_device_bytes(profile, lay, stt, blocks).values()) + zd
            rd, rh = replicated_optimizer_bytes(lay, stt, rw)
            for counts in _compositions(n, len(types)):
                if blocks == 0 and any(k for k, t in zip(counts, types) if t.shard is not Placement.DEVICE):
                    continue
                d = base + rd + sum(k * cb[t][0] for k, t in zip(counts, types))
                h = rh + sum(k * cb[t][1] for k, t in zip(counts, types))
                k_disk = sum(k * cb[t][2] for k, t in zip(counts, types))
                # the construction's staging, or (never at once) the masters + state (and KK
                # shards) staged while the optimizer streams them
                n_disk = sum(k for k, t in zip(counts, types) if t.on_disk)
                h += transient_host_bytes(lay, stt, c // world, n_disk, sum(k for k, t in zip(counts, types) if t.shard_on_disk))
                # a CPU-only profile has one pool: the host budget holds device and host bytes
                if d <= dev and (d + h if unified_memory(HW) else h) <= host and k_disk <= disk:
                    return True
    # the sum of the terms is never below the pricing's peak, but on one pool the pricing credits
    # terms never live at once: a plan with every optimizer state on disk may fit by its rule alone.
    # Of those, the fewest bytes are every shard on disk, or none (each host shard adds its bytes;
    # the last disk shard takes its staging with it): the search's scan of every count in between
    # is checked on its own (test_disk_shard_scan_fills_the_pool_by_the_pricings_peak_...)
    return disk > 0 and any(_priced_fit(disk_shard_evaluation(profile, lay, stt, b, simulate_layout(lay, b), v, rw),
                                        (dev, host, disk))
                            for lay in layouts if lay.n_sharded - lay.own
                            for b in (max(1, lay.min_blocks),)
                            for rw in (Placement.DEVICE, Placement.HOST)
                            for v in (0, lay.n_sharded - lay.own))


def _priced_fit(ev, usable: tuple[int, int, int]) -> bool:
    """Whether a priced plan keeps to the usable budgets (one pool on a CPU profile)."""
    dev, host, disk = usable
    h = ev.device_bytes + ev.host_bytes if unified_memory(HW) else ev.host_bytes
    return ev.device_bytes <= dev and h <= host and ev.disk_bytes <= disk


def _compositions(n: int, parts: int):
    """Every tuple of ``parts`` counts >= 0 summing to ``n`` (what filtering ``product(range(n + 1),
    repeat=parts)`` by its sum gives, in the same order, without walking the (n + 1) ** parts others)."""
    if parts == 1:
        yield (n,)
        return
    for k in range(n + 1):
        for rest in _compositions(n - k, parts - 1):
            yield (k, *rest)


def _search(profile, world, budgets, **kw):
    kw.setdefault("fused_step", False)  # the oracle keeps every shard gradient (tests/test_grad_memory.py: the rest)
    kw.setdefault("grad_dtype", torch.float32)
    return search_profile(profile, world, hardware=HW, device_memory=budgets[0], host_memory=budgets[1],
                          disk=budgets[2], policy=POLICY, **kw)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layer_stacks(),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(0, 400_000),
    st.integers(0, 400_000),
    st.sampled_from([0, 0, 100_000, 10**9]),
)
def test_plans_respect_budgets_and_raise_exactly_when_nothing_fits(profile, world, dev, host, disk):
    budgets = (dev, host, disk)
    expected = oracle_fits(profile, world, budgets)
    try:
        r = _search(profile, world, budgets)
    except DoesNotFitError as e:
        assert not expected, "the search gave up although a configuration fits"
        # every suggested single change really fits
        for key, value in e.needs.items():
            if key == "device_memory":
                _search(profile, world, (value, host, disk))
            elif key == "host_memory":
                _search(profile, world, (dev, value, disk))
            elif key == "memory":  # one pool (CPU profile): device cap and host budget together
                _search(profile, world, (value, value, disk))
            elif key == "disk":
                _search(profile, world, (dev, host, value))
            elif key == "world_size":
                _search(profile, value, budgets)
        return
    # the oracle enumerates sharded and ZeRO-1/2 layouts; an all-replicated plan (which the search
    # also tries at world size > 1) is checked against the budgets below instead
    assert expected or all(c.sharding.value == "replicated" for c in r.chunks), "the search returned a plan although none fits"
    udev, uhost, udisk = POLICY.usable(*budgets)
    p = r.prediction
    assert p.peak_device_bytes <= udev and p.peak_host_bytes <= uhost and p.peak_disk_bytes <= udisk
    assert sorted(r.param_names) == sorted(n for n, _ in profile.params)
    assert all(c.chunk_size % world == 0 for c in r.chunks if c.sharded)
    host_shards = any(c.sharded and c.shard_placement.value != "device" for c in r.chunks)
    if any(c.sharded for c in r.chunks) and (world > 1 or host_shards):
        assert r.cache_blocks >= max(1, layout_from_plan(profile, r).min_blocks)
    else:  # world size 1 with every shard on the device: the runtime keeps them whole, no cache
        assert r.info["cache_blocks_used"] == 0 and r.prediction.breakdown["all_gather"] == 0
    # more memory never makes the chosen plan slower (the search is exhaustive over its candidates)
    r2 = _search(profile, world, (2 * dev + 1, 2 * host + 1, disk))
    assert r2.prediction.step_time_s <= p.step_time_s * (1 + 1e-9)


def test_disk_shard_scan_fills_the_pool_by_the_pricings_peak_not_the_sum_of_its_terms():
    """With every optimizer state on disk, the scan keeps as many shards on the host (``HK``, the
    rest ``KK``) as fit by the pricing's own rule: on one memory pool (a CPU box) the pool's peak
    is what is live at once (``timeline_peak``), below the sum of every term at its own peak. The
    scan budgeted the sum, so it left that difference unused and put shards on disk that fit
    (GPT-2 124M in 1.8 GiB: 290 MiB, one rCache block fewer and 12% slower than a plan that fit)."""
    profile, world = ramped_stack(), 2
    stt = Setting(layout=MeshLayout.data_parallel(world), elem=4, reduce_elem=4, opt_bytes=8, hardware=HW,
                  dtype="float32", fused_step=True)
    assert unified_memory(HW)
    lay = pack(profile, chunk_size_candidates(profile, world)[0], world)
    n, blocks = lay.n_sharded - lay.own, max(1, lay.min_blocks)
    g = simulate_layout(lay, blocks)
    evs = [disk_shard_evaluation(profile, lay, stt, blocks, g, v) for v in range(n + 1)]
    pool = [e.device_bytes + e.host_bytes for e in evs]
    summed = [p - e.memory.get("not_at_once", 0) for p, e in zip(pool, evs)]
    # the most host shards whose pool fits a budget that the sum of their terms exceeds, while
    # one more host shard (or every one) does not fit it
    v = max(v for v in range(n) if summed[v] > pool[v] and pool[v + 1] > pool[v] and pool[n] > pool[v])
    budget = pool[v]
    got = place(profile, lay, stt, blocks, 0, (budget, budget, 1 << 40), True, g)
    assert got is not None and got.device_bytes + got.host_bytes <= budget
    assert sum(k == HK for k in got.placements) == v and sum(k == KK for k in got.placements) == n - v
    assert got.step_time <= evs[v].step_time * (1 + 1e-12)


def _step(model, batch):
    out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
    out.loss.backward()
    return out.loss


def test_optimal_search_on_a_traced_model_round_trips(tmp_path, capsys):
    model = _tiny_gpt()
    batch = {"input_ids": torch.randint(0, 128, (2, 16))}
    r = optimal_search(model, 2, inp=batch, step_fn=_step, device_memory=64 << 20, host_memory=1 << 30,
                       hardware=HW, verbose=True)
    out = capsys.readouterr().out
    assert "runner-ups" in out and "predicted step time" in out
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(r.param_names) == names and len(r.param_names) == len(names)
    assert r.param_order is not None and r.prediction.step_time_s > 0
    assert r.info["activation_bytes"] > 0
    r.save(tmp_path / "plan.json")
    assert SearchResult.load(tmp_path / "plan.json") == r


def test_tight_budget_terminates_with_a_clear_error():
    # Budgets that leave room for fewer than 3 blocks (the reference looped forever there).
    model = _tiny_gpt()
    with pytest.raises(DoesNotFitError) as e:
        optimal_search(model, 2, device_memory=1000, host_memory=1000, hardware=HW, process_bytes=0)
    msg = str(e.value)
    assert "no plan fits" in msg and "memory >=" in msg  # on cpu-box: device and host are one pool
    assert e.value.suggestions


def test_margins_are_held_back():
    model = _tiny_gpt()
    r0 = optimal_search(model, 1, device_memory=1 << 30, host_memory=1 << 30, hardware=HW,
                        policy=MemoryPolicy(device_margin=0.0))
    peak = r0.prediction.peak_device_bytes
    # half the budget is held back: a budget of twice the peak leaves exactly the peak usable
    r = optimal_search(model, 1, device_memory=2 * peak, host_memory=1 << 30, hardware=HW,
                       policy=MemoryPolicy(device_margin=0.5))
    assert r.prediction.peak_device_bytes <= peak
    assert r.info["usable_after_margins"]["device"] == peak
    with pytest.raises(DoesNotFitError):
        optimal_search(model, 1, device_memory=peak, host_memory=1000, hardware=HW,
                       policy=MemoryPolicy(device_margin=0.99, host_margin=0.99))


def test_more_ranks_suggestion_fits():
    # Shards dominate: the suggestion to add ranks must be a world size that fits.
    prof = StepProfile(
        params=tuple((f"layers.{i}.w", (100_000,)) for i in range(8)),
        steps=tuple((f"layers.{i}.w",) for i in range(8)) + tuple((f"layers.{i}.w",) for i in reversed(range(8))),
        step_kinds=(FORWARD,) * 8 + (BACKWARD,) * 8, matmul_param_numel=800_000, tokens=1,
    )
    with pytest.raises(DoesNotFitError) as e:
        search_profile(prof, 1, hardware=HW, device_memory=3_000_000, host_memory=3_000_000)
    w = e.value.needs["world_size"]
    assert w > 1 and any("world size" in s for s in e.value.suggestions)
    search_profile(prof, w, hardware=HW, device_memory=3_000_000, host_memory=3_000_000)


def test_evaluating_the_chosen_plan_reproduces_its_prediction():
    from elixir.search.cost_model import evaluate_plan
    from elixir.search.optimal import Budgets, SearchRequest, _Searcher
    from elixir.search.step_profile import profile_from_module

    model = _tiny_gpt()
    prof = profile_from_module(model, activation_bytes=1 << 20, tokens=32)
    for dev in (2 << 20, 6 << 20, 1 << 30):
        try:
            r = search_profile(prof, 2, hardware=HW, device_memory=dev, host_memory=1 << 30, overlap=True)
        except DoesNotFitError:
            continue
        s = _Searcher(SearchRequest(prof, 2, HW, Budgets(dev, 1 << 30), "adam", True, POLICY, None))
        ev = evaluate_plan(prof, r, s.setting)
        assert ev.device_bytes == r.prediction.peak_device_bytes
        assert ev.host_bytes == r.prediction.peak_host_bytes
        assert ev.step_time == pytest.approx(r.prediction.step_time_s, rel=1e-9)


@pytest.mark.parametrize("world", [1, 2])
def test_every_scored_candidate_reprices_to_its_own_prediction(world):
    # one pricing rule: the plan made of any candidate the search scored, evaluated with
    # evaluate_plan, predicts exactly what the search recorded for it
    from elixir.search.cost_model import evaluate_plan
    from elixir.search.optimal import Budgets, SearchRequest, _Searcher, to_search_result
    from elixir.search.step_profile import profile_from_module

    prof = profile_from_module(_tiny_gpt(), activation_bytes=1 << 18, tokens=32)
    checked = set()
    host = 3 << 19 if world == 1 else 1 << 20  # tight enough for every placement to be scored
    for fused in (False, True):
        s = _Searcher(SearchRequest(prof, world, HW, Budgets(3 << 18, host, 1 << 30), "adam", True, POLICY, None,
                      grad_dtype="bfloat16" if fused else "float32", fused_step=fused))
        try:
            _, results, _ = s.run(prune=False)  # every candidate, none skipped
        except DoesNotFitError:
            continue
        for ev in results:
            plan = to_search_result(prof, world, ev, s.layout_of(ev), {}, grad_dtype=s.grad_dtype, fused_step=fused)
            got = evaluate_plan(prof, plan, s.setting)
            assert (got.device_bytes, got.host_bytes, got.disk_bytes, got.gathers) == (
                ev.device_bytes, ev.host_bytes, ev.disk_bytes, ev.gathers)
            assert got.step_time == pytest.approx(ev.step_time, rel=1e-12)
            assert got.breakdown == pytest.approx(ev.breakdown, rel=1e-12)
            checked.update(p.code for p in ev.placements)
    # the budgets exercise every placement the scan picks: on a CPU box at world size > 1 a device
    # shard with its optimizer state on the host (DH, DK) saves no copy at its gathers and costs one
    # after each step, so only world size 1 (where it saves its gathers) has them
    assert checked >= {"DD", "HH", "HK", "RD", "RH"} | ({"DH", "DK"} if world == 1 else set())


def test_chunk_placements_are_typed_and_plans_load_as_before(tmp_path):
    from elixir.plan.placement import RH, ChunkPlacement

    for code in ("DD", "DH", "HH", "DK", "HK", "HD", "RD", "RH"):
        assert ChunkPlacement.from_code(code).code == code
    with pytest.raises(ValueError, match="placement code"):
        ChunkPlacement.from_code("XD")
    with pytest.raises(ValueError, match="replicated"):
        ChunkPlacement(Placement.HOST, Placement.HOST, replicated=True)
    # a plan file as written before typed placements loads, and its chunks' placements are typed
    old = {"format_version": 1, "world_size": 2, "cache_blocks": 1, "prefetch_depth": 0, "search": "optimal",
           "chunks": [{"params": ["a"], "shapes": [[32]], "chunk_size": 32, "dtype": "float32", "sharded": True,
                       "shard_placement": "host", "optim_placement": "disk"},
                      {"params": ["b"], "shapes": [[8]], "chunk_size": 16, "dtype": "float32", "sharded": False,
                       "shard_placement": "device", "optim_placement": "host"}],
           "frozen_params": [], "param_order": None, "prediction": None,
           "info": {"runner_ups": [{"placements": "HKx1 RHx1"}]}, "grad_dtype": "float32", "fused_step": False}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(old))
    plan = SearchResult.load(path)
    assert [ChunkPlacement.of(c) for c in plan.chunks] == [HK, RH]
    assert plan.to_json()["chunks"][0]["shard_placement"] == "host"
    assert plan.info["runner_ups"][0]["placements"] == "HKx1 RHx1"


def _search_on_rank(ballast_mib: int):
    from elixir import distributed as edist

    ballast = bytearray((ballast_mib << 20) * edist.get_rank())  # rank 1 holds more than rank 0
    ballast[::4096] = b"\1" * len(ballast[::4096])
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    r = optimal_search(model, 2, device_memory=1 << 30, host_memory=1 << 30, hardware=HW)
    del ballast
    return r.info["process_bytes"], r.to_json()["chunks"]


@pytest.mark.dist
def test_process_bytes_agree_across_ranks():
    # each rank measures its own RSS; ranks searching on different figures could pick different
    # plans, so optimal_search takes the most over the process group
    from elixir.testing import run_distributed

    (b0, chunks0), (b1, chunks1) = run_distributed(_search_on_rank, 2, 128)
    assert b0 == b1 > 128 << 20
    assert chunks0 == chunks1


def test_world_size_suggestion_keeps_the_searchs_dtypes():
    # the no-fit diagnostics re-search at larger world sizes; they once rebuilt that search from a
    # guess (optimizer from its state bytes, default reduce dtype), so with fp32 reduction of bf16
    # chunks they suggested world sizes at which the real search still does not fit
    params = [(f"l{i}.w", (4096,)) for i in range(8)]
    fwd = [(n,) for n, _ in params]
    profile = StepProfile(params=tuple(params), steps=tuple(fwd + fwd[::-1]), step_kinds=(FORWARD,) * 8 + (BACKWARD,) * 8,
                          activation_bytes=1000, matmul_param_numel=8 * 4096, tokens=4, dtype="bfloat16",
                          info={"source": "synthetic"})
    suggested = 0
    for budget in range(140_000, 170_000, 2_000):
        kw = dict(hardware=HW, device_memory=budget, host_memory=budget, reduce_dtype=torch.float32,
                  fused_step=False, grad_dtype=torch.float32)
        try:
            search_profile(profile, 2, **kw)
            continue
        except DoesNotFitError as e:
            world = e.needs.get("world_size")
        if world:
            suggested += 1
            search_profile(profile, world, **kw)  # raises if the suggestion does not fit
    assert suggested


def test_zero_candidates_try_every_count_of_a_small_body_and_spread_a_large_one():
    """Which counts of ZeRO-1/2 body chunks the mixed search tries: every count up to
    ``ZERO_POINTS`` body chunks (the fastest mixed plan often has most but not all of them
    ZeRO-1/2, a count that none/one/half/all missed), evenly spread counts plus one and n - 1
    above that; the pure searches and world size 1 try one count."""
    from types import SimpleNamespace

    from elixir.search.optimal import ZERO_POINTS

    small = SimpleNamespace(n_sharded=9, own=1)  # 8 body chunks
    assert zero_candidates(small, 2) == list(range(9))
    assert zero_candidates(small, 1) == [0]
    assert zero_candidates(small, 2, "sharded") == [0]
    assert zero_candidates(small, 2, "zero") == [8]
    n = 10 * ZERO_POINTS
    got = zero_candidates(SimpleNamespace(n_sharded=n + 1, own=1), 2)
    assert got == sorted(set(got)) and got[0] == 0 and got[-1] == n and {1, n - 1} <= set(got)
    assert len(got) <= ZERO_POINTS + 3
    assert max(b - a for a, b in zip(got, got[1:])) <= math.ceil(n / ZERO_POINTS)
    with pytest.raises(ValueError, match="body_sharding"):
        zero_candidates(small, 2, "some")


def test_gathers_pay_their_payloads_first_touch_on_a_cpu_box():
    """A gathered payload is allocated per gather: on a CPU profile with a measured first-touch
    rate each gather costs its payload's bytes at that rate beside the all-gather; unmeasured
    (reference profiles, accelerators) it costs nothing extra."""
    import dataclasses

    from elixir.search.cost_model import comm_times

    names = [f"layers.{i}.w" for i in range(6)]
    profile = StepProfile(
        params=tuple((n, (4096,)) for n in names), shared=frozenset(), steps=tuple((n,) for n in names + names[::-1]),
        step_kinds=(FORWARD,) * 6 + (BACKWARD,) * 6, activation_bytes=1000, matmul_param_numel=6 * 4096, tokens=4,
        dtype="float32", info={"source": "synthetic"},
    )
    lay = pack(profile, 8192, 2)
    assert lay.n_sharded > 0
    unmeasured = dataclasses.replace(HW, first_touch_bytes_per_s=0.0)  # as an accelerator's profile
    plain = Setting(layout=MeshLayout.data_parallel(2), elem=4, reduce_elem=4, opt_bytes=8, hardware=unmeasured, dtype="float32")
    touched = dataclasses.replace(plain, hardware=dataclasses.replace(HW, first_touch_bytes_per_s=1e9))
    a = comm_times(profile, lay, plain, gathers=10)["all_gather"]
    b = comm_times(profile, lay, touched, gathers=10)["all_gather"]
    assert b - a == pytest.approx(10 * lay.chunk_size * 4 / 1e9)


@pytest.mark.parametrize("world", [1, 2])
def test_host_shard_gathers_copy_to_the_device_only_where_it_is_not_the_host(world):
    """``Chunk.gather`` copies a host shard to the device only on an accelerator; on a CPU box
    (one memory) it gathers from the shard itself. So a CPU profile prices no host-to-device copy
    for the trainable host shards' gathers (the frozen ones' already had none), while the same
    profile as an accelerator's prices one per gathered host shard, at its measured rate."""
    import dataclasses

    profile = ramped_stack()
    lay = pack(profile, chunk_size_candidates(profile, world)[0], world)
    n = lay.n_sharded - lay.own
    blocks = max(1, lay.min_blocks)
    g = simulate_layout(lay, blocks)
    kinds = (HH,) * n + (DD,) * lay.own
    cpu = Setting(layout=MeshLayout.data_parallel(world), elem=4, reduce_elem=4, opt_bytes=8, hardware=HW, dtype="float32")
    accel = dataclasses.replace(cpu, hardware=dataclasses.replace(HW, device_type="cuda"))
    assert unified_memory(cpu.hardware) and not unified_memory(accel.hardware)
    on_cpu, on_accel = (price(profile, lay, s, kinds, blocks, 0, g) for s in (cpu, accel))
    assert on_cpu.breakdown["h2d_gather"] == 0.0
    shard_bytes = lay.chunk_size // world * 4
    copies = g[:n].sum() * HW.h2d_time(shard_bytes, True)
    assert copies > 0 and on_accel.breakdown["h2d_gather"] == pytest.approx(copies)
    # the scan prices what the pricing does: with the shards on the host (no device room beyond
    # the fixed bytes) it prices no copy either
    got = place(profile, lay, cpu, blocks, 0, (on_cpu.device_bytes, 1 << 40, 0), False, g)
    assert got.placements == on_cpu.placements and got.step_time == pytest.approx(on_cpu.step_time)


def test_scan_frees_what_moving_an_fp32_host_chunks_state_to_disk_frees():
    """An fp32 ``HH`` chunk's master is its shard; moved to ``HK`` it keeps the shard on the host,
    so it frees less than a ``DH`` chunk moved to ``DK``. The scan counted every move at the
    ``DH`` rate, too few chunks went to disk, and a plan with the host shards that fits its
    budget by its own terms was refused (nothing fit)."""
    profile, world = ramped_stack(width=60_000, peak=100_000), 2
    stt = Setting(layout=MeshLayout.data_parallel(world), elem=4, reduce_elem=4, opt_bytes=8, hardware=HW,
                  dtype="float32", fused_step=True)
    lay = pack(profile, chunk_size_candidates(profile, world)[0], world)
    n, blocks = lay.n_sharded - lay.own, max(1, lay.min_blocks)
    g = simulate_layout(lay, blocks)
    shard = lay.chunk_size // world
    cb = per_chunk_bytes(stt, shard)
    assert cb[HH][1] - cb[HK][1] < cb[DH][1] - cb[DK][1]  # the setup: fp32, the master is the shard
    z = n // 2  # the least gathered half on disk
    kinds = [HH] * n
    for c in np.argsort(-g[:n], kind="stable")[n - z:].tolist():
        kinds[c] = HK
    ev = price(profile, lay, stt, tuple(kinds), blocks, 0, g)
    summed = ev.device_bytes + ev.host_bytes - ev.memory.get("not_at_once", 0)  # what the scan counts
    got = place(profile, lay, stt, blocks, 0, (ev.device_bytes, summed, 1 << 40), True, g)
    assert got is not None and got.device_bytes + got.host_bytes <= summed
    assert got.step_time <= ev.step_time * (1 + 1e-12)


def test_more_device_memory_never_slows_a_cpu_plan_whose_device_shards_only_cost():
    """On a CPU box at world size > 1 a device shard with its optimizer state on the host (``DH``)
    saves no copy at its gathers and costs one after each step: the scan, which put as many device
    shards as fit, then answered a larger device cap with a slower plan (``DD`` x2 + ``DH`` x2 +
    ``HH`` x8 where ``DD`` x2 + ``HH`` x10 is faster and fits)."""
    profile, world = ramped_stack(width=60_000, peak=100_000), 2
    stt = Setting(layout=MeshLayout.data_parallel(world), elem=4, reduce_elem=4, opt_bytes=8, hardware=HW, dtype="float32")
    lay = pack(profile, chunk_size_candidates(profile, world)[0], world)
    blocks = max(1, lay.min_blocks)
    g = simulate_layout(lay, blocks)
    all_dd = place(profile, lay, stt, blocks, 0, (1 << 40, 1 << 40, 0), False, g)
    assert all_dd is not None and all(k == DD for k in all_dd.placements)
    times = [ev.step_time for ev in (place(profile, lay, stt, blocks, 0, (cap, 1 << 40, 0), False, g)
                                     for cap in np.linspace(all_dd.device_bytes / 3, all_dd.device_bytes, 24).astype(int))
             if ev is not None]
    assert len(times) > 12 and all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:])), times


@pytest.mark.parametrize("body, kinds", [("sharded", {"sharded"}), ("zero", {"zero1", "zero2"})])
def test_pure_body_sharding_is_honoured_when_no_budget_binds(body, kinds):
    """Before: with memory to spare, optimal_search(body_sharding="sharded") returned the fully
    replicated (data parallel) plan, which is neither pure ZeRO-3 nor pure ZeRO-1/2."""
    from elixir.search import Sharding, optimal_search
    from elixir.testing.zoo import build_model

    plan = optimal_search(build_model("gpt2"), 2, body_sharding=body, process_bytes=0)
    assert not all(c.sharding is Sharding.REPLICATED for c in plan.chunks)
    assert any(c.sharding.value in kinds for c in plan.chunks), [c.sharding for c in plan.chunks]
    other = {"sharded": ("zero1", "zero2"), "zero": ("sharded",)}[body]
    assert not any(c.sharding.value in other for c in plan.chunks), [c.sharding for c in plan.chunks]
