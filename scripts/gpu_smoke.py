#!/usr/bin/env python
"""The GPU smoke cases: the paths the CUDA test matrix does not reach, against plain torch.

    python scripts/gpu_smoke.py --out OUT                 # on a GPU machine (gpu_check.sh runs it)
    python scripts/gpu_smoke.py --out OUT --allow-cpu     # the same cases on CPU (a rehearsal)

Cases, at world size 1, bf16 compute with fp32 masters, HybridAdam (its fused kernel on the host,
torch's fused Adam on the device), 3 steps each:

- GPT-2 and LLaMA (the zoo's tiny configs) with every chunk placed ``HH`` (shard and optimizer
  state in host memory), ``DH`` (shard on the device, master and state on the host: the host step
  refreshes the device shard), ``HK`` (state on disk) and ``DD``, each with ``fused_step`` on (the
  step during backward) and off;
- ``gather``: a plan that really gathers at world 1 (``KK``: each chunk's shard on disk, read and
  copied to the device for every use; the ``HH`` cases gather host shards too);
- then ``HH`` and ``DH`` again in a child process under ``TORCH_CUDA_SANITIZER=1`` (CSAN: on one
  GPU the only check that side streams are ordered against compute); on CPU the child runs
  without a sanitizer, rehearsing the call.

The reference is plain torch on the same device: the model in bf16, fp32 master copies stepped by
``torch.optim.AdamW`` with the same hyper-parameters, on the full batch. A case passes when every
loss is within 2e-2 relative of the reference's and every master within 2e-3 (HybridAdam and
AdamW agree to an ulp; the rest is bf16 rounding of a different reduction order).

Each case writes one JSON line to ``OUT/smoke.jsonl`` as soon as it ends (``smoke_sanitizer.jsonl``
for the reruns), so a run that is killed still leaves every finished case: the losses, the
reference's, the largest differences, ``max_memory_allocated`` and ``max_memory_reserved``, the
ledger's device peak, the search's predicted device peak for the plan, and RSS. The last line is a
summary. Exit code 0 when every case passed, 1 when one failed, 3 without a GPU (and no
``--allow-cpu``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from elixir import device as dev  # noqa: E402

STEPS = 3
BATCH = 4
LR, WD = 1e-3, 0.01
LOSS_RTOL, MASTER_ATOL = 2e-2, 2e-3
PLACEMENTS = ("HH", "DH", "HK", "DD")
SANITIZED = ("gpt2-HH-fused", "gpt2-DH-fused", "gpt2-HH", "gpt2-DH")


def all_cases() -> list[tuple[str, str, str, bool]]:
    """(name, model, placement, fused_step), quickest first."""
    out = []
    for model in ("gpt2", "llama"):
        for where in PLACEMENTS:
            for fused in (True, False):
                out.append((f"{model}-{where}{'-fused' if fused else ''}", model, where, fused))
    out.append(("gather-gpt2-KK", "gpt2", "KK", False))
    return out


def _placement(letter: str):
    from elixir.plan import Placement

    return {"D": Placement.DEVICE, "H": Placement.HOST, "K": Placement.DISK}[letter]


def reference(model_name: str, device: torch.device, steps: int) -> tuple[list[float], dict]:
    """Plain torch: the model in bf16, fp32 masters stepped by AdamW, the full batch."""
    from elixir.lowp_gemm import widened_gemms
    from elixir.testing.reference import to_device
    from elixir.testing.zoo import ZOO, build_model

    case = ZOO[model_name]
    torch.manual_seed(0)
    model = build_model(model_name).to(device)
    names = [n for n, _ in model.named_parameters()]
    masters = [torch.nn.Parameter(p.detach().clone().float()) for p in model.parameters()]
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD)
    losses = []
    for step in range(steps):
        for p in model.parameters():
            p.grad = None
        with widened_gemms(torch.bfloat16, device):  # the products as the runtime computes them here
            loss = case.loss(model, to_device(case.make_batch(BATCH, step), device))
        loss.backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = None if p.grad is None else p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        losses.append(loss.float().item())
    return losses, {n: m.detach().cpu() for n, m in zip(names, masters)}


def _predicted_peak(model, plan, batch: dict, step_fn, fused: bool) -> Optional[int]:
    """The search's predicted device peak for ``plan`` (priced as the search prices its candidates)."""
    from elixir.hardware import default_profile
    from elixir.plan import MeshLayout
    from elixir.search.cost_model import Setting, evaluate_plan
    from elixir.search.step_profile import profile_step

    prof = profile_step(model, batch, step_fn, torch.bfloat16)
    st = Setting(layout=MeshLayout.data_parallel(1), elem=2, reduce_elem=2, opt_bytes=8, hardware=default_profile(),
                 dtype="bfloat16", fused_step=fused)
    return int(evaluate_plan(prof, plan, st).device_bytes)


