"""Search benchmark: predictions against the runtime, optimal vs minimum_waste, and scale.

Run: ``python bench/search.py [--steps 6] [--hardware cpu-box] [--skip-scale] [--only-scale]``

1. **Predictions vs measured.** For several (model, world size, device budget) configurations,
   ``optimal_search`` plans with the measured hardware profile of this box; the runtime then trains
   a few steps under the plan with its device-memory budget enforced (``memory_limit``: the budget
   after margins, less what the runtime does not account: activations, buffers, optimizer moments).
   Reported: predicted vs measured peak gathered+shard bytes, gathers per step, step time.
2. **Side by side.** ``minimum_waste_search(prefetch=True)`` and ``optimal_search`` on the same
   model and budget: predicted and measured step time.
3. **Scale.** ``elixir plan opt-175b --world-size 8`` wall time (a subprocess, imports included),
   and the cache simulator scoring 300 chunk sizes over the OPT-175B step trace.
4. **Search time** (``--search-time [TREE ...]``, nothing else runs): issue 35's three searches,
   each a fresh process, timed wall-clock with imports: ``elixir plan opt-175b`` at world 8 on the
   default (``cpu-box``) profile, the impossible budget ``opt-175b --world-size 1 --device-memory
   8GiB --host-memory 16GiB`` (refused), and GPT-2 medium's mixed search (``--gpt2-medium-search``:
   354.8M, batch 1, seq 8, world 2, 5.75 GiB per rank, 640 MiB of process, traced, overlap: what
   ``bench/step_time.py``'s ``elixir-tight:2@medium --batch 1 --seq 8 --tight-budget 5.75`` searches).
   Given source trees (e.g. a ``git archive`` of an older commit, with its ``_C`` extension), each
   command runs once per tree, interleaved, with ``PYTHONPATH`` set to the tree, and the plans are
   compared.

Timings on this shared 2-core box vary run to run; only ratios from one run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

VOCAB = 8192
SEQ = 128
BATCH = 2


def build(name: str):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        OPTConfig,
        OPTForCausalLM,
    )

    torch.manual_seed(0)
    if name == "gpt2-s":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4,
                         resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        return GPT2LMHeadModel(cfg)
    if name == "gpt2-m":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=512, n_layer=6, n_head=8,
                         resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        return GPT2LMHeadModel(cfg)
    if name == "opt-s":
        cfg = OPTConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, ffn_dim=1024,
                        max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0, word_embed_proj_dim=256)
        return OPTForCausalLM(cfg)
    if name == "llama-s":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                          tie_word_embeddings=False)
        return LlamaForCausalLM(cfg)
    raise KeyError(name)


def make_batch(step: int, batch: int = BATCH, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def step_fn(model, batch):
    loss = model(**batch).loss
    loss.backward()
    return loss


def runtime_share(plan) -> int:
    """Bytes of the plan's predicted device peak that the runtime's ledger does not hold."""
    info = plan.info
    mem = info["predicted_memory"]
    mv = 0
    for c in plan.chunks:
        if c.optim_placement.value == "device":
            mv += (c.chunk_size // plan.world_size if c.sharded else c.chunk_size) * 8
    return mem.get("activations", 0) + mem.get("buffers", 0) + mv


def train_worker(model_name: str, plan_json: dict, steps: int, memory_limit, batch: int, seq: int) -> dict:
    from elixir.optim import CPUAdam
    from elixir.plan import SearchResult
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    plan = SearchResult.from_json(plan_json)
    model = build(model_name)
    em = ElixirModule(model, plan, prefetch=True, memory_limit=memory_limit)
    opt = ElixirOptimizer(em, CPUAdam(model.parameters(), lr=1e-4))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    times, gathers = [], []
    for s in range(steps):
        inp = make_batch(1000 * rank + s, batch, seq)
        if s == 1:
            em.reset_peak_memory()
        g0 = em.cache.gathers
        t0 = time.perf_counter()
        loss = em(**inp).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        gathers.append(em.cache.gathers - g0)
    rep = em.memory_report()
    return {"times": times, "gathers": gathers, "report": rep}


def run_plan(model_name: str, plan, steps: int, batch: int, seq: int, enforce: bool = True) -> dict:
    from elixir.testing.dist import run_distributed

    limit = None
    if enforce:
        usable = plan.info["usable_after_margins"]["device"]
        limit = max(0, usable - runtime_share(plan))
    res = run_distributed(train_worker, plan.world_size, model_name, plan.to_json(), steps, limit, batch, seq,
                          timeout=900, threads_per_rank=1)
    times = [max(r["times"][i] for r in res) for i in range(steps)]  # the slowest rank sets the pace
    r0 = res[0]
    return {
        "times": times,
        "step_s": statistics.median(times[1:]) if steps > 1 else times[0],
        "gathers": statistics.median(r0["gathers"][1:]) if steps > 1 else r0["gathers"][0],
        "gathered_shard": max(r["report"]["peak_gathered_bytes"] + r["report"]["shard_device_bytes"] for r in res),
        "limit": limit,
    }


def predicted_gathered_shard(plan) -> int:
    el = {"float32": 4, "bfloat16": 2, "float16": 2}[plan.chunks[0].dtype]
    cache = plan.info.get("cache_blocks_used", plan.cache_blocks) * plan.chunk_size * el
    shards = sum(
        (c.chunk_size // plan.world_size if c.sharded else c.chunk_size) * el
        for c in plan.chunks if (not c.sharded) or c.shard_placement.value == "device"
    )
    return cache + shards


def predictions_table(hw, steps: int, console, only: tuple[str, ...] = ()) -> None:
    from rich.table import Table

    from elixir.plan import MeshLayout
    from elixir.search import minimum_waste_search
    from elixir.search.cost_model import MemoryPolicy, Setting, evaluate_plan
    from elixir.search.optimal import search_profile
    from elixir.search.step_profile import profile_step

    MiB = 1 << 20
    # (model, world, device budget in MiB or None for "everything fits", batch, seq)
    configs = [
        ("gpt2-s", 1, None, BATCH, SEQ),
        ("gpt2-s", 1, 120, BATCH, SEQ),
        ("gpt2-s", 2, None, BATCH, SEQ),  # memory to spare: every chunk replicated
        ("gpt2-s", 2, 90, BATCH, SEQ),  # too little to replicate: sharded, host-placed
        ("opt-s", 2, 70, BATCH, SEQ),
        ("llama-s", 2, 110, BATCH, SEQ),
        ("llama-s", 1, 120, BATCH, SEQ),
        ("gpt2-m", 2, None, 1, 32),  # communication-bound
        ("gpt2-m", 2, 200, 1, 32),  # communication-bound, sharded, room to cache every chunk
    ]
    t = Table(title=f"optimal_search: predicted vs measured (hardware {hw.name}; {steps} steps, median of steps 2..)")
    for c in ("model", "world", "batch x seq", "budget MiB", "chunk", "blocks", "placements", "gathered+shard pred MiB",
              "measured MiB", "meas/pred", "gathers pred", "meas", "step pred s", "meas s", "meas/pred"):
        t.add_column(c, justify="right")
    side = Table(title="same budget: minimum_waste_search(prefetch=True) vs optimal_search")
    for c in ("model", "world", "budget MiB", "search", "blocks", "gathers", "pred s", "measured s", "mw/opt measured"):
        side.add_column(c, justify="right")
    profiles = {}
    rows = []
    # Every rank runs on one thread (2-thread OpenMP runs are erratic on this oversubscribed box);
    # the cost model is told so: one core per rank.
    import dataclasses

    hw1 = dataclasses.replace(hw, cores=1) if hw.device_type == "cpu" else hw
    for name, world, budget, batch, seq in configs:
        if only and name not in only:
            continue
        model = build(name)
        if (name, batch, seq) not in profiles:
            profiles[name, batch, seq] = profile_step(model, make_batch(0, batch, seq), step_fn, torch.float32)
        prof = profiles[name, batch, seq]
        dev = (budget * MiB) if budget else (8 << 30)
        plan = search_profile(prof, world, hardware=hw1, device_memory=dev, host_memory=4 << 30, overlap=True)
        m = run_plan(name, plan, steps, batch, seq)
        p = plan.prediction
        pg = predicted_gathered_shard(plan)
        from collections import Counter

        cnt = Counter((c.shard_placement.value[0] + c.optim_placement.value[0]).upper() if c.sharded else "R"
                      for c in plan.chunks)
        pl = " ".join(f"{k}x{v}" for k, v in sorted(cnt.items()))
        rows.append((name, world, budget, plan, m))
        t.add_row(name, str(world), f"{batch}x{seq}", str(budget or "8192"), f"{plan.chunk_size:,}",
                  str(plan.info.get("cache_blocks_used", plan.cache_blocks)), pl,
                  f"{pg / MiB:.1f}", f"{m['gathered_shard'] / MiB:.1f}", f"{m['gathered_shard'] / pg:.3f}",
                  str(plan.info["gathers_per_step"]), f"{m['gathers']:.0f}", f"{p.step_time_s:.3f}",
                  f"{m['step_s']:.3f}", f"{m['step_s'] / p.step_time_s:.2f}")
        console.print(f"[dim]  per-step seconds (slowest rank): {' '.join(f'{x:.3f}' for x in m['times'])}[/dim]")
        console.print(f"[dim]{name} w{world} budget {budget}: pred {p.step_time_s:.3f} s, meas {m['step_s']:.3f} s, "
                      f"gathered+shard {m['gathered_shard'] / MiB:.1f}/{pg / MiB:.1f} MiB[/dim]")
        if world > 1:
            st = Setting(layout=MeshLayout.data_parallel(world), elem=4, reduce_elem=4, opt_bytes=8,
                         hardware=hw1.per_rank(hw1.ranks_per_node(world)), dtype="float32")
            usable = MemoryPolicy().usable(dev, 4 << 30, 0)[0]
            # minimum_waste_search keeps everything on the device; where that does not fit, its
            # cpu_offload=True variant (shards and optimizer on the host) is the simple search's answer
            for offload in (False, True):
                mw = minimum_waste_search(model, world, cpu_offload=offload, prefetch=True,
                                          inp=make_batch(0, batch, seq), step_fn=step_fn)
                ev = evaluate_plan(prof, mw, st)
                if ev.device_bytes <= usable:
                    break
            else:
                continue
            mm = run_plan(name, mw, steps, batch, seq, enforce=False)
            label = "minimum_waste" + (" (cpu_offload)" if offload else "")
            side.add_row(name, str(world), str(budget or "8192"), label, str(mw.cache_blocks),
                         f"{ev.gathers} / {mm['gathers']:.0f}", f"{ev.step_time:.3f}", f"{mm['step_s']:.3f}", "")
            side.add_row("", "", "", "optimal", str(plan.cache_blocks),
                         f"{plan.info['gathers_per_step']} / {m['gathers']:.0f}", f"{p.step_time_s:.3f}",
                         f"{m['step_s']:.3f}", f"{mm['step_s'] / m['step_s']:.2f}x")
    console.print(t)
    console.print(side)


def scale(console) -> None:
    import numpy as np

    from elixir import models
    from elixir.search.cost_model import pack
    from elixir.search.optimal import chunk_size_candidates
    from elixir.search.simulator import simulate
    from elixir.search.step_profile import profile_by_layers

    cmd = [sys.executable, "-m", "elixir", "plan", "opt-175b", "--world-size", "8", "--hardware", "8xA100-40GB",
           "--device-memory", "80GiB", "--host-memory", "2TiB", "--disk", "30TB", "--batch", "1", "--seq", "2048",
           "--dtype", "bf16", "--checkpointing", "--out", os.devnull]
    import resource

    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    load = os.getloadavg()[0]
    last = [ln for ln in out.stdout.splitlines() if "total" in ln]
    console.print(f"`{' '.join(cmd[1:])}`: exit {out.returncode}, wall {wall:.2f} s, CPU {cpu:.2f} s "
                  f"(process start and imports included; load average {load:.1f} on {os.cpu_count()} cores)")
    if last:
        console.print("  " + last[-1].strip())

    def build_l(n):
        return models.build_model("opt-175b", num_hidden_layers=n)

    prof = profile_by_layers(build_l, 96, lambda m: models.make_batch(m, 1, 2048), models.lm_step_fn, torch.bfloat16)
    cands = chunk_size_candidates(prof, 8, points=300)
    t0 = time.perf_counter()
    layouts = [pack(prof, c, 8) for c in cands]
    t_pack = time.perf_counter() - t0
    t0 = time.perf_counter()
    total = 0
    for lay in layouts:
        for b in (lay.min_blocks, lay.min_blocks + 2):
            total += simulate(lay.trace, max(1, b), "belady").gathers
    t_sim = time.perf_counter() - t0
    steps = np.mean([lay.trace.n_steps for lay in layouts])
    console.print(f"cache simulator: {len(cands)} chunk sizes x 2 block counts over the OPT-175B step trace "
                  f"({steps:.0f} steps): packing {t_pack:.2f} s, simulation {t_sim:.3f} s")


SEARCH_COMMANDS = {
    "opt-175b, world 8": ["-m", "elixir", "plan", "opt-175b", "--world-size", "8", "--device-memory", "80GiB",
                          "--host-memory", "2TiB", "--disk", "8TiB", "--batch", "1", "--seq", "2048", "--dtype", "bf16",
                          "--checkpointing"],
    "opt-175b, impossible budget": ["-m", "elixir", "plan", "opt-175b", "--world-size", "1", "--device-memory", "8GiB",
                                    "--host-memory", "16GiB"],
    "GPT-2 medium, mixed, 5.75 GiB": [os.path.abspath(__file__), "--gpt2-medium-search"],
}


# a training process's own bytes on the CPU box (torch, transformers, the step's growth), fixed so
# that every tree searches the same budget (optimal_search measures it otherwise)
PROCESS_BYTES = 640 << 20


def gpt2_medium_search() -> None:
    """GPT-2 medium's mixed search as bench/step_time.py's tight line runs it (traced step, world
    2, overlap, the budget as device and host: one pool), built on meta; prints the plan's kinds."""
    from collections import Counter

    from transformers import GPT2Config, GPT2LMHeadModel

    from elixir.search import optimal_search

    cfg = GPT2Config(vocab_size=50257, n_embd=1024, n_layer=24, n_head=16, n_positions=1024,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(0))
    budget = int(5.75 * 2**30)
    t0 = time.perf_counter()
    sr = optimal_search(model, 2, overlap=True, inp={"input_ids": ids, "labels": ids}, step_fn=step_fn,
                        device_memory=budget, host_memory=budget, process_bytes=PROCESS_BYTES)
    kinds = Counter(f"{c.sharding.value}:{c.shard_placement.value}/{c.optim_placement.value}" for c in sr.chunks)
    print(f"plan: chunk {sr.chunk_size}, blocks {sr.cache_blocks}, depth {sr.prefetch_depth}, {dict(sorted(kinds.items()))}, "
          f"predicted {sr.prediction.step_time_s:.6f} s; search {time.perf_counter() - t0:.2f} s "
          f"({sr.info['candidates_scored']} candidates)")


