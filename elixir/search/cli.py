"""``elixir plan`` past the request (:mod:`elixir.plan_cli` reads it, chooses the hardware profile and
refuses what the parameters alone rule out): build the model on meta, trace the step (by layer
repetition when the model is deep), search, print the report and write the plan.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Optional

import torch
from rich.console import Console
from rich.table import Table

from elixir import models
from elixir.plan import MeshLayout
from elixir.plan.tensor_plans import local_shapes, style_plan
from elixir.search.mesh_profile import MeshPlan, search_mesh
from elixir.search.optimal import DoesNotFitError, human_count, search_profile
from elixir.search.step_profile import profile_by_layers, profile_step
from elixir.tables import human_bytes


def _layer_key(cfg) -> tuple[str, int]:
    d = cfg.to_dict()
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if k in d and isinstance(d[k], int):
            return k, d[k]
    raise ValueError("the config names no layer count (num_hidden_layers / n_layer); use --full-trace")


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


def plan(args: argparse.Namespace, console: Console, hw, hw_why: str, dtype: torch.dtype,
         budgets: tuple[Optional[int], int, Optional[int], int], t0: float) -> int:
    """``elixir plan`` once :mod:`elixir.plan_cli` has read the request and chosen ``hw``: trace
    the step, search, print the report and write the plan. ``budgets``: the device memory (None:
    the profile's), host memory and disk (None: none) per rank, and the ranks per node."""
    device, host, disk, rpn = budgets
    with console.status(f"tracing {args.model} (batch {args.batch}, seq {args.seq}, {args.dtype})"):
        profile = build_profile(args.model, args.batch, args.seq, dtype, args.checkpointing, args.full_trace)
    t_trace = time.perf_counter() - t0
    if args.tp > 1 or args.pp > 1:
        return _plan_mesh(args, console, profile, hw, hw_why, device, host, disk, rpn, t0)
    try:
        result = search_profile(
            profile, args.world_size, hardware=hw, device_memory=device, host_memory=host, disk=disk,
            optimizer_type=args.optimizer, overlap=not args.no_overlap, verbose=True, console=console,
            ranks_per_node=rpn, hardware_choice=hw_why, frozen=args.frozen, master=args.master,
            moments=args.moments, allow_lossy_state=args.allow_lossy_state,
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
                         overlap=not args.no_overlap, ranks_per_node=rpn, hardware_choice=hw_why,
                         frozen=args.frozen, master=args.master, moments=args.moments,
                         allow_lossy_state=args.allow_lossy_state)
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


def _state_label(r) -> str:
    """A stage's optimizer-state formats, ``master/moments`` (fp32 where the plan records none),
    and its frozen chunks' format when they are quantised."""
    label = f"{r.master_format or 'fp32'}/{r.moments_format or 'fp32'}"
    return label + (f", frozen {r.frozen_format}" if r.frozen_format else "")


def _print_mesh(console: Console, mp: MeshPlan) -> None:
    t = Table(title=f"elixir hybrid plan: {mp.layout.describe()}, {mp.schedule}, {mp.microbatches} microbatches")
    for col in ("stage", "params/rank", "chunks", "state", "device/rank", "host/rank", "step (s)", "tp comm", "sends",
                "bubble"):
        t.add_column(col, justify="right")
    for k, (r, c) in enumerate(zip(mp.stages, mp.costs)):
        p, br = r.prediction, r.prediction.breakdown
        t.add_row(str(k), human_count(sum(ch.used for ch in r.chunks)), str(len(r.chunks)), _state_label(r),
                  human_bytes(p.peak_device_bytes), human_bytes(p.peak_host_bytes), f"{p.step_time_s:.3f}",
                  f"{c.tensor_collectives:.3f}", f"{c.pipeline_sends:.3f}", f"{br['pipeline_bubble']:.3f}")
    console.print(t)
    for k, r in enumerate(mp.stages):
        why = r.info.get("state_formats", {}).get("why")
        if why:
            console.print(f"stage {k} state formats (master/moments): {why}")
    console.print(f"predicted per rank: {human_bytes(mp.peak_device_bytes)} device, {human_bytes(mp.peak_host_bytes)} "
                  f"host at most; step {mp.step_time_s:.3f} s (the slowest stage)")
