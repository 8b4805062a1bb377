"""One memory pool per node where the device is the host, and host memory shared by a node's ranks
(issue 20, item 2): the search must never count the same RAM twice."""

from __future__ import annotations

import torch.nn as nn

from elixir.hardware import load_profile
from elixir.plan import SearchResult
from elixir.search.optimal import search_profile
from elixir.search.step_profile import profile_from_module


def test_opt_2_7b_on_the_cpu_box_fits_the_box(tmp_path, capsys):
    """``elixir plan opt-2.7b --world-size 2 --hardware cpu-box`` used to report a fit at about
    20.6 GiB "device" plus 10.3 GiB host per rank: 62 GiB on a 24 GiB box. Every plan it makes
    now keeps the node's predicted peak (both ranks, device and host bytes) within the box."""
    from elixir.cli import main

    hw = load_profile("cpu-box")
    out = tmp_path / "plan.json"
    rc = main(["plan", "opt-2.7b", "--world-size", "2", "--hardware", "cpu-box", "--disk", "200GiB",
               "--batch", "1", "--seq", "256", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    plan = SearchResult.load(out)
    p = plan.prediction
    node_peak = 2 * (p.peak_device_bytes + p.peak_host_bytes)
    assert node_peak <= hw.host_memory_bytes, (node_peak / 2**30, hw.host_memory_bytes / 2**30)
    assert p.peak_disk_bytes > 0  # OPT-2.7B's Adam state (~43 GiB) cannot all live in 24 GiB
    assert "peak node RAM" in text and "unified" in plan.info["memory_pool"]


def _mlp() -> nn.Module:
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def test_cpu_pool_counts_device_and_host_together():
    hw = load_profile("cpu-box")
    prof = profile_from_module(_mlp())
    params = sum(p.numel() for p in _mlp().parameters())
    # a pool for about 1.5 copies of (params + grads + masters + Adam): device and host cannot both use it
    pool = int(params * 4 * 4 * 1.5)
    sr = search_profile(prof, 2, hardware=hw, host_memory=pool, ranks_per_node=2)
    p = sr.prediction
    assert p.peak_device_bytes + p.peak_host_bytes <= pool, (p.peak_device_bytes, p.peak_host_bytes, pool)
    assert sr.info["budgets"]["device"] <= pool  # the device share defaults to the pool


def test_gpu_node_host_memory_is_shared_by_its_ranks():
    hw = load_profile("8xA100-40GB")
    prof = profile_from_module(_mlp())
    for rpn in (8, 4):
        sr = search_profile(prof, 8, hardware=hw, ranks_per_node=rpn)
        assert sr.info["budgets"]["host"] == hw.host_memory_bytes // rpn
        assert sr.info["budgets"]["device"] == hw.device_memory_bytes  # per device, not shared
        assert sr.info["memory_pool"] == "separate"
    sr = search_profile(prof, 8, hardware=hw)
    assert sr.info["budgets"]["host"] == hw.host_memory_bytes // hw.ranks_per_node(8)
