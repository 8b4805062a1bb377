"""``elixir plan``: plan a run for any cluster (not necessarily this machine) and write the plan.

Example: OPT-66B on one node of 8x A100-40GB, planned from a laptop::

    elixir plan opt-66b --world-size 8 --hardware 8xA100-40GB --batch 1 --seq 2048 --dtype bf16 \\
        --checkpointing --out plan.json

The model is built on meta (no weights). Models with more than 3 repeated layers are traced at 2 and
3 layers and extrapolated by layer repetition (exact for uniform stacks; ``--full-trace`` traces the
whole model instead).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from typing import Optional

from rich.console import Console
from rich.table import Table

from elixir import models
from elixir.hardware.registry import (
    DEFAULT_RULE,
    choose_default_profile,
    closest_reference_gpu,
    load_profile,
    reference_profiles,
)
from elixir.plan import MeshLayout, dtype_from_name
from elixir.plan.tensor_plans import local_shapes, style_plan
from elixir.search.mesh_profile import SCHEDULES, MeshPlan, search_mesh
from elixir.search.optimal import DoesNotFitError, human_count, search_profile
from elixir.search.step_profile import profile_by_layers, profile_step
from elixir.tables import human_bytes

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16"}


def parse_size(text: str) -> int:
    """``"24GiB"`` -> bytes (``B``, ``KB``/``MB``/``GB``/``TB`` are powers of 10; ``KiB``... of 2)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 24GiB, 256GB, 1TiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?",
                        help="a built-in name (e.g. opt-175b, llama-3-8b; --list-models lists them), a config.json "
                             "path, or a local Hugging Face model folder holding one")
    parser.add_argument("--list-models", action="store_true", help="list the built-in model names and exit")
    parser.add_argument("--world-size", type=int, default=None, help="data-parallel ranks of the target (required)")
    parser.add_argument("--device-memory", type=parse_size, default=None,
                        help="memory of one device, e.g. 40GiB (default: the hardware profile's)")
    parser.add_argument("--host-memory", type=parse_size, default=None,
                        help="host RAM of one node, shared by its ranks (default: the hardware profile's)")
    parser.add_argument("--disk", type=parse_size, default=None,
                        help="offload disk space of one node (default: no disk offload)")
    parser.add_argument("--hardware", default=None,
                        help="hardware profile: a JSON from `elixir hwprofile` or a shipped name ("
                             + ", ".join(reference_profiles()) + "). Default: " + DEFAULT_RULE.replace("%", "%%")
                             + "; a target that cannot be this machine (more ranks than its cores, or "
                             "--device-memory on a machine without a GPU) gets the closest shipped GPU profile, "
                             "with a warning. The report names the profile used")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks sharing one node's host memory (default: from the hardware profile)")
    parser.add_argument("--batch", type=int, default=1, help="batch size per rank")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="compute dtype")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every layer")
    parser.add_argument("--optimizer", default="Adam", help="Adam/AdamW (8 B/element of state) or SGD (4)")
    parser.add_argument("--no-overlap", action="store_true", help="do not plan prefetching")
    parser.add_argument("--full-trace", action="store_true", help="trace the whole model (slower for deep models)")
    parser.add_argument("--out", default=None, help="write the plan JSON here (with --pp: one file per stage, "
                                                    "'.stageN' before the suffix)")
    mesh = parser.add_argument_group("hybrid parallelism (a plan per pipeline stage, chunks over its data-parallel axis)")
    mesh.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (the model's own plan, or elixir's)")
    mesh.add_argument("--pp", type=int, default=1, help="pipeline stages")
    mesh.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: 2 x pp)")
    mesh.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule")
    mesh.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism on the tensor axis")


def _layer_key(cfg) -> tuple[str, int]:
    d = cfg.to_dict()
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if k in d and isinstance(d[k], int):
            return k, d[k]
    raise ValueError("the config names no layer count (num_hidden_layers / n_layer); use --full-trace")


def not_this_machine(hw, world_size: int, device_memory: Optional[int]) -> Optional[str]:
    """Why a request cannot be planned against ``hw``, this machine's CPU profile (None if it can):
    a device memory on a machine without a GPU, or more ranks than it has cores."""
    if hw.device_type != "cpu":
        return None
    if device_memory is not None:
        return f"--device-memory {human_bytes(device_memory)} asks for accelerators, and this machine has none"
    cores = os.cpu_count() or 1
    if world_size > cores:
        return f"{world_size} ranks cannot run on this machine's {cores} cores"
    return None


