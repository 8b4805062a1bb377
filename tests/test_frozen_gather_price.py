"""The search prices a quantised frozen chunk's gather as the runtime does it
(``ChunkStorage.decode_gather``): the packed shards on the wire (none at world size 1), the
payload's first touch and the decode at the hardware profile's measured rate
(``HardwareProfile.frozen_decode_elements_per_s``, ``elixir hwprofile``), not a gather of the
compute-dtype bytes (issue 33 item 4, issue 35: every cost term measured)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elixir.hardware import load_profile
from elixir.hardware.profile import BandwidthCurve
from elixir.plan import MeshLayout
from elixir.plan.state_format import frozen_shard_bytes
from elixir.search import optimal_search
from elixir.search.cost_model import (
    Setting,
    evaluate_plan,
    frozen_gather_time,
    layout_from_plan,
    pack,
)
from elixir.search.step_profile import profile_step
from tests.lora_cases import CASES

BATCH = 2


@pytest.fixture(scope="module")
def profile():
    case = CASES["llama-lora"]
    return profile_step(profile_model(), case.make_batch(BATCH, 0), case.step_fn, torch.bfloat16)


def profile_model():
    with torch.device("meta"):
        return CASES["llama-lora"].build()


def _with_rate(hw, rate: float):
    """``hw`` with every quantised format decoding at ``rate`` elements per second."""
    rates = {f: {"bfloat16": rate, "float32": rate} for f in ("nf4", "int8")}
    return dataclasses.replace(hw, frozen_decode_elements_per_s=rates)


def _setting(hw, world: int, fmt) -> Setting:
    return Setting(layout=MeshLayout.data_parallel(world), elem=2, reduce_elem=2, opt_bytes=8, hardware=hw,
                   dtype="bfloat16", frozen_format=fmt)


def test_unmeasured_profile_prices_the_decode_as_before():
    """A profile without the field (the reference profiles, any profile measured before it) prices
    the decode as a device copy of the decoded bytes: the price every frozen gather had before."""
    hw = dataclasses.replace(load_profile("cpu-box"), frozen_decode_elements_per_s={})
    n = 1 << 24
    assert hw.frozen_decode_time(n, "nf4", "bfloat16") == hw.device_copy.time(2 * n)
    assert hw.frozen_decode_time(n, "int8", "float32") == hw.device_copy.time(4 * n)
    fast = _with_rate(hw, 4e9)
    assert fast.frozen_decode_time(n, "nf4", "bfloat16") == pytest.approx(n / 4e9)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_world1_quantised_gather_is_first_touch_plus_decode(profile, fmt):
    """At world size 1 nothing is on the wire: one gather is the payload's first touch plus the
    decode of the whole chunk at the profile's rate; the step's all-gather term moves by the
    frozen gathers times the change in decode time, nothing else."""
    base = load_profile("cpu-box")
    slow, fast = _with_rate(base, 2e8), _with_rate(base, 8e9)
    plan = optimal_search(profile_model(), 1, frozen=fmt, hardware=slow, host_memory=1 << 30,
                          device_memory=1 << 30, inp=CASES["llama-lora"].make_batch(BATCH, 0),
                          step_fn=CASES["llama-lora"].step_fn, process_bytes=0, unified_dtype=torch.bfloat16)
    assert plan.frozen_chunks and plan.frozen_format == fmt
    assert all(c.shard_placement.value == "device" for c in plan.chunks)  # resident: no gathers of their own
    layout = layout_from_plan(profile, plan)
    n = layout.frozen_chunk_size
    for hw in (slow, fast):
        st = _setting(hw, 1, fmt)
        rate = hw.frozen_decode_elements_per_s[fmt]["bfloat16"]
        assert frozen_gather_time(layout, st) == pytest.approx(hw.first_touch_time(2 * n) + n / rate)
    ev_slow, ev_fast = (evaluate_plan(profile, plan, _setting(hw, 1, fmt)) for hw in (slow, fast))
    frozen_gathers = ev_slow.gathers  # the trainable chunks are resident at world size 1: the frozen ones'
    assert ev_fast.gathers == frozen_gathers >= len(plan.frozen_chunks)  # each gathered at least once a step
    saved = frozen_gathers * n * (1 / 2e8 - 1 / 8e9)
    assert ev_slow.breakdown["all_gather"] - ev_fast.breakdown["all_gather"] == pytest.approx(saved)
    assert ev_slow.step_time - ev_fast.step_time == pytest.approx(saved)


def test_world2_puts_the_packed_shards_on_the_wire(profile):
    """At world size 2 a quantised gather all-gathers the ranks' packed shards (NF4: about a
    quarter of bf16's bytes), then decodes the chunk: with the decode and first touch free the
    gather costs what all-gathering those bytes costs, not the bf16 chunk."""
    hw = dataclasses.replace(_with_rate(load_profile("cpu-box"), 1e30), first_touch_bytes_per_s=0.0,
                             all_gather=BandwidthCurve.flat(1e9))
    layout = pack(profile, 1 << 16, 2)
    assert layout.n_frozen
    n = layout.frozen_chunk_size
    nf4 = frozen_gather_time(layout, _setting(hw, 2, "nf4"))
    bf16 = frozen_gather_time(layout, _setting(hw, 2, None))
    wire = 2 * frozen_shard_bytes("nf4", n // 2, 2)
    assert nf4 == pytest.approx(hw.all_gather_time(wire, 2), rel=1e-6)
    assert bf16 == pytest.approx(hw.all_gather_time(2 * n, 2))
    assert nf4 < bf16 / 3


class _Count:
    """An observer of one chunk (Chunk.observers): its gathers."""

    def __init__(self) -> None:
        self.n = 0

    def gathered(self, chunk=None) -> None:
        self.n += 1

    def released(self, chunk=None) -> None:
        pass


def test_world1_counts_the_frozen_gathers_the_runtime_makes(profile):
    """At world size 1 the trainable (LoRA) chunks stay resident, in no rCache block: the frozen
    chunks' gathers in a training step are what the prediction counts (the whole trace's Belady
    count, trainable chunks in the cache too, had each adapter evict the frozen chunk in use)."""
    from elixir.testing.reference import default_optimizer, train_wrapped
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    case = CASES["llama-lora"]
    hw = _with_rate(load_profile("cpu-box"), 1e9)
    found = optimal_search(case.build(), 1, frozen="nf4", hardware=hw, host_memory=1 << 30, device_memory=1 << 30,
                           inp=case.make_batch(BATCH, 0), step_fn=case.step_fn, process_bytes=0,
                           unified_dtype=torch.bfloat16)
    layout = layout_from_plan(profile, found)
    for plan in (found, dataclasses.replace(found, cache_blocks=layout.min_blocks)):
        assert all(c.shard_placement.value == "device" for c in plan.chunks)
        ev = evaluate_plan(profile, plan, _setting(hw, 1, "nf4"))
        em = ElixirModule(case.build(), plan, dtype=torch.bfloat16)
        counts = [_Count() for _ in em.frozen_chunks]
        for c, o in zip(em.frozen_chunks, counts):
            c.observers.append(o)
        opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
        train_wrapped(case, em, opt, steps=1, batch_size=BATCH)
        assert sum(o.n for o in counts) == ev.gathers, (plan.cache_blocks, [o.n for o in counts])
