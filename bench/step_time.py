"""Step time and peak memory: Elixir against torch DDP, FSDP2 and plain torch, in one invocation.

GPT-2 from ``transformers`` at 81.9M parameters (n_embd 768, 6 layers, vocabulary 50257), batch 2
per rank, sequence 128, AdamW. Every system runs in fresh processes (world 2 through torchrun, gloo;
world 1 as one plain process), so each peak RSS is its own. Step time is the median over the timed
steps after warm-up, as seen by rank 0. Ratios compare runs of the same invocation only.

    python bench/step_time.py                      # the default line-up (5-6 min on a quiet 2-core box)
    python bench/step_time.py --systems elixir:2 ddp:2 --steps 4
    python bench/step_time.py --json results.json

A line is ``system:world``; systems: ``elixir`` (torch AdamW on the shards), ``elixir-hybrid``
(elixir's HybridAdam), ``elixir-bf16`` (bf16 chunks, fp32 masters, HybridAdam), ``ddp``, ``fsdp2``,
``plain`` (no wrapper; world 1 only), and ``ddp-fused``, ``fsdp2-fused``, ``plain-fused`` (torch
AdamW ``fused=True``). Plain ``elixir`` is compared with the peers on the same torch AdamW (default,
per-tensor loop), ``elixir-hybrid`` with the peers on torch's fused AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

SYSTEMS = ("elixir", "elixir-hybrid", "elixir-bf16", "ddp", "ddp-fused", "fsdp2", "fsdp2-fused", "plain", "plain-fused")
DEFAULT_LINES = (
    "elixir:2", "ddp:2", "fsdp2:2", "elixir-hybrid:2", "ddp-fused:2", "fsdp2-fused:2", "elixir-bf16:2",
    "elixir:1", "plain:1", "elixir-hybrid:1", "plain-fused:1",
)
# (numerator, denominator, target): the targets, same-optimizer pairs first.
RATIOS = (
    ("elixir:2", "fsdp2:2", 0.8),
    ("elixir:2", "ddp:2", 1.1),
    ("elixir:1", "plain:1", 1.05),
    ("elixir-hybrid:2", "fsdp2-fused:2", 0.8),
    ("elixir-hybrid:2", "ddp-fused:2", 1.1),
    ("elixir-hybrid:1", "plain-fused:1", 1.05),
    ("elixir-bf16:2", "elixir-hybrid:2", None),
)


@dataclass(frozen=True)
class BenchConfig:
    """The workload (the same for every line)."""

    n_embd: int = 768
    n_layer: int = 6
    n_head: int = 12
    vocab: int = 50257
    batch: int = 2
    seq: int = 128
    lr: float = 1e-4
    warmup: int = 2
    steps: int = 6
    seed: int = 0


@dataclass
class LineResult:
    system: str
    world: int
    step_s: float
    step_times: list[float]
    peak_rss: list[int]  # bytes, per rank
    losses: list[float]
    params: int
    extra: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.system}:{self.world}"


# ---------------------------------------------------------------------------------------------
# worker: one system, one world size


def build_model(cfg: BenchConfig):
    from transformers import GPT2Config, GPT2LMHeadModel

    c = GPT2Config(
        vocab_size=cfg.vocab, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(c)


def make_batch(cfg: BenchConfig, step: int, rank: int, world: int):
    import torch

    g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    ids = torch.randint(0, cfg.vocab, (world * cfg.batch, cfg.seq), generator=g)
    return ids[rank * cfg.batch : (rank + 1) * cfg.batch]


def wrap(system: str, model, cfg: BenchConfig, world: int):
    """Return ``(model, optimizer, extra)`` for ``system``."""
    import torch

    extra: dict = {}
    if system.startswith("elixir"):
        from elixir.optim import HybridAdam
        from elixir.search import minimum_waste_search
        from elixir.wrapper import ElixirModule, ElixirOptimizer

        dtype = torch.bfloat16 if system == "elixir-bf16" else torch.float32
        t0 = time.perf_counter()
        sr = minimum_waste_search(model, world, unified_dtype=dtype)
        extra.update(search_s=time.perf_counter() - t0, chunk_size=sr.chunk_size, chunks=len(sr.chunks),
                     waste=sr.waste(), cache_blocks=sr.cache_blocks)
        if system == "elixir":
            inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        else:
            inner = HybridAdam(model.parameters(), lr=cfg.lr)
        wrapped = ElixirModule(model, sr, dtype=dtype, output_fp32=True)
        return wrapped, ElixirOptimizer(wrapped, inner), extra
    fused = system.endswith("-fused")
    if system.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model), torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=fused), extra
    if system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=fused), extra
    if system.startswith("plain"):
        if world != 1:
            raise SystemExit("plain torch runs at world 1 only")
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=fused), extra
    raise SystemExit(f"unknown system {system!r}; choose from {SYSTEMS}")


def worker(system: str, cfg: BenchConfig, out: str, profile: Optional[str]) -> None:
    import torch
    import torch.distributed as dist

    from elixir import distributed as edist

    info = edist.init_distributed(backend="gloo")
    rank, world = info.rank, info.world_size
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    model, optim, extra = wrap(system, model, cfg, world)

    comm = _time_collectives(edist) if system.startswith("elixir") else None
    phases: list[tuple[float, float, float, float]] = []  # forward, backward, optimizer, collectives

    def step(i: int) -> float:
        ids = make_batch(cfg, i, rank, world)
        c0 = comm.total if comm else 0.0
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optim.step()
        optim.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        phases.append((t1 - t0, t2 - t1, t3 - t2, (comm.total - c0) if comm else float("nan")))
        return float(loss.detach())

    losses, times = [], []
    for i in range(cfg.warmup + cfg.steps):
        edist.barrier()
        t0 = time.perf_counter()
        if profile and i == cfg.warmup:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as tprofile

            with tprofile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False) as prof:
                losses.append(step(i))
            if rank == 0:
                with open(profile, "w") as f:
                    f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
                    f.write("\n\n")
                    f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        else:
            losses.append(step(i))
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if system.startswith("elixir"):
        extra["memory"] = model.memory_report()
        extra["collectives"] = dict(comm.seconds)
    timed_phases = phases[cfg.warmup :]
    extra["phases"] = {k: statistics.median(p[j] for p in timed_phases)
                       for j, k in enumerate(("forward", "backward", "optimizer", "collectives"))}
    rss_all = edist.all_gather_object(rss)
    if rank == 0:
        timed = times[cfg.warmup :]
        res = LineResult(system, world, statistics.median(timed), timed, rss_all, losses, params, extra)
        with open(out, "w") as f:
            json.dump(asdict(res), f)
    if dist.is_initialized():
        dist.destroy_process_group()


class _CollectiveTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.total = 0.0


def _time_collectives(edist) -> _CollectiveTimer:
    """Wrap elixir's collectives (all issued through ``elixir.distributed``) with wall-clock timers."""
    timer = _CollectiveTimer()
    for name in ("all_gather_into", "reduce_scatter_into", "all_reduce", "broadcast"):
        fn = getattr(edist, name)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                timer.seconds[_name] = timer.seconds.get(_name, 0.0) + dt
                timer.total += dt

        setattr(edist, name, timed)
    return timer