def search_time(console, trees: list[str]) -> None:
    """Wall time of each of SEARCH_COMMANDS per source tree, interleaved; plans compared."""
    import re

    from rich.table import Table

    trees = [os.path.abspath(t) for t in trees] or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    t = Table(title="search time: wall seconds per command (fresh process, imports included)")
    t.add_column("command")
    for tree in trees:
        t.add_column(f"{os.path.basename(tree)} (s)", justify="right")
    t.add_column("same plan")
    for name, args in SEARCH_COMMANDS.items():
        walls, plans = [], []
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=tree, TRANSFORMERS_VERBOSITY="error")
            with tempfile.TemporaryDirectory() as tmp:
                extra = ["--out", os.path.join(tmp, "plan.json")] if args[:2] == ["-m", "elixir"] else []
                t0 = time.perf_counter()
                out = subprocess.run([sys.executable, *args, *extra], capture_output=True, text=True, env=env, cwd=tmp)
                walls.append(time.perf_counter() - t0)
                if extra and os.path.exists(extra[1]):
                    with open(extra[1]) as f:
                        plan = json.load(f)
                    plan.pop("info", None)
                    plans.append(json.dumps(plan, sort_keys=True))
                else:
                    text = out.stdout + out.stderr
                    m = re.search(r"plan: .*predicted [0-9.]+ s", text) or re.search(r"no plan fits[^\n]*", text)
                    plans.append(m.group(0) if m else f"exit {out.returncode}: {text[-300:]}")
            console.print(f"{name} [{os.path.basename(tree)}]: {walls[-1]:.2f} s, exit {out.returncode}; "
                          f"load average {os.getloadavg()[0]:.2f}; {plans[-1][:160]}")
        t.add_row(name, *(f"{w:.2f}" for w in walls), "yes" if len(set(plans)) == 1 else "NO")
    console.print(t)
    console.print(f"load average at end {' / '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")


