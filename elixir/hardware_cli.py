"""``elixir hwprofile``: measure this machine into a hardware-profile JSON the search reads."""

from __future__ import annotations

import argparse
import contextlib
import os
import time

from rich.console import Console
from rich.table import Table

from elixir import profiling
from elixir.distributed import init_distributed
from elixir.hardware import GiB, MiB, load_profile, local_profile_path
from elixir.profiling.calibrate import calibrate_profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None,
                        help="where to write the profile (default: this machine's local profile, "
                             "$ELIXIR_HARDWARE or ~/.cache/elixir/hardware.json, which `elixir plan` and "
                             "optimal_search then use by default)")
    parser.add_argument("--dir", default=None, help="offload directory to time the disk in (default: the temp dir)")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller measurements (~10 s)")
    parser.add_argument(
        "--world-size", type=int, default=2,
        help="local ranks to spawn for the collective measurement when not under torchrun (1 skips it)",
    )
    parser.add_argument("--no-calibrate", action="store_true",
                        help="skip the runtime calibration (training a small reference model on 1 and "
                             "--world-size local ranks; about 20 s)")
    parser.add_argument("--name", default=None, help="profile name (default from the host name)")
    parser.add_argument("--show", metavar="PROFILE", default=None,
                        help="print an existing profile (path or reference name) instead of measuring")


def render(profile, console=None) -> None:
    """Print a profile as a rich table."""
    console = console or Console()
    t = Table(title=f"hardware profile {profile.name} ({'measured' if profile.measured else 'reference'})")
    t.add_column("quantity")
    t.add_column("value")  # left-aligned: curves and long names wrap into a readable paragraph
    t.add_column("source")

    def gbs(x: float) -> str:
        return f"{x / 1e9:.2f} GB/s"

    src = profile.source
    t.add_row("device", profile.device_name, src.get("*", ""))
    t.add_row("device memory", f"{profile.device_memory_bytes / GiB:.1f} GiB", src.get("device_memory_bytes", ""))
    t.add_row("host memory / node", f"{profile.host_memory_bytes / GiB:.1f} GiB", src.get("host_memory_bytes", ""))
    for key in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable", "device_copy", "all_gather", "reduce_scatter"):
        c = getattr(profile, key)
        if c is None:
            t.add_row(key, "not measured", "")
            continue
        t.add_row(key, " ".join(gbs(b) for b in c.bytes_per_s), src.get(key, ""))
    for k, v in profile.optimizer_params_per_s.items():
        t.add_row(f"Adam on {k}", f"{v / 1e6:.0f} Mparam/s", profile.optimizer_impl.get(k, ""))
    for k, ratios in profile.optimizer_format_ratio.items():
        t.add_row(f"Adam state formats on {k} (time vs fp32)", ", ".join(f"{f} {r:.2f}x" for f, r in ratios.items()),
                  src.get("optimizer_format_ratio", ""))
    if not profile.optimizer_format_ratio:
        t.add_row("Adam state formats (time vs fp32)", "not measured: priced at the fp32 rate", "")
    for k, rates in profile.frozen_decode_elements_per_s.items():
        t.add_row(f"{k} frozen shard decode", ", ".join(f"to {d} {v / 1e9:.2f} Gelem/s" for d, v in rates.items()),
                  src.get("frozen_decode_elements_per_s", ""))
    if not profile.frozen_decode_elements_per_s:
        t.add_row("quantised frozen shard decode", "not measured: priced as a device copy of the decoded bytes", "")
    for k, v in profile.matmul_flops.items():
        t.add_row(f"matmul {k}", f"{v / 1e12:.3f} TFLOP/s", src.get("matmul_flops", ""))
    for k, c in profile.matmul_curve.items():
        t.add_row(f"matmul {k} by size", " ".join(f"{v / 1e9:.0f}" for v in c.bytes_per_s) + " GFLOP/s",
                  src.get("matmul_curve", ""))
    for k, c in profile.matmul_bytes_curve.items():
        t.add_row(f"matmul {k} operand bytes by size", " ".join(gbs(b) for b in c.bytes_per_s),
                  src.get("matmul_bytes_curve", ""))
    if not profile.matmul_bytes_curve:
        t.add_row("matmul operand bytes", "not measured: matmuls priced by their FLOPs alone", "")
    if profile.elementwise is not None:
        t.add_row("elementwise by size", " ".join(gbs(b) for b in profile.elementwise.bytes_per_s), src.get("elementwise", ""))
    if profile.op_overhead_s:
        t.add_row("per-op overhead", f"{profile.op_overhead_s * 1e6:.2f} us", src.get("op_overhead_s", ""))
    if profile.first_touch_bytes_per_s:
        t.add_row("first touch of fresh memory", gbs(profile.first_touch_bytes_per_s), src.get("first_touch_bytes_per_s", ""))
    default = "the default, measured on the CPU box (see HardwareProfile)"
    t.add_row("step: untracked / first-step growth",
              f"{profile.step_untracked_bytes / MiB:.0f} MiB / {profile.step_growth_bytes / MiB:.0f} MiB",
              src.get("step_untracked_bytes", default))
    t.add_row("step: heap slack per activation byte (disk plans)",
              f"{profile.heap_slack_per_activation_byte:.2f} ({profile.disk_plan_heap_slack_per_activation_byte:.2f})",
              src.get("heap_slack_per_activation_byte", default))
    for k, f in sorted(profile.calibration.items()):
        t.add_row(f"calibration, {k} rank(s)/node",
                  " ".join(f"{n} {v * 1e6:.1f} us" if n.endswith("_s") else f"{n} x{v:.2f}" for n, v in f.items()),
                  "measured / predicted step components of elixir's runtime (see source.calibration)")
    t.add_row("disk read / write", f"{gbs(profile.disk_read_bytes_per_s)} / {gbs(profile.disk_write_bytes_per_s)}",
              src.get("disk_read_bytes_per_s", ""))
    console.print(t)


def main(args: argparse.Namespace) -> int:
    console = Console()
    if args.show:
        render(load_profile(args.show), console)
        return 0
    rank = init_distributed().rank if "RANK" in os.environ else 0  # under torchrun: all ranks measure collectives
    opts = profiling.MeasureOptions.quick(args.dir) if args.quick else profiling.MeasureOptions(
        offload_dir=args.dir or profiling.MeasureOptions().offload_dir
    )
    t0 = time.perf_counter()
    status_cm = console.status("measuring") if rank == 0 else contextlib.nullcontext()
    with status_cm as status:
        prof = profiling.measure(
            opts, collective_world=args.world_size, name=args.name,
            progress=(lambda s: status.update(f"measuring {s}")) if status is not None else None,
        )
    if rank != 0:
        return 0
    if not args.no_calibrate and "RANK" not in os.environ:
        ranks = (1,) + ((args.world_size,) if args.world_size > 1 and prof.all_gather is not None else ())
        with console.status("calibrating") as status:
            prof = calibrate_profile(prof, ranks, say=lambda s: status.update(s))
    out = args.out or local_profile_path()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    prof.save(out)
    render(prof, console)
    console.print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return 0
