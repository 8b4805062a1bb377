"""Hardware profiles: schema, curves, reference profiles, measurement (tiny sizes)."""

import dataclasses
import json

import pytest

from elixir import hardware, profiling
from elixir.hardware import BandwidthCurve, HardwareProfile, load_profile, reference_profiles
from elixir.profiling import MeasureOptions

REFERENCES = ("8xA100-40GB", "8xH100-80GB", "1x24GB-workstation", "cpu-box")
QUANTITIES = ("device_memory_bytes", "host_memory_bytes", "h2d_pinned", "all_gather", "optimizer_params_per_s",
              "matmul_flops", "disk_read_bytes_per_s")


def test_curve_interpolates_and_floors_latency():
    c = BandwidthCurve((1000, 100_000), (1e6, 1e8))
    assert c.bandwidth(100_000) == 1e8 and c.bandwidth(10**9) == 1e8
    # halfway in log size: geometric mean of the times (1 ms and 1 ms here: a latency-bound range)
    assert c.time(10_000) == pytest.approx(1e-3)
    assert BandwidthCurve((1000, 100_000), (1e6, 1e7)).time(10_000) == pytest.approx((1e-3 * 1e-2) ** 0.5)
    # below the smallest point the time stays at its time: never faster than anything measured
    assert c.time(10) == pytest.approx(c.time(1000))
    assert c.time(0) == 0.0
    times = [c.time(s) for s in (1000, 5000, 20_000, 100_000, 10**6)]
    assert times == sorted(times)
    with pytest.raises(ValueError):
        BandwidthCurve((10, 5), (1.0, 1.0))


def test_reference_profiles_ship_and_say_where_numbers_come_from():
    names = reference_profiles()
    for ref in REFERENCES:
        assert ref in names
        p = load_profile(ref)
        assert p.source.get("*"), ref
        if ref == "cpu-box":
            assert p.measured and "measured" in p.source["*"]
        else:
            assert not p.measured and "NOT measured" in p.source["*"]
            for q in QUANTITIES:
                assert q in p.source, (ref, q)
        assert p.device_memory_bytes > 0 and p.host_memory_bytes > 0
        assert all(v > 0 for v in p.optimizer_params_per_s.values())


def test_json_round_trip_and_version_check(tmp_path):
    p = load_profile("8xA100-40GB")
    path = tmp_path / "hw.json"
    p.save(path)
    assert HardwareProfile.load(path) == p
    d = json.loads(path.read_text())
    d["schema_version"] = 99
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="schema version 99"):
        HardwareProfile.load(path)
    d["schema_version"] = hardware.HARDWARE_SCHEMA_VERSION
    d["bogus"] = 1
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unknown fields"):
        HardwareProfile.load(path)
    with pytest.raises(FileNotFoundError, match="8xA100-40GB"):
        load_profile("no-such-profile")


def test_collective_cost_scales_with_world_as_a_ring():
    p = load_profile("8xA100-40GB")
    s = 4 << 30  # large enough that the bus bandwidth is flat
    t2, t8 = p.all_gather_time(s, 2), p.all_gather_time(s, 8)
    assert t8 / t2 == pytest.approx((7 / 8) / (1 / 2), rel=0.05)
    assert p.all_gather_time(s, 1) == p.device_copy.time(s)  # world 1: a copy
    ws = load_profile("1x24GB-workstation")
    with pytest.raises(ValueError, match="no all-gather"):
        ws.all_gather_time(s, 2)


def test_per_rank_share_divides_node_quantities():
    p = load_profile("8xA100-40GB")
    q = p.per_rank(8)
    assert q.optimizer_params_per_s["host"] == pytest.approx(p.optimizer_params_per_s["host"] / 8)
    assert q.optimizer_params_per_s["device"] == p.optimizer_params_per_s["device"]  # one GPU each
    assert q.disk_read_bytes_per_s == pytest.approx(p.disk_read_bytes_per_s / 8)
    base = dataclasses.replace(load_profile("cpu-box"), calibration={})  # the share alone, uncalibrated
    one, two = base.per_rank(1), base.per_rank(2)
    assert one.optimizer_params_per_s["host"] == pytest.approx(2 * two.optimizer_params_per_s["host"])
    # two ranks on a CPU box get half the cores each: half the compute of one rank with all of them
    assert two.matmul_flops["float32"] == pytest.approx(one.matmul_flops["float32"] / 2)
    # and half the threads for a frozen shard's decode (timed on all of them); a GPU's is its own
    gpu = dataclasses.replace(p, frozen_decode_elements_per_s={"nf4": {"bfloat16": 1e9}})
    assert gpu.per_rank(8).frozen_decode_time(1e9, "nf4", "bfloat16") == gpu.frozen_decode_time(1e9, "nf4", "bfloat16")
    cpu = dataclasses.replace(base, frozen_decode_elements_per_s={"nf4": {"bfloat16": 1e9}})
    assert cpu.per_rank(2).frozen_decode_time(1e9, "nf4", "bfloat16") == pytest.approx(
        2 * cpu.per_rank(1).frozen_decode_time(1e9, "nf4", "bfloat16"))


def test_measure_tiny_on_this_machine(tmp_path):
    prof = profiling.measure(MeasureOptions.tiny(str(tmp_path)), collective_world=1, name="t")
    assert prof.measured and prof.device_type in ("cpu", "cuda")
    for k in ("h2d_pinned", "d2h_pageable", "device_copy"):
        assert all(b > 0 for b in getattr(prof, k).bytes_per_s)
    if prof.device_type == "cpu":
        assert "memcpy" in prof.source["h2d_pinned"]
    assert prof.all_gather is None and prof.collective_world == 0
    assert prof.optimizer_params_per_s["host"] > 0 and prof.disk_write_bytes_per_s > 1
    assert prof.train_flops["float32"].bytes_per_s[0] > 0
    skinny = prof.matmul_bytes_curve["float32"]  # one point per skinny width, bytes growing
    assert len(skinny.sizes) == 2 and skinny.sizes[0] < skinny.sizes[1] and min(skinny.bytes_per_s) > 0
    assert "8-row products" in prof.source["matmul_bytes_curve"]
    decode = prof.frozen_decode_elements_per_s  # every quantised format, into each compute dtype
    assert set(decode) == {"nf4", "int8"} and all(set(r) == {"bfloat16", "float32"} for r in decode.values())
    assert min(v for r in decode.values() for v in r.values()) > 0 and "decode" in prof.source["frozen_decode_elements_per_s"]
    assert not list(tmp_path.iterdir())  # the disk test cleans up
    prof.save(tmp_path / "hw.json")
    assert HardwareProfile.load(tmp_path / "hw.json") == prof


def _collectives(sizes):
    return profiling.measure_collectives(sizes, 1)


@pytest.mark.dist
def test_collectives_measured_over_two_ranks():
    from elixir.testing.dist import run_distributed

    res = run_distributed(_collectives, 2, (64 * 1024, 1 << 20), timeout=120)
    assert res[0] == res[1]  # every rank reports the slowest rank's figures
    assert res[0]["world"] == 2 and res[0]["backend"] == "gloo"
    assert all(b > 0 for b in res[0]["all_gather"] + res[0]["reduce_scatter"])


def test_hwprofile_cli_show(capsys):
    from elixir.cli import main

    assert main(["hwprofile", "--show", "8xH100-80GB"]) == 0
    out = capsys.readouterr().out
    assert "8xH100-80GB" in out and "reference" in out
