"""``elixir demo``: the main job. Train a small GPT on the Python standard library's source code,
byte by byte, sharded across local ranks with a searched plan.

``elixir demo`` re-launches itself under torchrun (``python -m torch.distributed.run --standalone``)
with ``--worker``; each worker traces one training step and searches a plan (``optimal_search``
by default: the fastest predicted plan that fits the per-rank budget; ``--search minimum_waste``
for the least-padding plan), wraps the model (``ElixirModule``) and elixir's HybridAdam in AdamW
mode (``ElixirOptimizer``), trains, evaluates and reports, ending with the search's predicted step
time and memory against the measured ones. Only rank 0 prints; the other ranks send it their
memory figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from elixir import device as dev
from elixir import distributed as edist
from elixir.data import eval_batches, load_corpus, sample_batch
from elixir.hardware import default_profile
from elixir.optim import HybridAdam
from elixir.search import DoesNotFitError, minimum_waste_search, optimal_search, print_plan
from elixir.search.cost_model import unified_memory
from elixir.tables import human_count, longest_word, number_column, param_ranges, text_column
from elixir.wrapper import ElixirModule, ElixirOptimizer

PRESETS: dict[str, tuple[int, int, int]] = {
    # name: (n_embd, n_layer, n_head)
    "tiny": (64, 2, 2),
    "small": (384, 6, 6),
    "medium": (512, 8, 8),
    "large": (768, 8, 12),
}
"""Model sizes (vocabulary 256, so nearly all parameters sit in the blocks: about 12·n_embd²·n_layer)."""

DTYPES = ("fp32", "bf16")
SEARCHES = ("optimal", "minimum_waste")
STATUS_ENV = "ELIXIR_DEMO_STATUS"  # launch() -> workers: the file where rank 0 records a refusal
NO_FIT_EXIT = 1  # the exit status when no plan fits the budget (as `elixir plan` returns)
TIMING_WARMUP = 3  # steps left out of the measured step time (first gathers, allocator warm-up)


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on (the same on every rank)."""

    preset: str = "small"
    steps: int = 180
    batch: int = 8
    seq: int = 128
    world_size: int = 2
    dtype: str = "bf16"
    lr: float = 3e-3
    warmup: int = 10
    seed: int = 0
    eval_batches: int = 4
    corpus_bytes: int = 4_000_000
    threads: int = 0
    search: str = "optimal"
    budget_mib: float = 0.0  # per-rank memory budget for optimal_search; 0: the hardware profile's
    json_path: Optional[str] = None

    def threads_per_rank(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.world_size)


