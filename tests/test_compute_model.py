"""The compute-time model: per-op costs from the tracer, the roofline per op, and the calibration
of a hardware profile against the runtime."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from elixir.hardware import BandwidthCurve, load_profile
from elixir.search.cost_model import compute_seconds
from elixir.search.step_profile import profile_step
from elixir.tracer.memory_tracer import memory_profiling
from elixir.tracer.op_costs import OpCosts


def _linear_step(model, batch):
    model(batch["x"]).sum().backward()


def test_matmul_flops_of_a_linear_layer_are_exact():
    m = nn.Linear(64, 32)
    costs = memory_profiling(m, {"x": torch.randn(8, 64)}, _linear_step).op_costs
    # forward addmm and the weight-gradient mm, 2 * 8 * 64 * 32 FLOPs each (the input needs no gradient)
    assert costs.matmul_flops == 2 * 2 * 8 * 64 * 32
    assert sum(v[0] for v in costs.matmul.values()) == 2
    # operand bytes, read and written: addmm(bias, x, W^T) -> 8 x 32; mm(grad_out^T, x) -> 32 x 64
    fwd = 32 + 8 * 64 + 64 * 32 + 8 * 32
    wgrad = 32 * 8 + 8 * 64 + 32 * 64
    assert costs.matmul_bytes == 4 * (fwd + wgrad)
    x = torch.randn(8, 64, requires_grad=True)
    assert memory_profiling(m, {"x": x}, _linear_step).op_costs.matmul_flops == 3 * 2 * 8 * 64 * 32
    assert costs.ops > 3 and costs.memory_bytes > 0  # the sum, its backward, the bias gradient...


def test_attention_counts_as_matmul():
    class Attn(nn.Module):
        def forward(self, x):
            return nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)

    x = torch.randn(2, 4, 16, 8, requires_grad=True)
    costs = memory_profiling(Attn(), {"x": x}, _linear_step).op_costs
    # forward: Q K^T and P V, 2 * b h s s d each; backward twice that or more
    assert costs.matmul_flops >= 3 * 2 * (2 * 2 * 4 * 16 * 16 * 8)


def test_op_costs_combine_and_json_round_trip():
    a = OpCosts({10: [2.0, 3000.0, 600.0]}, {5: [1.0, 40.0]}, 7)
    b = OpCosts({10: [1.0, 1500.0, 100.0], 12: [1.0, 5000.0, 70.0]}, {}, 3)
    c = a.combine(b, 2.0, -1.0)  # 2a - b
    assert c.matmul == {10: [3.0, 4500.0, 1100.0]} and c.memory == {5: [2.0, 80.0]} and c.ops == 11
    assert OpCosts.from_json(c.to_json()) == c
    # a profile traced before matmul bytes were recorded reads as 0 bytes (FLOPs-only pricing)
    old = OpCosts.from_json({"matmul": {"10": [1, 100]}, "memory": {}, "ops": 1})
    assert old.matmul == {10: [1.0, 100.0, 0.0]}


def test_skinny_matmuls_pay_their_operand_bytes():
    flat = dataclasses.replace(load_profile("8xA100-40GB"), matmul_curve={"float32": BandwidthCurve.flat(1e12)},
                               elementwise=BandwidthCurve.flat(1e11), op_overhead_s=0.0)
    with_bytes = dataclasses.replace(flat, matmul_bytes_curve={"float32": BandwidthCurve.flat(1e10)})
    costs = OpCosts({20: [4.0, 4e9, 8e8]}, {}, 0)
    assert flat.op_compute_time(costs, "float32") == pytest.approx(4e9 / 1e12)  # not measured: FLOPs only
    assert with_bytes.op_compute_time(costs, "float32") == pytest.approx(4e9 / 1e12 + 8e8 / 1e10)
    # the bytes' rate is compute: shared by a CPU box's ranks and scaled by the compute calibration
    cal = dataclasses.replace(with_bytes, calibration={"8": {"compute": 2.0}})
    assert cal.per_rank(8).op_compute_time(costs, "float32") == pytest.approx(2 * (4e9 / 1e12 + 8e8 / 1e10))
    # a traced skinny product (8 rows against a 1024 x 1024 weight) is priced above its FLOPs
    m = nn.Linear(1024, 1024, bias=False)
    traced = memory_profiling(m, {"x": torch.randn(8, 1024)}, _linear_step).op_costs
    assert traced.matmul_bytes >= 2 * 4 * 1024 * 1024  # the weight read, its gradient written
    assert with_bytes.op_compute_time(traced, "float32") > 10 * flat.op_compute_time(traced, "float32")


def test_roofline_per_op_adds_overhead_flops_and_bytes():
    hw = dataclasses.replace(
        load_profile("8xA100-40GB"), matmul_curve={"float32": BandwidthCurve.flat(1e12)},
        elementwise=BandwidthCurve.flat(1e11), op_overhead_s=1e-5,
    )
    costs = OpCosts({20: [4.0, 4e9]}, {3: [10.0, 2e9]}, 100)
    assert hw.op_compute_time(costs, "float32") == pytest.approx(100 * 1e-5 + 4e9 / 1e12 + 2e9 / 1e11)


def test_calibration_scales_each_component_for_its_rank_count():
    base = load_profile("8xA100-40GB")
    cal = dataclasses.replace(base, calibration={"8": {"compute": 2.0, "op_overhead_s": 1e-5, "collectives": 3.0,
                                                       "optimizer": 0.5}},
                              matmul_curve={"bfloat16": BandwidthCurve.flat(1e14)})
    plain = dataclasses.replace(cal, calibration={})
    a, b = cal.per_rank(8), plain.per_rank(8)
    assert a.all_gather_time(1 << 30, 8) == pytest.approx(3 * b.all_gather_time(1 << 30, 8))
    assert a.reduce_scatter_time(1 << 20, 8) == pytest.approx(3 * b.reduce_scatter_time(1 << 20, 8))
    assert a.optimizer_time(1e9, "device") == pytest.approx(0.5 * b.optimizer_time(1e9, "device"))
    costs = OpCosts({30: [1.0, 1e12]}, {20: [1.0, 1e9]}, 1000)
    thru = b.op_compute_time(dataclasses.replace(costs, ops=0), "bfloat16")
    assert a.op_compute_time(costs, "bfloat16") == pytest.approx(2 * thru + 1000 * 1e-5)
    assert cal.per_rank(4).all_gather_time(1 << 30, 8) == plain.per_rank(4).all_gather_time(1 << 30, 8)


def test_the_all_reduce_has_its_own_calibration_factor():
    base = dataclasses.replace(load_profile("8xA100-40GB"), all_reduce=BandwidthCurve.flat(1e11), calibration={})
    own = dataclasses.replace(base, calibration={"8": {"collectives": 3.0, "all_reduce": 1.5}})
    shared = dataclasses.replace(base, calibration={"8": {"collectives": 3.0}})  # profiles calibrated before it
    t = base.per_rank(8).all_reduce_time(1 << 30, 8)
    assert own.per_rank(8).all_reduce_time(1 << 30, 8) == pytest.approx(1.5 * t)
    assert shared.per_rank(8).all_reduce_time(1 << 30, 8) == pytest.approx(3.0 * t)
    assert own.per_rank(8).all_gather_time(1 << 30, 8) == pytest.approx(3.0 * base.per_rank(8).all_gather_time(1 << 30, 8))


def test_cost_model_compute_comes_from_the_traced_ops():
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    prof = profile_step(m, {"x": torch.randn(4, 32)}, lambda mod, b: mod(b["x"]).sum().backward())
    # three matmuls per layer, less the first layer's input gradient (the input needs none)
    assert prof.op_costs is not None and prof.op_costs.matmul_flops == 5 * 2 * 4 * 32 * 64
    hw = load_profile("cpu-box")
    assert compute_seconds(prof, hw, "float32") == pytest.approx(hw.op_compute_time(prof.op_costs, "float32"))
    no_ops = dataclasses.replace(prof, op_costs=None)
    assert compute_seconds(no_ops, hw, "float32") == pytest.approx(hw.compute_time(prof.flops(), "float32"))


@pytest.mark.dist
def test_calibration_runs_the_runtime_on_this_machine():
    from elixir.profiling.calibrate import calibrate_profile

    hw = load_profile("cpu-box")
    cal = calibrate_profile(hw, (1,), steps=2)
    f = cal.calibration["1"]
    assert set(f) == {"compute", "compute_bfloat16", "op_overhead_s", "collectives", "all_reduce", "optimizer", "overlap"}
    assert 0 < f["compute"] < 100 and 0 < f["compute_bfloat16"] < 100 and 0 <= f["op_overhead_s"] < 1e-3
    assert f["collectives"] == f["all_reduce"] == 1.0  # one rank: nothing to reduce
    assert "ReferenceLM" in cal.source["calibration"] and "measured compute" in cal.source["calibration"]


def test_all_reduce_from_its_curve_or_a_ring():
    hw = load_profile("8xA100-40GB")
    assert hw.all_reduce is None  # NCCL's ring: a reduce-scatter then an all-gather
    n = 1 << 28
    assert hw.all_reduce_time(n, 8) == pytest.approx(hw.reduce_scatter_time(n, 8) + hw.all_gather_time(n, 8))
    measured = dataclasses.replace(hw, all_reduce=BandwidthCurve.flat(1e11))
    assert measured.all_reduce_time(n, 8) == pytest.approx(2 * n * 7 / 8 / 1e11)
    assert measured.all_reduce_time(n, 1) == 0.0