def run_case(name: str, model_name: str, where: str, fused: bool, device: torch.device, steps: int,
             refs: dict, offload_dir: str) -> dict:
    from elixir.optim import HybridAdam
    from elixir.plan import Sharding
    from elixir.search import minimum_waste_search
    from elixir.testing.reference import to_device
    from elixir.testing.zoo import ZOO, build_model
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    rec: dict[str, Any] = {"case": name, "model": model_name, "placement": where, "fused_step": fused,
                           "device": dev.describe(device), "sanitizer": os.environ.get("TORCH_CUDA_SANITIZER") == "1"}
    t0 = time.perf_counter()
    zc = ZOO[model_name]
    if model_name not in refs:
        refs[model_name] = reference(model_name, device, steps)
    ref_losses, ref_masters = refs[model_name]
    torch.manual_seed(0)
    model = build_model(model_name)
    plan = minimum_waste_search(model, 1, unified_dtype=torch.bfloat16)
    shard, optim = _placement(where[0]), _placement(where[1])
    force = where == "KK"  # a disk shard is a sharded chunk's: forced, so that world 1 really gathers
    plan = dataclasses.replace(plan, fused_step=fused, chunks=tuple(
        dataclasses.replace(c, shard_placement=shard, optim_placement=optim, **({"sharding": Sharding.SHARDED} if force else {}))
        for c in plan.chunks))
    try:
        rec["predicted_peak_device_bytes"] = _predicted_peak(model, plan, zc.make_batch(BATCH, 0), zc.step_fn, fused)
    except Exception as e:  # noqa: BLE001 - a missing prediction is reported, not fatal
        rec["predicted_peak_device_bytes"] = None
        rec["prediction_error"] = f"{type(e).__name__}: {e}"[:300]
    dev.synchronize(device)
    dev.reset_peak_memory(device)
    em = ElixirModule(model, plan, dtype=torch.bfloat16, offload_dir=offload_dir)
    opt = ElixirOptimizer(em, HybridAdam([p for p in em.parameters() if p.requires_grad], lr=LR, weight_decay=WD),
                          fused_step=fused)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = zc.loss(em, to_device(zc.make_batch(BATCH, step), em.device))
        loss.backward()
        opt.step()
        losses.append(loss.detach().float().item())
    dev.synchronize(device)
    got = {k: v.float() for k, v in em.state_dict().items()}  # fp32, from the masters
    rep = em.memory_report()
    diffs = [(got[n] - m).abs().max().item() for n, m in ref_masters.items() if n in got]
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    rec.update(
        losses=losses, ref_losses=ref_losses, max_loss_rel_diff=loss_rel,
        max_master_diff=max(diffs) if diffs else None, masters_compared=len(diffs),
        fused_step_active=opt.backward_step is not None, gathers=em.cache.gathers,
        max_memory_allocated=dev.max_memory_allocated(device), max_memory_reserved=dev.max_memory_reserved(device),
        ledger_peak_device_bytes=rep["device_peak_bytes"], rss_bytes=dev.rss_bytes(), peak_rss_bytes=dev.peak_rss_bytes(),
        pinned_bytes=dev.pinned_bytes(), seconds=time.perf_counter() - t0,
    )
    problems = []
    if loss_rel > LOSS_RTOL:
        problems.append(f"loss differs by {loss_rel:.2e} relative (> {LOSS_RTOL})")
    if not diffs or max(diffs) > MASTER_ATOL:
        problems.append(f"masters differ by {max(diffs) if diffs else 'nothing compared'} (> {MASTER_ATOL})")
    if fused and opt.backward_step is None:
        problems.append(f"fused_step fell back: {opt.fused_step_fallback}")
    if where[0] in "HK" and em.cache.gathers == 0:
        problems.append("a host or disk shard plan that never gathered")
    if em.disk_store is not None:
        em.disk_store.close()
    rec["status"] = "ok" if not problems else "FAILED: " + "; ".join(problems)
    return rec