# ---------------------------------------------------------------------------------------------
# command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--preset", choices=sorted(PRESETS, key=lambda k: PRESETS[k]), default=d.preset,
                   help="model size: " + ", ".join(f"{k}={_describe(k)}" for k in PRESETS) + f" (default {d.preset})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"sequences per rank per step (default {d.batch})")
    p.add_argument("--seq", type=int, default=d.seq, help=f"sequence length in bytes (default {d.seq})")
    p.add_argument("--world-size", "--nproc", dest="world_size", type=int, default=d.world_size,
                   help=f"local ranks to launch with torchrun (default {d.world_size})")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help=f"compute dtype; bf16 keeps fp32 master weights (default {d.dtype})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak AdamW learning rate (default {d.lr})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"linear warm-up steps (default {d.warmup})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed for weights and batches (default {d.seed})")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help=f"validation batches per rank (default {d.eval_batches})")
    p.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes,
                   help=f"bytes of standard-library source to read (default {d.corpus_bytes})")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads per rank (default: CPU cores / world size)")
    p.add_argument("--search", choices=SEARCHES, default=d.search,
                   help="optimal: the fastest predicted plan that fits the budget; minimum_waste: the least "
                        f"padding (default {d.search})")
    p.add_argument("--budget-mib", type=float, default=d.budget_mib,
                   help="per-rank memory budget in MiB for --search optimal: device memory, and on a CPU-only "
                        "machine the rank's whole share of RAM, for the model and elixir's runtime (the interpreter and "
                        "libraries not included) (default: the hardware profile's)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the run's summary to this JSON file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def _describe(preset: str) -> str:
    d, n_layer, _ = PRESETS[preset]
    return f"{_param_count(preset) / 1e6:.1f}M ({n_layer}x{d})"


def _param_count(preset: str, seq: int = 128) -> int:
    d, n_layer, _ = PRESETS[preset]
    vocab = 256
    return vocab * d + seq * d + n_layer * (12 * d * d + 13 * d) + 2 * d


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    names = DemoConfig.__dataclass_fields__
    cfg = DemoConfig(**{k: getattr(args, k) for k in names if hasattr(args, k)})
    _validate(cfg)
    return cfg


def _validate(cfg: DemoConfig) -> None:
    if cfg.preset not in PRESETS:
        raise SystemExit(f"unknown preset {cfg.preset!r}; choose one of {sorted(PRESETS)}")
    if cfg.world_size < 1:
        raise SystemExit(f"--world-size must be >= 1 (got {cfg.world_size})")
    for name in ("steps", "batch", "seq", "eval_batches"):
        if getattr(cfg, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.search not in SEARCHES:
        raise SystemExit(f"unknown --search {cfg.search!r}; choose one of {SEARCHES}")
    if cfg.budget_mib < 0 or (cfg.budget_mib and cfg.search != "optimal"):
        raise SystemExit("--budget-mib takes a positive size in MiB, and only with --search optimal")


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.worker:
        return run_worker(cfg)
    return launch(cfg)


def worker_argv(cfg: DemoConfig) -> list[str]:
    """The ``elixir demo --worker ...`` arguments that reproduce ``cfg``."""
    argv = ["demo", "--worker"]
    for key, default in asdict(DemoConfig()).items():
        value = getattr(cfg, key)
        if key == "world_size" or (value is not None and value != default):
            argv += ["--" + key.replace("_", "-").replace("json-path", "json"), str(value)]
    return argv


def launch(cfg: DemoConfig) -> int:
    """Run the demo on ``cfg.world_size`` local ranks through torchrun; return its exit status."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(cfg.world_size), "--standalone",
        "-m", "elixir", *worker_argv(cfg),
    ]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(cfg.threads_per_rank())  # also silences torchrun's warning about it
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    fd, status = tempfile.mkstemp(prefix="elixir-demo-", suffix=".status")
    os.close(fd)
    env[STATUS_ENV] = status
    try:
        rc = subprocess.run(cmd, env=env).returncode
        with open(status) as f:
            refused = f.read().strip()
        return NO_FIT_EXIT if rc == 0 and refused else rc
    except KeyboardInterrupt:
        return 130
    finally:
        os.unlink(status)


# ---------------------------------------------------------------------------------------------
# the worker


def build_gpt(preset: str, seq: int):
    """A byte-level GPT-2 from config (no download), vocabulary 256, no dropout."""
    # optional dependency: transformers (the hf extra)
    from transformers import GPT2Config, GPT2LMHeadModel

    d, n_layer, n_head = PRESETS[preset]
    cfg = GPT2Config(
        vocab_size=256, n_positions=seq, n_embd=d, n_layer=n_layer, n_head=n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def lr_lambda(cfg: DemoConfig):
    """Linear warm-up, then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def _lm_loss(model, x, y):
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _trace_step(model, batch) -> None:
    """The training step the search traces (on meta tensors): forward, loss, backward."""
    _lm_loss(model, batch["input_ids"], batch["labels"]).backward()


class Trainer:
    """The Elixir runtime around the model: plan, wrapped module, wrapped optimizer."""

    def __init__(self, model, cfg: DemoConfig, world_size: int, console, example):
        dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        t0 = time.perf_counter()
        if cfg.search == "optimal":
            budget = int(cfg.budget_mib * 2**20) or None
            # on a CPU-only profile device and host are one pool: the budget bounds both together
            host = budget if budget and unified_memory(default_profile()) else None
            x, y = example
            self.plan = optimal_search(model, world_size, unified_dtype=dtype, overlap=True, verbose=console is not None,
                                       inp={"input_ids": x, "labels": y}, step_fn=_trace_step, device_memory=budget,
                                       host_memory=host, process_bytes=0)  # the budget is the model's and runtime's: the
            # same on every rank and in every process (RSS beside them varies by tens of MiB)
            if console is not None:
                print_chunks(console, self.plan)
                if not any(c.sharded for c in self.plan.chunks):
                    # activations stay; about 60% of the rest, before the safety margin
                    mem = self.plan.info.get("predicted_memory", {})
                    fixed = mem.get("activations", 0) + mem.get("buffers", 0)
                    peak = self.plan.prediction.peak_device_bytes
                    half = (fixed + 0.6 * (peak - fixed)) / (1 - self.plan.info["margins"]["device"]) / 2**20
                    console.print(f"the whole model fits on every rank, so data parallel is fastest; run with "
                                  f"--budget-mib {half:.0f} to watch the search shard and offload under a tighter budget")
        else:
            self.plan = minimum_waste_search(model, world_size, unified_dtype=dtype)
            if console is not None:
                print_plan(self.plan, dtype)
        self.search_s = time.perf_counter() - t0
        self.inner_optimizer = HybridAdam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.model = ElixirModule(model, self.plan, dtype=dtype, output_fp32=True,
                                  prefetch=self.plan.param_order is not None)
        self.optimizer = ElixirOptimizer(self.model, self.inner_optimizer)

    def memory(self) -> dict[str, int]:
        """This rank's bytes, from the runtime's own accounting plus the process's peak RSS."""
        r = self.model.memory_report()
        return {
            "shard": int(r["shard_bytes"]),
            "master": int(r["master_bytes"]),
            "cache": int(r["cache_bytes"]),
            "peak_gathered": int(r["peak_gathered_bytes"]),
            "device_peak": int(r["device_peak_bytes"]),
            "peak_rss": dev.peak_rss_bytes(),
        }

    def predicted_runtime_bytes(self) -> Optional[int]:
        """The plan's predicted device peak less what the runtime's ledger does not hold
        (activations, buffers, the inner optimizer's moments of device-placed chunks), so it
        compares with ``memory()['device_peak']``; None without a prediction."""
        pred = self.plan.prediction
        if pred is None:
            return None
        mem = self.plan.info.get("predicted_memory", {})
        moments = sum(c.state_size(self.plan.world_size) * 8 for c in self.plan.chunks if c.optim_placement.value == "device")
        return pred.peak_device_bytes - mem.get("activations", 0) - mem.get("buffers", 0) - moments


def print_chunks(console, plan) -> None:
    """Per chunk: what it holds (names shortened by prefix), its size, its kind (sharded, ZeRO-2/1,
    replicated), where its shard and optimizer state live; fits 80 columns."""
    rows = [(param_ranges(c.params), human_count(c.chunk_size), c.sharding.value,
             c.shard_placement.value if c.sharded else "device", c.optim_placement.value) for c in plan.chunks]
    t = Table(title="chunks of the plan (in the order they are used)", title_justify="left")
    text_column(t, "parameters", min_width=longest_word([r[0] for r in rows]))
    number_column(t, "elements", no_wrap=True)
    for col in ("kind", "shard\non", "optimizer\non"):
        t.add_column(col, no_wrap=True)
    for row in rows:
        t.add_row(*row)
    console.print(t)


def run_worker(cfg: DemoConfig) -> int:
    t_start = time.perf_counter()
    # The scheduler drives the inner optimizer, whose step ElixirOptimizer may run through its own
    # fused kernel; torch then wrongly believes the scheduler stepped first.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
    torch.set_num_threads(cfg.threads_per_rank())
    info = edist.init_distributed()
    rank, world = info.rank, info.world_size
    console = Console(highlight=False) if rank == 0 else None
    say = console.print if console is not None else (lambda *a, **k: None)

    corpus = load_corpus(cfg.corpus_bytes)
    torch.manual_seed(cfg.seed)
    model = build_gpt(cfg.preset, cfg.seq)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"[bold]elixir demo[/]: byte-level GPT-2 '{cfg.preset}' ({n_params / 1e6:.1f}M params, "
        f"{PRESETS[cfg.preset][1]} layers x {PRESETS[cfg.preset][0]}) on {world} rank(s), {cfg.dtype}, "
        f"{cfg.threads_per_rank()} thread(s)/rank")
    say(f"corpus: {corpus.train.numel() / 1e6:.2f} MB train ({corpus.train_files} files), "
        f"{corpus.val.numel() / 1e6:.2f} MB val ({corpus.val_files} files) of Python source from {corpus.source}")

    try:
        trainer = Trainer(model, cfg, world, console, sample_batch(corpus.train, cfg.batch, cfg.seq, 0, cfg.seed, rank, world))
    except DoesNotFitError as e:  # the same on every rank (the search is deterministic): say it once, as `elixir plan` does
        return _does_not_fit(console, e)

    sched = torch.optim.lr_scheduler.LambdaLR(trainer.inner_optimizer, lr_lambda(cfg))
    val_set = eval_batches(corpus.val, cfg.batch, cfg.seq, cfg.eval_batches, rank, world)
    val_before = _evaluate(trainer.model, val_set)
    say(f"val loss before training: {val_before:.4f} (uniform guess: {math.log(256):.4f})")

    setup_s = time.perf_counter() - t_start
    losses, step_times = _train(cfg, trainer, sched, corpus.train, rank, world, console)
    val_after = _evaluate(trainer.model, val_set)

    per_rank = edist.all_gather_object(trainer.memory())
    summary = {
        "config": asdict(cfg),
        "params": n_params,
        "world_size": world,
        "losses": losses,
        "val_loss_before": val_before,
        "val_loss_after": val_after,
        "setup_s": setup_s,
        "train_s": sum(step_times),
        "tokens_per_s": cfg.steps * world * cfg.batch * cfg.seq / sum(step_times),
        "memory": per_rank,
        "plan": {"search": cfg.search, "chunks": len(trainer.plan.chunks), "chunk_size": trainer.plan.chunk_size,
                 "sharded": sum(c.sharded for c in trainer.plan.chunks), "shardings": trainer.plan.sharding_counts,
                 "param_elements_per_rank": sum(c.shard_size(world) for c in trainer.plan.chunks), "waste": trainer.plan.waste(),
                 "cache_blocks": trainer.plan.cache_blocks, "search_s": trainer.search_s},
        "measured_step_s": _median(step_times[TIMING_WARMUP:] or step_times),
        "predicted_step_s": None if trainer.plan.prediction is None else trainer.plan.prediction.step_time_s,
        "predicted_runtime_bytes": trainer.predicted_runtime_bytes(),
    }
    if console is not None:
        _print_summary(console, cfg, summary)
        if cfg.json_path:
            with open(cfg.json_path, "w") as f:
                json.dump(summary, f, indent=1)
    edist.shutdown()  # drain elixir's async work, then barrier and destroy on every rank together
    return 0


def _does_not_fit(console, error: DoesNotFitError) -> int:
    """Rank 0 prints the search's message (its suggestions included) as ``elixir plan`` does, with
    no traceback. Under :func:`launch` every rank then exits 0, so torchrun adds no failure report
    of its own, and the status file tells :func:`launch` to return :data:`NO_FIT_EXIT`."""
    if console is not None:
        console.print(f"[red]{error}[/red]")
    status = os.environ.get(STATUS_ENV)
    if status is None:
        return NO_FIT_EXIT
    if console is not None:
        with open(status, "w") as f:
            f.write("does not fit\n")
    return 0


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    return ys[len(ys) // 2] if len(ys) % 2 else (ys[len(ys) // 2 - 1] + ys[len(ys) // 2]) / 2


def _evaluate(model, val_set) -> float:
    """Mean validation loss per byte over every rank's slice of the fixed validation set."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in val_set:
            total[0] += _lm_loss(model, x, y).item() * x.numel()
            total[1] += x.numel()
    model.train()
    edist.all_reduce(total)
    return float(total[0] / total[1])


def _train(cfg: DemoConfig, trainer: Trainer, sched, train_data, rank: int, world: int, console):
    """The training loop; returns the rank-averaged loss and the wall time of every step."""
    losses: list[float] = []
    step_times: list[float] = []
    tokens_per_step = world * cfg.batch * cfg.seq
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("[green]{task.fields[tps]}[/] tok/s"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, disable=console is None,
    )
    log_every = max(1, cfg.steps // 10)
    with progress:
        task = progress.add_task("train", total=cfg.steps, loss="-", tps="-")
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            x, y = sample_batch(train_data, cfg.batch, cfg.seq, step, cfg.seed, rank, world)
            loss = _lm_loss(trainer.model, x, y)
            loss.backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            sched.step()
            avg = loss.detach().double().reshape(1) / world
            edist.all_reduce(avg)
            dt = time.perf_counter() - t0
            losses.append(float(avg))
            step_times.append(dt)
            recent = step_times[-10:]
            progress.update(task, advance=1, loss=f"{losses[-1]:.3f}",
                            tps=f"{tokens_per_step * len(recent) / sum(recent):,.0f}")
            if console is not None and (step % log_every == 0 or step == cfg.steps - 1):
                progress.console.print(f"step {step + 1:>5}/{cfg.steps}  loss {losses[-1]:.4f}  "
                                       f"lr {sched.get_last_lr()[0]:.2e}  {dt * 1e3:.0f} ms/step")
    return losses, step_times


def _mib(b: int) -> str:
    return f"{b / 2**20:,.1f} MiB"


def _sparkline(values: list[float], width: int = 40) -> str:
    if not values:
        return ""
    step = max(1, len(values) // width)
    pts = [sum(values[i : i + step]) / len(values[i : i + step]) for i in range(0, len(values), step)]
    lo, hi = min(pts), max(pts)
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[int((p - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for p in pts)


def _print_summary(console, cfg: DemoConfig, s: dict) -> None:
    mem = Table(title="memory per rank", title_justify="left")
    for col in ("rank", "shard", "fp32 master", "rCache", "peak gathered", "peak RSS"):
        mem.add_column(col, justify="right")
    for r, m in enumerate(s["memory"]):
        mem.add_row(str(r), *(_mib(m[k]) for k in ("shard", "master", "cache", "peak_gathered", "peak_rss")))
    console.print(mem)

    losses = s["losses"]
    k = max(1, min(5, len(losses) // 5))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    t = Table(title="summary", show_header=False, title_justify="left")
    p = s["plan"]
    if p["sharded"]:
        t.add_row("runtime", f"elixir ({p['search']} plan): {p['chunks']} chunks ({p['sharded']} sharded) of up to "
                             f"{p['chunk_size']:,}, {100 * p['waste']:.2f}% waste, {p['cache_blocks']} rCache blocks")
    else:
        t.add_row("runtime", f"elixir ({p['search']} plan): all {p['chunks']} chunks replicated (data parallel: "
                             "memory allows it and it is the fastest)")
    t.add_row("model", f"GPT-2 '{cfg.preset}', {s['params'] / 1e6:.2f}M params, {cfg.dtype}")
    t.add_row("data", f"{cfg.steps} steps x {s['world_size']} ranks x {cfg.batch} x {cfg.seq} bytes")
    t.add_row("train loss", f"{first:.3f} -> {last:.3f} (mean of first/last {k} steps)  {_sparkline(losses)}")
    t.add_row("val loss", f"{s['val_loss_before']:.3f} -> [bold]{s['val_loss_after']:.3f}[/] "
                          f"({s['val_loss_after'] / math.log(2):.2f} bits/byte)")
    t.add_row("time", f"setup {s['setup_s']:.1f} s (search {p['search_s']:.1f} s), training {s['train_s']:.1f} s, "
                      f"{s['tokens_per_s']:,.0f} tokens/s")
    console.print(t)
    _print_prediction(console, s)


def _print_prediction(console, s: dict) -> None:
    """The search's predictions against what rank 0 measured."""
    if s["predicted_step_s"] is None:
        console.print(f"measured step time {s['measured_step_s']:.3f} s (median after {TIMING_WARMUP} steps); "
                      "the minimum_waste search makes no prediction (use --search optimal)")
        return
    t = Table(title="predicted by the search vs measured (rank 0)", title_justify="left")
    for col in ("", "predicted", "measured", "measured / predicted"):
        t.add_column(col, justify="right")
    pt, mt = s["predicted_step_s"], s["measured_step_s"]
    t.add_row(f"step time (median after {TIMING_WARMUP} steps)", f"{pt:.3f} s", f"{mt:.3f} s", f"{mt / pt:.2f}")
    pb, mb = s["predicted_runtime_bytes"], s["memory"][0]["device_peak"]
    t.add_row("runtime memory (shards, masters, gathered, gradients)", _mib(pb), _mib(mb), f"{mb / max(1, pb):.2f}")
    console.print(t)