def main() -> int:
    from rich.console import Console

    from elixir.hardware import load_profile

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hardware", default="measure",
                    help="a profile (path or reference name), or 'measure' to measure this box now (quick)")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--only", nargs="*", default=[], help="run only these models (gpt2-s opt-s llama-s gpt2-m)")
    ap.add_argument("--no-calibrate", action="store_true", help="with --hardware measure: skip the runtime calibration")
    ap.add_argument("--only-scale", action="store_true")
    ap.add_argument("--search-time", nargs="*", metavar="TREE",
                    help="time issue 35's three searches only, once per source tree (default: this one)")
    ap.add_argument("--gpt2-medium-search", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gpt2_medium_search:
        gpt2_medium_search()
        return 0
    console = Console(width=200)
    if args.search_time is not None:
        console.print(f"date {time.strftime('%Y-%m-%d %H:%M')} UTC, torch {torch.__version__}, {os.cpu_count()} cores")
        search_time(console, args.search_time)
        return 0
    console.print(f"date {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, {os.cpu_count()} cores")
    if not args.skip_scale:
        scale(console)
    if not args.only_scale:
        if args.hardware == "measure":
            from elixir.profiling import MeasureOptions, measure

            t0 = time.perf_counter()
            hw = measure(MeasureOptions(sizes=MeasureOptions.quick().sizes), collective_world=2, name="cpu-box-now")
            if not args.no_calibrate:
                from elixir.profiling.calibrate import calibrate_profile

                hw = calibrate_profile(hw, (1, 2))
            console.print(f"measured this box's hardware profile in {time.perf_counter() - t0:.1f} s")
        else:
            hw = load_profile(args.hardware)
        predictions_table(hw, args.steps, console, tuple(args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
