"""Write the shipped reference hardware profiles (elixir/data/hardware/*.json).

These profiles describe machines this project does NOT have. None of their numbers was measured
here: each is a vendor specification, or a figure derived from one with the derivation written
next to it, or an approximate published measurement (nccl-tests, CUDA bandwidthTest, STREAM-class
memory bandwidth). They are good enough to plan with; for real runs, measure the target with
``elixir hwprofile --out hw.json`` (under torchrun for the collectives) and pass ``--hardware hw.json``.

The measured profile of this project's CPU box (``cpu-box.json``) is written by
``elixir hwprofile --out elixir/data/hardware/cpu-box.json --name cpu-box`` instead.

Run: ``python profile/reference_profiles.py``.
"""

from __future__ import annotations

import os
import sys

from elixir.hardware import BandwidthCurve, GiB, HardwareProfile, MiB

GB = 1e9
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "elixir", "data", "hardware")

# fp32 Adam reads p, g, m, v and writes p, m, v: 28 bytes of memory traffic per parameter, so a
# memory-bound fused update runs at (achievable memory bandwidth) / 28 parameters per second.
ADAM_BYTES = 28

# Eager PyTorch pays a fixed host-side cost per op (Python, dispatcher, autograd, kernel launch);
# with small kernels the GPU waits on it. Typical figures are 5-10 us per op on a modern server CPU.
OP_OVERHEAD = 8e-6
OP_OVERHEAD_SOURCE = ("approximate: eager PyTorch host-side cost per op (dispatch, autograd, kernel launch), "
                      "typically 5-10 us; elementwise ops move bytes at twice device_copy (read + write)")


def curve(points: list[tuple[int, float]]) -> BandwidthCurve:
    return BandwidthCurve(tuple(s for s, _ in points), tuple(b * GB for _, b in points))


def a100() -> HardwareProfile:
    hbm = 1300  # GB/s achievable device-to-device copy of HBM2 rated 1555 GB/s
    stream = 300  # GB/s, 2x AMD EPYC 7742, 8 channels DDR4-3200 each (410 GB/s theoretical)
    return HardwareProfile(
        name="8xA100-40GB",
        device_type="cuda",
        device_name="NVIDIA A100-SXM4-40GB (DGX A100 / HGX A100 class node)",
        devices_per_node=8,
        device_memory_bytes=42_505_273_344,
        host_memory_bytes=1024 * GiB,
        disk_bytes=15 * 10**12,
        h2d_pinned=curve([(1 * MiB, 12), (16 * MiB, 22), (256 * MiB, 24)]),
        h2d_pageable=curve([(1 * MiB, 5), (16 * MiB, 9), (256 * MiB, 10)]),
        d2h_pinned=curve([(1 * MiB, 12), (16 * MiB, 22), (256 * MiB, 24)]),
        d2h_pageable=curve([(1 * MiB, 5), (16 * MiB, 8), (256 * MiB, 9)]),
        device_copy=curve([(1 * MiB, 300), (16 * MiB, 1000), (256 * MiB, hbm)]),
        all_gather=curve([(1 * MiB, 30), (16 * MiB, 130), (256 * MiB, 210), (1024 * MiB, 230)]),
        reduce_scatter=curve([(1 * MiB, 30), (16 * MiB, 130), (256 * MiB, 210), (1024 * MiB, 230)]),
        collective_world=8,
        collective_backend="nccl",
        optimizer_params_per_s={"device": hbm * GB / ADAM_BYTES, "host": stream * GB / ADAM_BYTES},
        optimizer_impl={"device": "fused Adam (memory bound, derived)", "host": "CPU Adam (memory bound, derived)"},
        matmul_flops={"bfloat16": 250e12, "float16": 250e12, "float32": 18e12},
        disk_read_bytes_per_s=20 * GB,
        disk_write_bytes_per_s=8 * GB,
        overlap=True,
        op_overhead_s=OP_OVERHEAD,
        measured=False,
        host="reference",
        created="2026-11-22",
        source={
            "*": "reference profile, NOT measured by elixir: vendor specifications and approximate published "
                 "measurements for one DGX A100 (40 GB) node",
            "device_memory_bytes": "total_memory torch reports for A100-SXM4-40GB (40 GB nominal)",
            "host_memory_bytes": "DGX A100 (40 GB) system memory: 1 TB (NVIDIA DGX A100 datasheet)",
            "disk_bytes": "DGX A100 internal NVMe: 15 TB (datasheet)",
            "h2d_pinned": "PCIe Gen4 x16 (32 GB/s theoretical); CUDA bandwidthTest typically reports ~24 GB/s pinned",
            "h2d_pageable": "approximate: pageable copies stage through a host bounce buffer, ~40% of pinned",
            "d2h_pinned": "as h2d_pinned", "d2h_pageable": "as h2d_pageable",
            "device_copy": "HBM2 1555 GB/s rated; ~1.3 TB/s achievable device copy (approximate)",
            "all_gather": "NVLink 3 / NVSwitch, 600 GB/s per GPU; nccl-tests bus bandwidth ~230 GB/s at large "
                          "messages on 8x A100 (approximate, published figures), lower at small messages",
            "reduce_scatter": "as all_gather",
            "optimizer_params_per_s": "derived: device = 1.3 TB/s / 28 B per fp32 Adam parameter; host = "
                                      "~300 GB/s STREAM-class bandwidth of 2x EPYC 7742 / 28 B (shared by 8 ranks)",
            "op_overhead_s": OP_OVERHEAD_SOURCE,
            "matmul_flops": "A100 dense bf16/fp16 312 TFLOP/s peak, ~250 achieved on large GEMMs (approximate); "
                            "fp32 without TF32 19.5 peak, ~18 achieved",
            "disk_read_bytes_per_s": "approximate: 4x U.2 Gen4 NVMe in RAID 0",
            "disk_write_bytes_per_s": "approximate: 4x U.2 Gen4 NVMe in RAID 0",
        },
        notes="Planning only. Measure the real node with `elixir hwprofile` under torchrun for accurate plans.",
    )


