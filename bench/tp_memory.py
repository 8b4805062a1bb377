"""Per-rank peak memory of tensor parallelism x sharded data parallelism: elixir against FSDP2 + TP.

Issue 31's memory check: on the same (dp_shard 2, tp 2) mesh (world 4, gloo), the same LLaMA-style
model, batch and AdamW, the peak resident memory of one rank while training:

- **elixir**: ``tensor_parallel`` (torch's ``parallelize_module`` with the model's own plan), then
  ``ElixirModule`` with ZeRO-3 chunks of each rank's local shards over dp_shard
  (``minimum_waste_search``), ``ElixirOptimizer`` over ``torch.optim.AdamW``;
- **FSDP2 + TP** (torchtitan's composition): ``parallelize_module`` with the same plan, then
  ``fully_shard`` on each decoder layer and the root over dp_shard, ``torch.optim.AdamW``.

Both fp32, both built eagerly on the CPU from the same seed. Each system runs in its own fresh
processes (spawned, so nothing is inherited). Per rank: the RSS before the model is built is the
baseline; after construction, ``gc`` and ``malloc_trim`` return what building left behind and the
peak (``VmHWM``) is reset (``/proc/self/clear_refs``); the figure is the peak over the training
steps less the baseline. The table prints the largest rank's figure per system and the ratio.

    python bench/tp_memory.py                 # hidden 1024, 8 layers (about 120M parameters)
    python bench/tp_memory.py --tiny          # a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elixir import device as dev  # noqa: E402 - after the path fix: runs from a checkout
from elixir.testing import run_distributed  # noqa: E402

SIZES = {"tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256),
         "default": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, vocab_size=8192)}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - transformers: the hf extra

    torch.manual_seed(0)
    cfg = LlamaConfig(num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                      tie_word_embeddings=False, attn_implementation="sdpa", **SIZES[size])
    return LlamaForCausalLM(cfg)


def _elixir(model, mesh):
    from elixir.parallel import tensor_parallel  # noqa: PLC0415 - each system imports only its own stack
    from elixir.plan import MeshLayout  # noqa: PLC0415
    from elixir.search import minimum_waste_search  # noqa: PLC0415
    from elixir.wrapper import ElixirModule, ElixirOptimizer  # noqa: PLC0415

    model = tensor_parallel(model, mesh)
    plan = minimum_waste_search(model, MeshLayout(dp_shard=mesh["dp_shard"].size(), tp=mesh["tp"].size()))
    em = ElixirModule(model, plan, mesh=mesh)
    return em, ElixirOptimizer(em, torch.optim.AdamW(em.parameters(), lr=1e-4))


def _elixir_predicted(model, mesh, batch: int, seq: int):
    """elixir with the plan ``elixir plan --tp`` makes (``search_mesh`` on the cpu-box profile, from
    a meta trace of the whole model at this rank's batch): its predicted device + host bytes are
    checked against the measured peak (issue 31: the mesh prediction checked on a layout this box runs)."""
    from elixir.hardware import load_profile  # noqa: PLC0415 - each system imports only its own stack
    from elixir.models import lm_step_fn  # noqa: PLC0415
    from elixir.parallel import tensor_parallel  # noqa: PLC0415
    from elixir.plan import MeshLayout  # noqa: PLC0415
    from elixir.plan.tensor_plans import local_shapes, style_plan  # noqa: PLC0415
    from elixir.search.mesh_profile import search_mesh  # noqa: PLC0415
    from elixir.search.step_profile import profile_step  # noqa: PLC0415
    from elixir.wrapper import ElixirModule, ElixirOptimizer  # noqa: PLC0415

    with torch.device("meta"):
        meta = type(model)(model.config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    prof = profile_step(meta, {"input_ids": ids, "labels": ids}, lm_step_fn)
    tp, dp = mesh["tp"].size(), mesh["dp_shard"].size()
    shapes = local_shapes(prof.params, style_plan(meta), tp)
    mp = search_mesh(prof, MeshLayout(dp_shard=dp, tp=tp), tp_shapes=shapes, hidden=model.config.hidden_size,
                     microbatches=1, hardware=load_profile("cpu-box"), device_memory=64 << 30, host_memory=64 << 30,
                     optimizer_type="AdamW")
    plan = mp.stages[0]
    model = tensor_parallel(model, mesh)
    em = ElixirModule(model, plan, mesh=mesh)
    p = plan.prediction
    em.predicted_bytes = p.peak_device_bytes + p.peak_host_bytes
    em.predicted_terms = {"step_s": p.step_time_s, "memory": plan.info.get("predicted_memory", {})}
    return em, ElixirOptimizer(em, torch.optim.AdamW(em.parameters(), lr=1e-4))


class _PipelineRun:
    """An :class:`~elixir.parallel.ElixirPipeline` behind the worker's loop: ``run(input_ids=,
    labels=)`` is the whole step (its forwards and backwards); ``.loss`` the last stage's mean
    loss, 0 elsewhere (no backward left to run)."""

    def __init__(self, pipe, predicted: int, terms: dict) -> None:
        self.pipe, self.predicted_bytes, self.predicted_terms = pipe, predicted, terms

    def __call__(self, input_ids, labels):
        loss = self.pipe.step(input_ids, labels)
        return argparse.Namespace(loss=loss.detach() if loss is not None else torch.zeros(()))

    def memory_report(self) -> dict:
        return self.pipe.modules[0].memory_report()


def _elixir_pipeline_predicted(model, mesh, batch: int, seq: int, microbatches: int = 4):
    """PP2 x DP2 (1F1B) with each stage on the plan ``elixir plan --pp 2`` makes (``search_mesh`` on
    the cpu-box profile): this rank's stage's predicted device + host bytes against its peak."""
    from elixir.hardware import load_profile  # noqa: PLC0415 - each system imports only its own stack
    from elixir.models import lm_step_fn  # noqa: PLC0415
    from elixir.parallel import ElixirPipeline, PipelineOptimizer  # noqa: PLC0415
    from elixir.plan import MeshLayout  # noqa: PLC0415
    from elixir.search.mesh_profile import search_mesh  # noqa: PLC0415
    from elixir.search.step_profile import profile_step  # noqa: PLC0415

    with torch.device("meta"):
        meta = type(model)(model.config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    prof = profile_step(meta, {"input_ids": ids, "labels": ids}, lm_step_fn)
    mp = search_mesh(prof, MeshLayout(pp=2, dp_shard=2), tp_shapes=None, hidden=model.config.hidden_size,
                     microbatches=microbatches, hardware=load_profile("cpu-box"), device_memory=64 << 30,
                     host_memory=64 << 30, optimizer_type="AdamW")
    pipe = ElixirPipeline(model, mesh, microbatches, plan_fn=lambda stage, layout: mp.stages[stage.index])
    plan = mp.stages[pipe.pp_rank]
    p = plan.prediction
    terms = {"step_s": p.step_time_s, "memory": plan.info.get("predicted_memory", {}),
             "accumulation": plan.info.get("accumulation_bytes", 0), "stage": pipe.pp_rank}
    run = _PipelineRun(pipe, p.peak_device_bytes + p.peak_host_bytes, terms)
    return run, PipelineOptimizer(pipe, lambda ps: torch.optim.AdamW(ps, lr=1e-4))


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - each system imports only its own stack
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415

    from elixir.parallel import plan_for  # noqa: PLC0415 - the same plan as elixir's line

    parallelize_module(model, mesh["tp"], plan_for(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def worker(system: str, size: str, steps: int, batch: int, seq: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - inside the spawned rank

    pipelined = system == "elixir_mesh_plan_pp"
    if pipelined:  # the FSDP2 line imports none of elixir's stack
        from elixir.parallel import pipeline_mesh  # noqa: PLC0415
        from elixir.plan import MeshLayout  # noqa: PLC0415

        mesh = pipeline_mesh(MeshLayout(pp=2, dp_shard=2))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    gc.collect()
    dev.trim_host_memory()
    base = dev.rss_bytes()
    if system == "elixir_mesh_plan":
        model, opt = _elixir_predicted(_model(size), mesh, batch, seq)
    elif pipelined:
        model, opt = _elixir_pipeline_predicted(_model(size), mesh, batch, seq)
    else:
        model, opt = (_elixir if system == "elixir" else _fsdp)(_model(size), mesh)
    gc.collect()
    dev.trim_host_memory()
    built = dev.rss_bytes() - base
    _reset_peak()
    dp_rank = mesh.get_local_rank("dp_shard")
    g = torch.Generator().manual_seed(1 + dp_rank)  # each dp rank its own batch; tp ranks the same
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        ids = torch.randint(0, SIZES[size]["vocab_size"], (batch, seq), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        if loss.requires_grad:  # a pipeline's step ran its backwards already
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    report = model.memory_report() if hasattr(model, "memory_report") else {}
    return {"peak": dev.peak_rss_bytes() - base, "built": built, "losses": losses,
            "step_s": (time.perf_counter() - t0) / steps, "predicted": getattr(model, "predicted_bytes", None),
            "predicted_terms": getattr(model, "predicted_terms", None),
            "ledger_peaks": {k: v for k, v in report.items() if k.startswith("peak_")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a smoke run at toy sizes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--predicted", action="store_true",
                    help="also run elixir on the mesh search's own plan and print its prediction against the peak")
    ap.add_argument("--prediction-only", action="store_true",
                    help="run only elixir on the mesh search's plan (the prediction check, without the comparison)")
    args = ap.parse_args()
    size = "tiny" if args.tiny else "default"
    out = {"size": SIZES[size], "steps": args.steps, "batch": args.batch, "seq": args.seq,
           "load_average": os.getloadavg(), "torch": torch.__version__}
    systems = ("elixir", "fsdp2_tp") + (("elixir_mesh_plan", "elixir_mesh_plan_pp") if args.predicted else ())
    if args.prediction_only:
        systems = ("elixir_mesh_plan", "elixir_mesh_plan_pp")
    for system in systems:
        ranks = run_distributed(worker, 4, system, size, args.steps, args.batch, args.seq, timeout=1800)
        out[system] = {"peak_bytes_max_rank": max(r["peak"] for r in ranks), "per_rank_peak": [r["peak"] for r in ranks],
                       "built_bytes_max_rank": max(r["built"] for r in ranks), "losses": ranks[0]["losses"],
                       "step_s": max(r["step_s"] for r in ranks), "predicted": ranks[0]["predicted"],
                       "predicted_terms": ranks[0]["predicted_terms"], "ledger_peaks": [r["ledger_peaks"] for r in ranks],
                       "per_rank": [{"peak": r["peak"], "predicted": r["predicted"], "terms": r["predicted_terms"]}
                                    for r in ranks]}
    if args.prediction_only:
        _print_predictions(out)
        return _dump(out, args.json)
    ratio = out["elixir"]["peak_bytes_max_rank"] / max(1, out["fsdp2_tp"]["peak_bytes_max_rank"])
    out["ratio_elixir_over_fsdp2_tp"] = ratio
    print(f"{'system':<10} {'peak/rank (MiB)':>16} {'after build (MiB)':>18} {'step (s)':>9}  losses")
    for system in ("elixir", "fsdp2_tp"):
        r = out[system]
        print(f"{system:<10} {r['peak_bytes_max_rank'] / 2**20:>16.1f} {r['built_bytes_max_rank'] / 2**20:>18.1f} "
              f"{r['step_s']:>9.2f}  {[round(x, 4) for x in r['losses']]}")
    print(f"elixir / FSDP2+TP peak per rank: {ratio:.3f}x (target <= 1.0); load average {out['load_average']}")
    if args.predicted:
        _print_predictions(out)
    return _dump(out, args.json)


def _print_predictions(out: dict) -> None:
    _print_prediction(out["elixir_mesh_plan"])
    print("PP2 x DP2 (1F1B, 4 microbatches), each stage on `elixir plan --pp 2`'s plan; per rank, measured "
          "peak over pre-build RSS / predicted device + host:")
    for rank, r in enumerate(out["elixir_mesh_plan_pp"]["per_rank"]):
        t = r["terms"]
        print(f"  rank {rank} (stage {t['stage']}): {r['peak'] / 2**20:.1f} / {r['predicted'] / 2**20:.1f} MiB = "
              f"{r['peak'] / r['predicted']:.3f}x (accumulation term {t['accumulation'] / 2**20:.1f} MiB); "
              f"step {out['elixir_mesh_plan_pp']['step_s']:.2f} s measured, {t['step_s']:.2f} s predicted")
        if rank % 2 == 0:  # one rank of each stage: the terms of its prediction
            print("    predicted memory terms (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in t["memory"].items()))


def _print_prediction(r: dict) -> None:
    """The mesh search's prediction against the run of its own plan: bytes, step time, and the
    predicted memory terms beside the runtime ledger's peaks (largest rank)."""
    print(f"elixir with `elixir plan --tp 2` 's plan: {r['peak_bytes_max_rank'] / 2**20:.1f} MiB measured "
          f"(largest rank, over its pre-build RSS) against {r['predicted'] / 2**20:.1f} MiB predicted "
          f"(device + host, with the step growth search_mesh adds): {r['peak_bytes_max_rank'] / r['predicted']:.3f}x")
    terms = r["predicted_terms"] or {}
    print(f"step time: {r['step_s']:.2f} s measured (slowest rank, mean of the steps) against "
          f"{terms.get('step_s', 0.0):.2f} s predicted on the cpu-box profile")
    print("predicted memory terms (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in terms.get("memory", {}).items()))
    peaks = max(r["ledger_peaks"], key=lambda p: sum(p.values()) if p else 0)
    print("runtime ledger peaks (MiB): " + ", ".join(f"{k[5:]} {v / 2**20:.1f}" for k, v in peaks.items()))


def _dump(out: dict, path) -> int:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