def _write(path: str, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for smoke.jsonl (and smoke_sanitizer.jsonl)")
    p.add_argument("--allow-cpu", action="store_true", help="run the cases on CPU when there is no GPU (a rehearsal)")
    p.add_argument("--cases", nargs="+", default=None, help="run only these cases (names as in smoke.jsonl)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--no-sanitizer", action="store_true", help="skip the TORCH_CUDA_SANITIZER=1 reruns")
    p.add_argument("--name", default="smoke", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device = dev.default_device()
    if device.type != "cuda" and not args.allow_cpu:
        print("gpu_smoke: NO GPU (torch.cuda.is_available() is False); pass --allow-cpu to rehearse on CPU", file=sys.stderr)
        return 3
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, args.name + ".jsonl")
    open(path, "w").close()
    cases = [c for c in all_cases() if args.cases is None or c[0] in args.cases]
    unknown = set(args.cases or []) - {c[0] for c in all_cases()}
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; known: {[c[0] for c in all_cases()]}")
    refs: dict = {}
    results = []
    with tempfile.TemporaryDirectory(prefix="elixir_smoke_") as offload_dir:
        for name, model_name, where, fused in cases:
            try:
                rec = run_case(name, model_name, where, fused, device, args.steps, refs, offload_dir)
            except Exception as e:  # noqa: BLE001 - every case is reported, the others still run
                rec = {"case": name, "status": f"ERROR: {type(e).__name__}: {e}"[:800], "traceback": traceback.format_exc()[-3000:]}
            _write(path, rec)
            results.append(rec)
            print(f"[smoke] {name}: {rec['status']}", flush=True)
    if not args.no_sanitizer:
        results += _sanitized(args, device)
    failed = [r["case"] for r in results if r.get("status") != "ok"]
    _write(path, {"summary": {"cases": len(results), "ok": len(results) - len(failed), "failed": failed,
                              "device": dev.describe(device)}})
    print(f"[smoke] {len(results) - len(failed)}/{len(results)} ok" + (f"; failed: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


def _sanitized(args: argparse.Namespace, device: torch.device) -> list:
    """Rerun HH and DH in a child under TORCH_CUDA_SANITIZER=1 (it must be set before torch is
    imported); its lines go to smoke_sanitizer.jsonl and are returned."""
    env = dict(os.environ)
    env.pop("TORCH_CUDA_SANITIZER", None)  # torch enables it for any value
    if device.type == "cuda":
        env["TORCH_CUDA_SANITIZER"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--name", "smoke_sanitizer", "--no-sanitizer",
           "--steps", str(args.steps), "--cases", *SANITIZED] + (["--allow-cpu"] if args.allow_cpu else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    path = os.path.join(args.out, "smoke_sanitizer.jsonl")
    lines = []
    if os.path.exists(path):
        with open(path) as f:
            lines = [json.loads(x) for x in f if x.strip()]
    recs = [dict(x, case="sanitizer/" + x["case"]) for x in lines if "case" in x]
    if r.returncode not in (0, 1) or len(recs) < len(SANITIZED):
        recs.append({"case": "sanitizer", "status": f"ERROR: exit {r.returncode}: {(r.stderr or '')[-1500:]}"})
    for rec in recs:
        print(f"[smoke] {rec['case']}: {rec['status']}", flush=True)
    return recs


if __name__ == "__main__":
    sys.exit(main())