def h100() -> HardwareProfile:
    hbm = 2600  # GB/s achievable of HBM3 rated 3350 GB/s
    stream = 450  # GB/s, 2x Xeon Platinum 8480C, 8 channels DDR5-4800 each (614 GB/s theoretical)
    return HardwareProfile(
        name="8xH100-80GB",
        device_type="cuda",
        device_name="NVIDIA H100 80GB HBM3 SXM5 (DGX H100 / HGX H100 class node)",
        devices_per_node=8,
        device_memory_bytes=85_520_809_984,
        host_memory_bytes=2048 * GiB,
        disk_bytes=30 * 10**12,
        h2d_pinned=curve([(1 * MiB, 20), (16 * MiB, 45), (256 * MiB, 50)]),
        h2d_pageable=curve([(1 * MiB, 6), (16 * MiB, 12), (256 * MiB, 15)]),
        d2h_pinned=curve([(1 * MiB, 20), (16 * MiB, 45), (256 * MiB, 50)]),
        d2h_pageable=curve([(1 * MiB, 6), (16 * MiB, 12), (256 * MiB, 14)]),
        device_copy=curve([(1 * MiB, 500), (16 * MiB, 2000), (256 * MiB, hbm)]),
        all_gather=curve([(1 * MiB, 40), (16 * MiB, 200), (256 * MiB, 380), (1024 * MiB, 420)]),
        reduce_scatter=curve([(1 * MiB, 40), (16 * MiB, 200), (256 * MiB, 380), (1024 * MiB, 420)]),
        collective_world=8,
        collective_backend="nccl",
        optimizer_params_per_s={"device": hbm * GB / ADAM_BYTES, "host": stream * GB / ADAM_BYTES},
        optimizer_impl={"device": "fused Adam (memory bound, derived)", "host": "CPU Adam (memory bound, derived)"},
        matmul_flops={"bfloat16": 700e12, "float16": 700e12, "float32": 50e12},
        disk_read_bytes_per_s=25 * GB,
        disk_write_bytes_per_s=12 * GB,
        overlap=True,
        op_overhead_s=OP_OVERHEAD,
        measured=False,
        host="reference",
        created="2026-11-22",
        source={
            "*": "reference profile, NOT measured by elixir: vendor specifications and approximate published "
                 "measurements for one DGX H100 node",
            "device_memory_bytes": "80 GB nominal HBM3 (torch reports about 79.6 GiB)",
            "host_memory_bytes": "DGX H100 system memory: 2 TB (NVIDIA DGX H100 datasheet)",
            "disk_bytes": "DGX H100 internal NVMe: 8x 3.84 TB (datasheet)",
            "h2d_pinned": "PCIe Gen5 x16 (64 GB/s theoretical); ~50 GB/s pinned typical (approximate)",
            "h2d_pageable": "approximate: bounce-buffered pageable copies",
            "d2h_pinned": "as h2d_pinned", "d2h_pageable": "as h2d_pageable",
            "device_copy": "HBM3 3.35 TB/s rated; ~2.6 TB/s achievable (approximate)",
            "all_gather": "NVLink 4 / NVSwitch, 900 GB/s per GPU; nccl-tests bus bandwidth ~400+ GB/s at large "
                          "messages on 8x H100 (approximate, published figures)",
            "reduce_scatter": "as all_gather",
            "optimizer_params_per_s": "derived: device = 2.6 TB/s / 28 B per fp32 Adam parameter; host = "
                                      "~450 GB/s STREAM-class bandwidth of 2x Xeon 8480C / 28 B (shared by 8 ranks)",
            "op_overhead_s": OP_OVERHEAD_SOURCE,
            "matmul_flops": "H100 SXM dense bf16/fp16 989 TFLOP/s peak, ~700 achieved on large GEMMs (approximate); "
                            "fp32 without TF32 67 peak, ~50 achieved",
            "disk_read_bytes_per_s": "approximate: 8x U.2 NVMe",
            "disk_write_bytes_per_s": "approximate: 8x U.2 NVMe",
        },
        notes="Planning only. Measure the real node with `elixir hwprofile` under torchrun for accurate plans.",
    )