# ---------------------------------------------------------------------------------------------
# orchestrator


def run_line(line: str, cfg: BenchConfig, timeout: float, profile_dir: Optional[str]) -> LineResult:
    system, world_s = line.split(":")
    world = int(world_s)
    if system not in SYSTEMS:
        raise SystemExit(f"unknown system {system!r}; choose from {SYSTEMS}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        args = [os.path.abspath(__file__), "--worker", system, "--out", out, "--config", json.dumps(asdict(cfg))]
        if profile_dir:
            args += ["--profile", os.path.join(profile_dir, f"{system}-w{world}.txt")]
        if world > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone", *args]
        else:
            cmd = [sys.executable, *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)),
                   TRANSFORMERS_VERBOSITY="error")
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{line} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        with open(out) as f:
            return LineResult(**json.load(f))


def ratios(results: dict[str, LineResult]) -> list[dict]:
    rows = []
    for num, den, target in RATIOS:
        if num in results and den in results:
            a, b = results[num], results[den]
            rows.append({
                "ratio": f"{num} / {den}",
                "time": a.step_s / b.step_s,
                "peak_rss": max(a.peak_rss) / max(b.peak_rss),
                "target": target,
            })
    return rows


def print_results(results: dict[str, LineResult], cfg: BenchConfig, wall: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)
    any_r = next(iter(results.values()))
    t = Table(title=f"step time: GPT-2 {any_r.params / 1e6:.1f}M, batch {cfg.batch}/rank, seq {cfg.seq}, "
                    f"median of {cfg.steps} steps after {cfg.warmup} warm-up")
    for col in ("line", "step (s)", "min..max (s)", "fwd / bwd / opt (s)", "elixir comm (s)",
                "peak RSS/rank (GiB)", "first losses"):
        t.add_column(col, justify="right")
    for key, r in results.items():
        ph = r.extra.get("phases", {})
        comm = ph.get("collectives", float("nan"))
        t.add_row(key, f"{r.step_s:.3f}", f"{min(r.step_times):.2f}..{max(r.step_times):.2f}",
                  " / ".join(f"{ph.get(k, float('nan')):.2f}" for k in ("forward", "backward", "optimizer")),
                  "-" if comm != comm else f"{comm:.2f}",
                  " / ".join(f"{b / 2**30:.2f}" for b in r.peak_rss), " ".join(f"{x:.3f}" for x in r.losses[:2]))
    console.print(t)
    rt = Table(title="ratios (same invocation)")
    for col in ("ratio", "step time", "target", "peak RSS (max rank)", "met"):
        rt.add_column(col, justify="right")
    for row in ratios(results):
        tgt = row["target"]
        # the memory target (peak RSS <= FSDP2's) applies to the FSDP2 comparisons only
        mem_ok = "fsdp2" not in row["ratio"].split(" / ")[1] or row["peak_rss"] <= 1.0 + 1e-9
        met = "" if tgt is None else ("yes" if row["time"] <= tgt and mem_ok else "NO")
        rt.add_row(row["ratio"], f"{row['time']:.2f}", "-" if tgt is None else f"<= {tgt}", f"{row['peak_rss']:.2f}", met)
    console.print(rt)
    console.print(f"total wall time {wall:.0f} s; load average at end {os.getloadavg()[0]:.1f} "
                  f"(other processes on the box make timings noisy; compare ratios only)")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_LINES), help="lines to run, as system:world")
    p.add_argument("--steps", type=int, default=BenchConfig.steps, help="timed steps per line")
    p.add_argument("--warmup", type=int, default=BenchConfig.warmup, help="untimed steps per line")
    p.add_argument("--layers", type=int, default=BenchConfig.n_layer, help="GPT-2 blocks (6 gives 81.9M)")
    p.add_argument("--json", dest="json_path", help="write all results to this file")
    p.add_argument("--profile-dir", help="write a torch.profiler table of the first timed step of each line here")
    p.add_argument("--timeout", type=float, default=600, help="seconds per line")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--profile", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, BenchConfig(**json.loads(args.config)), args.out, args.profile)
        return 0
    cfg = BenchConfig(steps=args.steps, warmup=args.warmup, n_layer=args.layers)
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[str, LineResult] = {}
    for line in args.systems:
        print(f"running {line} ...", file=sys.stderr, flush=True)
        r = run_line(line, cfg, args.timeout, args.profile_dir)
        results[r.key] = r
        print(f"  {line}: {r.step_s:.3f} s/step, peak RSS {max(r.peak_rss) / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    print_results(results, cfg, wall)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"config": asdict(cfg), "command": " ".join(sys.argv), "wall_s": wall,
                       "results": {k: asdict(v) for k, v in results.items()}, "ratios": ratios(results),
                       "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
