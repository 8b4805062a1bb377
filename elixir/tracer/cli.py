"""``elixir profile MODEL``: trace one training step of a registry model or a config.json on meta."""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console

from elixir import models
from elixir.tables import human_count
from elixir.tracer.memory_tracer import memory_profiling

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="a built-in name (e.g. opt-175b, gpt2, llama-3-8b; --list-models lists them), a config.json "
                                             "path, or a local Hugging Face model folder")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="training dtype (default fp32)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every layer")
    p.add_argument("--reentrant", action="store_true", help="use reentrant checkpointing (default non-reentrant)")
    p.add_argument("--json", metavar="PATH", help="write the profile summary as JSON")
    p.add_argument("--timeline", action="store_true", help="include the per-op timeline and step order in --json")
    p.add_argument("--plot", metavar="PNG", help="save a plot of the live-bytes timeline (needs matplotlib)")
    p.add_argument("--list-models", "--list", dest="list", action="store_true",
                   help="list the built-in model names and exit")


def main(args: argparse.Namespace) -> int:
    console = Console()
    if args.list:
        console.print(models.registry_table())
        return 0
    if not args.model:
        console.print("[red]error:[/red] give a MODEL (a built-in name, see --list-models, or a config.json path)")
        return 2
    t0 = time.perf_counter()
    model = models.build_model(args.model)
    if args.checkpointing:
        models.enable_checkpointing(model, reentrant=args.reentrant)
    batch = models.make_batch(model, args.batch, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    prof = memory_profiling(model, batch, models.lm_step_fn, getattr(torch, DTYPES[args.dtype]))
    t2 = time.perf_counter()
    ck = f", checkpointing ({'reentrant' if args.reentrant else 'non-reentrant'})" if args.checkpointing else ""
    title = f"{args.model}: {human_count(n_params)} params, batch {args.batch} x seq {args.seq}, {args.dtype}{ck}"
    prof.print(console, title=title)
    console.print(f"built in {t1 - t0:.2f} s, traced in {t2 - t1:.2f} s")
    if args.json:
        prof.to_json(args.json, timeline=args.timeline)
        console.print(f"wrote {args.json}")
    if args.plot:
        prof.plot(args.plot)
        console.print(f"wrote {args.plot}")
    return 0