def choose_hardware(args: argparse.Namespace):
    """(profile, why, warning or None): ``--hardware`` if given; else the default rule, unless the
    request cannot be this machine, then the closest shipped GPU profile (and a warning naming
    ``--hardware`` and the shipped profiles)."""
    if args.hardware is not None:
        return load_profile(args.hardware), f"--hardware {args.hardware}", None
    hw, why = choose_default_profile()
    reason = not_this_machine(hw, args.world_size, args.device_memory)
    if reason is None:
        return hw, why, None
    gpu = closest_reference_gpu(args.device_memory, args.world_size)
    warning = (f"warning: {reason}, so the plan is not for this machine. Planning with the shipped "
               f"profile {gpu.name}, the closest to the request; choose with --hardware "
               f"({', '.join(reference_profiles())}, or a JSON from `elixir hwprofile` on the target).")
    return gpu, "the closest shipped GPU profile to the request", warning


def _profile_kind(hw, why: str) -> str:
    """The footer's words for the profile, from the same choice the header prints."""
    if why.startswith("--hardware"):
        return "given with --hardware; " + ("measured" if hw.measured else "reference figures, not measured")
    if why.startswith("the local measured profile"):
        return "this machine's measured profile"
    return "a shipped reference profile" + ("" if hw.measured else ": reference figures, not measured")