def workstation() -> HardwareProfile:
    gddr = 900  # GB/s achievable of GDDR6X rated 1008 GB/s
    stream = 65  # GB/s, dual-channel DDR5 desktop
    return HardwareProfile(
        name="1x24GB-workstation",
        device_type="cuda",
        device_name="one 24 GB consumer GPU (RTX 4090 class) in a desktop",
        devices_per_node=1,
        device_memory_bytes=25_393_692_672,
        host_memory_bytes=64 * GiB,
        disk_bytes=2 * 10**12,
        h2d_pinned=curve([(1 * MiB, 10), (16 * MiB, 22), (256 * MiB, 25)]),
        h2d_pageable=curve([(1 * MiB, 5), (16 * MiB, 10), (256 * MiB, 12)]),
        d2h_pinned=curve([(1 * MiB, 10), (16 * MiB, 22), (256 * MiB, 25)]),
        d2h_pageable=curve([(1 * MiB, 5), (16 * MiB, 10), (256 * MiB, 12)]),
        device_copy=curve([(1 * MiB, 300), (16 * MiB, 800), (256 * MiB, gddr)]),
        all_gather=None,
        reduce_scatter=None,
        collective_world=0,
        collective_backend="",
        optimizer_params_per_s={"device": gddr * GB / ADAM_BYTES, "host": stream * GB / ADAM_BYTES},
        optimizer_impl={"device": "fused Adam (memory bound, derived)", "host": "CPU Adam (memory bound, derived)"},
        matmul_flops={"bfloat16": 150e12, "float16": 150e12, "float32": 60e12},
        disk_read_bytes_per_s=6.5 * GB,
        disk_write_bytes_per_s=4.5 * GB,
        overlap=True,
        op_overhead_s=OP_OVERHEAD,
        measured=False,
        host="reference",
        created="2026-11-22",
        source={
            "*": "reference profile, NOT measured by elixir: vendor specifications and approximate published "
                 "measurements for a single 24 GB consumer GPU workstation (world size 1 only: no collectives)",
            "device_memory_bytes": "24 GB nominal GDDR6X (torch reports about 23.6 GiB)",
            "host_memory_bytes": "assumed 64 GiB desktop RAM (edit for your machine)",
            "disk_bytes": "assumed 2 TB NVMe",
            "h2d_pinned": "PCIe Gen4 x16 (32 GB/s theoretical); ~25 GB/s pinned typical (approximate)",
            "h2d_pageable": "approximate: bounce-buffered pageable copies",
            "d2h_pinned": "as h2d_pinned", "d2h_pageable": "as h2d_pageable",
            "device_copy": "GDDR6X 1008 GB/s rated; ~900 GB/s achievable (approximate)",
            "all_gather": "single GPU: no collectives", "reduce_scatter": "single GPU: no collectives",
            "optimizer_params_per_s": "derived: device = 900 GB/s / 28 B per fp32 Adam parameter; host = "
                                      "~65 GB/s dual-channel DDR5 / 28 B",
            "op_overhead_s": OP_OVERHEAD_SOURCE,
            "matmul_flops": "RTX 4090 dense fp16/bf16 with fp32 accumulate 165 TFLOP/s peak, ~150 achieved; "
                            "fp32 82.6 peak, ~60 achieved (approximate)",
            "disk_read_bytes_per_s": "PCIe Gen4 NVMe sequential (vendor class figure)",
            "disk_write_bytes_per_s": "PCIe Gen4 NVMe sequential (vendor class figure)",
        },
        notes="Planning only. Measure your machine with `elixir hwprofile --world-size 1`.",
    )


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    for prof in (a100(), h100(), workstation()):
        path = os.path.join(OUT, f"{prof.name}.json")
        prof.save(path)
        print("wrote", os.path.relpath(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
