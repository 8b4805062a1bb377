"""Tracer scale: profile a whole training step of a huge model on this CPU box, no weights.

Each configuration runs in a fresh subprocess (so peak RSS and wall include Python, torch and
transformers imports, model construction on meta and the trace). The peer is torch's own
``MemTracker`` under ``FakeTensorMode`` on the same step, run the same way.

    python bench/tracer.py                       # OPT-175B, batch 1, seq 2048, bf16, ckpt off/on
    python bench/tracer.py --model opt-13b --peer  # also time the MemTracker peer
    python bench/tracer.py --accuracy            # predicted vs measured per model (zoo, small HF)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _one_elixir(model_name: str, batch: int, seq: int, ckpt: bool) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    import torch

    from elixir import models
    from elixir.tracer import memory_profiling

    t1, c1 = time.perf_counter(), time.process_time()
    m = models.build_model(model_name)
    if ckpt:
        models.enable_checkpointing(m)
    b = models.make_batch(m, batch, seq)
    t2, c2 = time.perf_counter(), time.process_time()
    p = memory_profiling(m, b, models.lm_step_fn, torch.bfloat16)
    t3, c3 = time.perf_counter(), time.process_time()
    return dict(import_s=t1 - t0, build_s=t2 - t1, trace_s=t3 - t2, import_cpu_s=c1 - c0, build_cpu_s=c2 - c1,
                trace_cpu_s=c3 - c2, param=p.param_occ, grad=p.grad_occ,
                act=p.activation_occ, phases=p.phase_peaks, ops=p.num_ops, steps=len(p.order.steps),
                total=p.total_peak)


def _one_memtracker(model_name: str, batch: int, seq: int, ckpt: bool) -> dict:
    t0 = time.perf_counter()
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from elixir import models

    t1 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with FakeTensorMode():
        m = models.build_model(model_name, device="cpu")
        if ckpt:
            models.enable_checkpointing(m)
        b = models.make_batch(m, batch, seq, device="cpu")
        t2 = time.perf_counter()
        mt = MemTracker()
        mt.track_external(m)
        with mt:
            models.lm_step_fn(m, b)
    t3 = time.perf_counter()
    snap = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
    return dict(import_s=t1 - t0, build_s=t2 - t1, trace_s=t3 - t2, total=snap["Total"])


def _child(args: argparse.Namespace) -> None:
    fn = _one_elixir if args.child == "elixir" else _one_memtracker
    from elixir import device as dev

    out = fn(args.model, args.batch, args.seq, args.ckpt)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["rss_gb"] = dev.peak_rss_bytes() / 1e9
    out["cpu_s"] = ru.ru_utime + ru.ru_stime
    print("RESULT " + json.dumps(out))


def _run(system: str, args: argparse.Namespace, ckpt: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", system, "--model", args.model, "--batch", str(args.batch),
           "--seq", str(args.seq)] + (["--ckpt"] if ckpt else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return dict(error=(proc.stderr.strip().splitlines() or ["no output"])[-1], wall_s=wall)
    return dict(json.loads(line[7:]), wall_s=wall)


def accuracy() -> None:
    """Predicted (meta) vs measured (same step on real CPU tensors, same accounting) per model."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from elixir import models
    from elixir.testing.zoo import ZOO, build_model
    from elixir.tracer import memory_profiling

    cases = []
    for name, case in ZOO.items():
        cases.append((f"tiny {name}", lambda n=name: build_model(n), case.make_batch(2, 0), case.step_fn, None))
    for name in ("gpt2", "opt", "llama", "bert"):
        case = ZOO[name]
        for re in (False, True):
            cases.append((f"tiny {name}", lambda n=name: build_model(n), case.make_batch(2, 0), case.step_fn, re))
    for name, kw in models.SMALL_OVERRIDES.items():
        for re in (None, False):
            torch.manual_seed(0)
            m = models.build_model(name, device="cpu", **kw)
            cases.append((f"small {name}", lambda m=m: m, models.make_batch(m, 2, 64, device="cpu"),
                          models.lm_step_fn, re))
    t = Table(title="tracer accuracy: predicted on meta vs measured on real CPU tensors (fp32)")
    for c in ("model", "checkpointing", "pred act", "meas act", "err %", "pred fwd/rec/bwd peaks",
              "meas fwd/rec/bwd peaks", "order equal"):
        t.add_column(c, justify="right")
    for label, build, batch, step, re in cases:
        model = build()
        if re is not None:
            models.enable_checkpointing(model, reentrant=re)
        pm = memory_profiling(model, batch, step)
        pr = memory_profiling(model, batch, step, target="real")
        if re is not None:
            model.gradient_checkpointing_disable()
        err = 100 * (pm.activation_occ - pr.activation_occ) / pr.activation_occ
        t.add_row(label, "off" if re is None else ("reentrant" if re else "non-reentrant"), f"{pm.activation_occ:,}",
                  f"{pr.activation_occ:,}", f"{err:+.2f}", "/".join(f"{v:,}" for v in pm.phase_peaks.values()),
                  "/".join(f"{v:,}" for v in pr.phase_peaks.values()),
                  str(pm.order.params_per_step == pr.order.params_per_step))
    Console(width=220).print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-175b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--peer", action="store_true", help="also run MemTracker under FakeTensorMode")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--accuracy", action="store_true", help="print the accuracy table (meta vs real CPU) and exit")
    ap.add_argument("--child", choices=["elixir", "memtracker"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    if args.accuracy:
        accuracy()
        return
    from rich.console import Console
    from rich.table import Table

    gb = 1e9
    t = Table(title=f"tracer scale: {args.model}, batch {args.batch} x seq {args.seq}, bf16 (one process each)")
    for c in ("system", "ckpt", "wall s", "cpu s", "trace s", "peak RSS GB", "param GB", "grad GB", "act GB", "total peak GB",
              "cpu ratio vs elixir"):
        t.add_column(c, justify="right")
    for ckpt in (False, True):
        ours = _run("elixir", args, ckpt)
        rows = [("elixir", ours)]
        if args.peer:
            rows.append(("MemTracker+FakeTensor", _run("memtracker", args, ckpt)))
        for name, r in rows:
            if "error" in r:
                t.add_row(name, str(ckpt), f"{r['wall_s']:.1f}", "-", "-", "-", "-", "-", "-", "-", r["error"][:40])
                continue
            t.add_row(
                name, str(ckpt), f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", f"{r['trace_s']:.2f}", f"{r['rss_gb']:.2f}",
                f"{r['param'] / gb:.1f}" if "param" in r else "-", f"{r['grad'] / gb:.1f}" if "grad" in r else "-",
                f"{r['act'] / gb:.2f}" if "act" in r else "-", f"{r['total'] / gb:.1f}",
                f"{r['cpu_s'] / ours['cpu_s']:.2f}" if "error" not in ours else "-",
            )
        for name, r in rows:
            Console(width=200).print_json(json.dumps({"system": name, "ckpt": ckpt, **r}))
    Console(width=200).print(t)


if __name__ == "__main__":
    main()