def build_profile(model_name: str, batch: int, seq: int, dtype, checkpointing: bool, full_trace: bool):
    """Trace the step on meta (by layer repetition when the model is deep) into a StepProfile."""
    cfg = models.load_config(model_name)
    key, layers = _layer_key(cfg)

    def build(n: int):
        m = models.build_model(model_name, **{key: n})
        if checkpointing:
            models.enable_checkpointing(m)
        return m

    def make_inp(m):
        return models.make_batch(m, batch, seq)

    if full_trace or layers <= 3:
        m = build(layers)
        return profile_step(m, make_inp(m), models.lm_step_fn, dtype)
    return profile_by_layers(build, layers, make_inp, models.lm_step_fn, dtype)


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    console = Console()
    if args.list_models:
        console.print(models.registry_table())
        return 0
    if not args.model or args.world_size is None:
        console.print("[red]elixir plan needs a MODEL and --world-size N[/red] (--list-models lists the names)")
        return 2
    if args.world_size < 1:
        console.print("[red]--world-size must be >= 1[/red]")
        return 2
    if args.tp < 1 or args.pp < 1 or args.world_size % (args.tp * args.pp):
        console.print(f"[red]--world-size {args.world_size} must be a multiple of --tp x --pp "
                      f"({args.tp} x {args.pp}); the rest is the data-parallel axis[/red]")
        return 2
    models.load_config(args.model)  # an unknown name or a bad path fails here, before any profile is chosen
    hw, hw_why, warning = choose_hardware(args)
    console.print(f"hardware profile: {hw.name} ({hw_why})")
    if warning:
        console.print(f"[yellow]{warning}[/yellow]")
    if args.world_size > 1 and hw.all_gather is None:
        console.print(f"[red]hardware profile {hw.name} has no collective measurements (single-device); "
                      "use a multi-GPU profile or --world-size 1[/red]")
        return 2
    dtype = dtype_from_name(_DTYPES[args.dtype])
    rpn = args.ranks_per_node or hw.ranks_per_node(args.world_size)
    device = args.device_memory  # None: the profile's (on a CPU-only profile, the rank's share of the pool)
    host_node = args.host_memory if args.host_memory is not None else hw.host_memory_bytes
    disk = None if args.disk is None else args.disk // rpn
    with console.status(f"tracing {args.model} (batch {args.batch}, seq {args.seq}, {args.dtype})"):
        profile = build_profile(args.model, args.batch, args.seq, dtype, args.checkpointing, args.full_trace)
    t_trace = time.perf_counter() - t0
    if args.tp > 1 or args.pp > 1:
        return _plan_mesh(args, console, profile, hw, hw_why, device, host_node // rpn, disk, rpn, t0)
    try:
        result = search_profile(
            profile, args.world_size, hardware=hw, device_memory=device, host_memory=host_node // rpn, disk=disk,
            optimizer_type=args.optimizer, overlap=not args.no_overlap, verbose=True, console=console,
            ranks_per_node=rpn, hardware_choice=hw_why,
        )
    except DoesNotFitError as e:
        console.print(f"[red]{e}[/red]")
        return 1
    info = dict(result.info, model=args.model, batch=args.batch, seq=args.seq, dtype=args.dtype,
                checkpointing=args.checkpointing, ranks_per_node=rpn, trace_time_s=t_trace)
    result = type(result)(**{**result.__dict__, "info": info})
    if args.out:
        result.save(args.out)
        console.print(f"wrote {args.out}")
    console.print(
        f"{human_count(profile.total_numel)} trainable parameters; traced in {t_trace:.2f} s "
        f"({profile.info.get('source')}); total {time.perf_counter() - t0:.2f} s. "
        f"Hardware profile {hw.name} ({_profile_kind(hw, hw_why)}).",
    )
    return 0


def _hidden_size(cfg) -> int:
    for k in ("hidden_size", "n_embd", "d_model"):
        v = getattr(cfg, k, None)
        if isinstance(v, int):
            return v
    raise ValueError("the config names no hidden size (hidden_size / n_embd / d_model)")


def _plan_mesh(args: argparse.Namespace, console: Console, profile, hw, hw_why: str, device: Optional[int],
               host: int, disk: Optional[int], rpn: int, t0: float) -> int:
    """``elixir plan --tp/--pp``: a plan per pipeline stage, and the run's predicted figures."""
    layout = MeshLayout(pp=args.pp, dp_shard=args.world_size // (args.tp * args.pp), tp=args.tp)
    cfg = models.load_config(args.model)
    shapes = None
    if args.tp > 1:
        key, _ = _layer_key(cfg)
        plan = style_plan(models.build_model(args.model, **{key: 2}))
        shapes = local_shapes(profile.params + profile.frozen_shapes, plan, args.tp)
    m = args.microbatches or 2 * args.pp
    try:
        mp = search_mesh(profile, layout, tp_shapes=shapes, hidden=_hidden_size(cfg), microbatches=m,
                         schedule=args.schedule, sequence_parallel=args.sequence_parallel, hardware=hw,
                         device_memory=device, host_memory=host, disk=disk, optimizer_type=args.optimizer,
                         overlap=not args.no_overlap, ranks_per_node=rpn, hardware_choice=hw_why)
    except DoesNotFitError as e:
        console.print(f"[red]{e}[/red]")
        return 1
    _print_mesh(console, mp)
    if args.out:
        root, ext = os.path.splitext(args.out)
        for k, r in enumerate(mp.stages):
            r.save(f"{root}.stage{k}{ext}" if args.pp > 1 else args.out)
        console.print(f"wrote {len(mp.stages)} plan file(s) from {args.out}")
    console.print(f"{human_count(profile.total_numel)} trainable parameters on {layout.describe()}; "
                  f"total {time.perf_counter() - t0:.2f} s. Hardware profile {hw.name} ({_profile_kind(hw, hw_why)}).")
    return 0


def _print_mesh(console: Console, mp: MeshPlan) -> None:
    t = Table(title=f"elixir hybrid plan: {mp.layout.describe()}, {mp.schedule}, {mp.microbatches} microbatches")
    for col in ("stage", "params/rank", "chunks", "device/rank", "host/rank", "step (s)", "tp comm", "sends",
                "bubble"):
        t.add_column(col, justify="right")
    for k, (r, c) in enumerate(zip(mp.stages, mp.costs)):
        p, br = r.prediction, r.prediction.breakdown
        t.add_row(str(k), human_count(sum(ch.used for ch in r.chunks)), str(len(r.chunks)),
                  human_bytes(p.peak_device_bytes), human_bytes(p.peak_host_bytes), f"{p.step_time_s:.3f}",
                  f"{c.tensor_collectives:.3f}", f"{c.pipeline_sends:.3f}", f"{br['pipeline_bubble']:.3f}")
    console.print(t)
    console.print(f"predicted per rank: {human_bytes(mp.peak_device_bytes)} device, {human_bytes(mp.peak_host_bytes)} "
                  f"host at most; step {mp.step_time_s:.3f} s (the slowest stage)")
