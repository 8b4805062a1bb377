"""Predictions hold: peak RSS against the search's predicted peak for several plans and sizes.

Each configuration runs ``bench/memory_breakdown.py`` in a fresh process (so each peak RSS is its
own): a LLaMA-style model at world 1, bf16 chunks, HybridAdam, ``optimal_search`` under the
device/host budgets given per parameter (the shape of issue 21's 2B run: device 3.5 B/param +
0.5 GiB, host 5.5 B/param + 0.5 GiB, so optimizer state goes to disk and host), ``--steps`` steps. Then the
same plan once more with the optimizer step after backward (``--separate-step``), for the
fused backward-and-step's speed in the same run. Reported per size: the plan, predicted and
measured peak, their ratio (done when measured <= predicted and >= 0.9 predicted), steady RSS per
parameter, and step times fused / separate.

    python bench/memory_predictions.py --sizes 0.1,0.2             # smoke (a few minutes)
    python bench/memory_predictions.py --sizes 0.5,1,1.5,2,2.5     # the issue's table (quiet box, long)
    python bench/memory_predictions.py --sizes 0.5 --disk-plan state --meta   # fused vs separate, state on disk

``--disk-plan state`` (or ``shards``) plans each size under the tightest one-pool budget that
keeps every compute shard resident (or the tightest at all), so the optimizer state (and the
least-used shards) is on disk whatever the size; the per-parameter budgets are then unused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# (hidden, intermediate, layers) of LLaMA-style models, vocab 32000, by approximate size in billions
SHAPES = {
    0.02: (256, 704, 4), 0.1: (768, 2048, 10), 0.2: (1024, 2816, 12), 0.5: (1536, 4096, 14), 1.0: (2048, 5504, 16),
    1.5: (2048, 5504, 26), 2.0: (2560, 6912, 20), 2.5: (2560, 6912, 26), 3.0: (3072, 8192, 21),
    4.0: (3072, 8192, 29),
}


def _run(args: list, out: str) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "memory_breakdown.py"), *args, "--json", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        head = next((x for x in lines if "Error" in x), lines[-1] if lines else "failed")
        return {"error": head[:300]}
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.1,0.2", help=f"billions, from {sorted(SHAPES)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--device-per-param", type=float, default=3.5)
    ap.add_argument("--host-per-param", type=float, default=5.5)
    ap.add_argument("--device-extra", type=float, default=0.5, help="GiB added to the device budget (activations)")
    ap.add_argument("--host-extra", type=float, default=0.5, help="GiB added to the host budget (the process)")
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--no-separate", action="store_true", help="skip the separate-step run")
    ap.add_argument("--disk-plan", default="none", choices=("none", "state", "shards"),
                    help="plan under the tightest budget that keeps shards resident (state) or at all (shards): "
                         "optimizer state on disk at any size (see bench/memory_breakdown.py)")
    ap.add_argument("--meta", action="store_true", help="build on the meta device, as bench/capacity.py")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    GiB = 2**30
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in (float(x) for x in args.sizes.split(",")):
            h, inter, layers = SHAPES[size]
            n = (2 * 32000 * h + layers * (4 * h * h + 3 * h * inter))  # close enough for the budgets
            common = ["--hidden", str(h), "--inter", str(inter), "--layers", str(layers), "--seq", str(args.seq),
                      "--steps", str(args.steps)]
            if args.offload_dir:
                common += ["--offload-dir", args.offload_dir]
            if args.meta:
                common += ["--meta"]
            plan = os.path.join(tmp, f"plan-{size}.json")
            budget = ["--device-memory", f"{n * args.device_per_param / GiB + args.device_extra:.4f}",
                      "--host-memory", f"{n * args.host_per_param / GiB + args.host_extra:.4f}"]
            if args.disk_plan != "none":
                budget = ["--disk-plan", args.disk_plan]
            fused = _run(common + budget + ["--save-plan", plan], os.path.join(tmp, f"a-{size}.json"))
            sep = {} if args.no_separate or "error" in fused else _run(
                common + ["--plan", plan, "--separate-step"], os.path.join(tmp, f"b-{size}.json"))
            rows.append((size, fused, sep))
            print(size, json.dumps(fused)[:300], flush=True)
    t = Table(title=f"peak RSS vs prediction, world 1, bf16, HybridAdam, seq {args.seq}, {args.steps} steps")
    for c in ("model", "plan", "grads / fused", "predicted GiB", "peak RSS GiB", "ratio", "holds", "steady B/param",
              "step s (fused)", "step s (separate)", "fused / separate"):
        t.add_column(c, justify="right")
    for size, a, b in rows:
        if "error" in a:
            t.add_row(f"{size}B", a["error"], *[""] * 9)
            continue
        ratio = a["measured"] / a["predicted"]
        tf = statistics.median(a["step_s"][1:] or a["step_s"])
        ts = statistics.median(b["step_s"][1:] or b["step_s"]) if b and "step_s" in b else None
        t.add_row(f"{a['params'] / 1e9:.2f}B", " ".join(f"{k}x{v}" for k, v in sorted(a["plan"].items())),
                  f"{a['grad_dtype']} / {'yes' if a['fused'] else 'no'}", f"{a['predicted'] / GiB:.2f}",
                  f"{a['measured'] / GiB:.2f}", f"{ratio:.3f}", "yes" if 0.9 <= ratio <= 1.0 else "NO",
                  f"{a['bytes_per_param']:.2f}", f"{tf:.2f}", "" if ts is None else f"{ts:.2f}",
                  "" if ts is None else f"{tf / ts:.2f}")
    Console(width=200).print(t)


if __name__ == "__main__":
    main()
