"""``elixir plan``: plan a run for any cluster (not necessarily this machine) and write the plan.

Example: OPT-66B on one node of 8x A100-40GB, planned from a laptop::

    elixir plan opt-66b --world-size 8 --hardware 8xA100-40GB --batch 1 --seq 2048 --dtype bf16 \\
        --checkpointing --out plan.json

This module reads the request, chooses the hardware profile and refuses at once a budget that the
parameters alone exceed (:func:`elixir.plan.budgets.untraced_refusal`, from the config's fields:
no model is built, nothing is traced). Then :mod:`elixir.search.cli` builds the model on meta,
traces it (models with more than 3 repeated layers at 2 and 3 layers, extrapolated by layer
repetition; ``--full-trace`` traces the whole model) and searches.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from typing import Optional

from rich.console import Console

from elixir import models
from elixir.hardware.registry import (
    DEFAULT_RULE,
    choose_default_profile,
    closest_reference_gpu,
    load_profile,
    reference_profiles,
)
from elixir.plan import dtype_from_name
from elixir.plan.budgets import budgets_for, untraced_refusal
from elixir.plan.mesh import SCHEDULES
from elixir.plan.state_format import FROZEN_FORMATS, MASTER_FORMATS, MOMENT_FORMATS, leaner_formats
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
    fmt = parser.add_argument_group("state formats (MixedPrecisionPolicy's fields; docs/optimizer.md)")
    fmt.add_argument("--master", default="fp32", choices=MASTER_FORMATS, help="format of the optimizer's master copy")
    fmt.add_argument("--moments", default="fp32", choices=MOMENT_FORMATS, help="format of Adam's moments")
    fmt.add_argument("--frozen", default=None, choices=[f for f in FROZEN_FORMATS if f],
                     help="store frozen chunks (an adapter fine-tune's base) quantised")
    fmt.add_argument("--allow-lossy-state", action="store_true",
                     help="let the search choose leaner state formats (int8 moments, then a bf16-sr master) where "
                          "these do not fit, or fit only with optimizer state on disk")
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
    models.config_fields(args.model)  # an unknown name or a bad path fails here, before any profile is chosen
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
    host = (args.host_memory if args.host_memory is not None else hw.host_memory_bytes) // rpn
    disk = None if args.disk is None else args.disk // rpn
    # with --tp/--pp too: the ranks together hold every trainable parameter at least once (a tied
    # embedding on two stages, the norms on every tp rank: more, never fewer), so the floor over
    # all --world-size ranks binds the rank holding the most
    floor = models.parameter_floor(args.model)
    if floor:
        # the leanest formats the search may turn to: a refusal here must be the search's too
        formats = ([(args.master, args.moments)] + leaner_formats(args.master, args.moments))[
            -1 if args.allow_lossy_state else 0]
        error = untraced_refusal(floor, dtype, args.world_size, hw, budgets_for(hw, rpn, device, host, disk),
                                 args.optimizer, formats=formats)
        if error is not None:
            console.print(f"[red]{error}[/red]")
            return 1
    # the tracer and the search (torch.fx, DTensor, transformers' model code) load only for a budget
    # the parameters alone do not rule out: a refusal above costs no more than torch's import
    from elixir.search import cli as search_cli

    return search_cli.plan(args, console, hw, hw_why, dtype, (device, host, disk, rpn), t0)
