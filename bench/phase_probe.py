"""Where a step's time goes, per rank: elixir on a saved plan against DDP with fused AdamW.

    torchrun --nproc-per-node 2 --standalone bench/phase_probe.py elixir --plan plan.json --plain-forward
    torchrun --nproc-per-node 2 --standalone bench/phase_probe.py ddp

The workload is ``bench/step_time.py``'s (GPT-2, batch 2 per rank, seq 128, random tokens), one
thread per rank. Each step prints forward, backward and optimizer time on every rank and, for
elixir, the seconds its gradient side spent in its own calls: copying gradients into chunk buffers
(``add_grad``), waiting for reductions (``wait_reduction``), the end of backward
(``finish_backward``, which waits for the reductions still in flight) and the agreement on uses at
the start of backward (``agree_uses``: it absorbs the ranks' skew from forward). With
``--plain-forward`` an unwrapped copy of the model runs a forward with gradients first, in the same
process and on the same batch, so elixir's forward is held against torch's on the same memory and
load. Without ``--plan`` (or when the file is missing) the plan is ``optimal_search``'s for the box
(as ``elixir-optimal``), saved there for the next run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_time as st  # noqa: E402  (the workload and the plan of bench/step_time.py)

TIMERS = (  # (module, class, method, name)
    ("elixir.chunk.grads", "ChunkGrads", "add", "add_grad"),
    ("elixir.chunk.grads", "ChunkGrads", "finish_reduction", "wait_reduction"),
    ("elixir.wrapper.grad_sync", "GradientSync", "finish_backward", "finish_backward"),
    ("elixir.wrapper.grad_sync", "GradientSync", "count_ranks", "agree_uses"),
    ("elixir.chunk.grads", "ChunkGrads", "open", "open_grad"),
    ("elixir.chunk.grads", "ChunkGrads", "reduce", "issue_reduction"),
    ("elixir.chunk.chunk", "Chunk", "gather", "gather"),
    ("elixir.chunk.comm", "ChunkComm", "publish", "publish"),
    ("elixir.wrapper.shard_step", "ShardStepper", "step_chunk", "step_chunk"),
)


def _install_timers(seconds: collections.Counter) -> None:
    import importlib

    for module, cls, method, name in TIMERS:
        owner = getattr(importlib.import_module(module), cls)
        fn = getattr(owner, method)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                seconds[_name] += time.perf_counter() - t0

        setattr(owner, method, timed)


def _wrap(system: str, model, cfg, world: int, plan_path: str):
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model), torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True), None
    from elixir import distributed as edist
    from elixir.optim import HybridAdam
    from elixir.plan import SearchResult
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    if not os.path.exists(plan_path):
        sr, _ = st._optimal_plan("elixir-optimal", model, cfg, world, torch.float32, {})
        if edist.get_rank() == 0:
            sr.save(plan_path)
        edist.barrier()
    sr = SearchResult.load(plan_path)
    em = ElixirModule(model, sr, dtype=torch.float32, output_fp32=True, prefetch=sr.param_order is not None)
    return em, ElixirOptimizer(em, HybridAdam(model.parameters(), lr=cfg.lr)), st.plan_summary(sr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("system", choices=("elixir", "ddp"))
    p.add_argument("--model", default="medium", choices=sorted(st.MODELS))
    p.add_argument("--steps", type=int, default=5, help="steps, the first one a warm-up")
    p.add_argument("--plan", default="plan.json", help="elixir's plan (made and saved here when missing)")
    p.add_argument("--plain-forward", action="store_true", help="time an unwrapped copy's forward first, each step")
    p.add_argument("--json", help="append every rank's rows to this file (rank 0 writes)")
    p.add_argument("--batch", type=int, default=st.BenchConfig.batch, help="batch per rank (bench/step_time.py's)")
    p.add_argument("--seq", type=int, default=st.BenchConfig.seq, help="sequence length (bench/step_time.py's)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from elixir import distributed as edist

    info = edist.init_distributed(backend="gloo")
    rank, world = info.rank, info.world_size
    cfg = st.BenchConfig(batch=args.batch, seq=args.seq).for_model(args.model)
    torch.manual_seed(cfg.seed)
    model = st.build_model(cfg)
    seconds: collections.Counter = collections.Counter()
    if args.system == "elixir":
        _install_timers(seconds)
    wrapped, opt, plan = _wrap(args.system, model, cfg, world, args.plan)
    plain = None
    if args.plain_forward:
        torch.manual_seed(cfg.seed)
        plain = st.build_model(cfg)
    rows = []
    for i in range(args.steps):
        ids = st.make_batch(cfg, i, rank, world)
        row: dict = {"rank": rank, "step": i}
        if plain is not None:
            edist.barrier()
            t0 = time.perf_counter()
            out = plain(input_ids=ids, labels=ids)
            del out  # the graph is dropped unused
            row["plain_forward"] = time.perf_counter() - t0
        edist.barrier()
        seconds.clear()
        t0 = time.perf_counter()
        loss = wrapped(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        row.update(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2, step_s=t3 - t0,
                   loss=float(loss.detach()), **seconds)
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    every = edist.all_gather_object(rows)
    if rank == 0 and args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"system": args.system, "model": args.model, "plan": plan, "rows": every}) + "\n")
    edist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
