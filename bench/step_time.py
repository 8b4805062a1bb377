"""Step time and peak memory: Elixir against torch DDP, FSDP2, DeepSpeed ZeRO-3 and plain torch.

Every line runs in fresh processes (world 2 through torchrun over gloo; world 1 as one plain
process), so each peak RSS is its own. Step time is the median over the timed steps after warm-up,
as seen by rank 0. Ratios compare lines of the same invocation only.

    python bench/step_time.py                          # the issue's full line-up (see DEFAULT_LINES)
    python bench/step_time.py --systems elixir-optimal:2 fsdp2-fused:2 deepspeed:2 --steps 4
    python bench/step_time.py --systems elixir-optimal:2@medium fsdp2-fused:2@medium
    python bench/step_time.py --json results.json

A line is ``system:world[@model]``. Models: ``small`` (GPT-2 from ``transformers`` at 81.9M
parameters: n_embd 768, 6 layers, vocabulary 50257, tied embedding), ``medium`` (GPT-2 medium's
shape: n_embd 1024, 24 layers, 354.8M) and ``tiny`` (for smoke tests). Batch 2 per rank,
sequence 128, AdamW.

Systems:

- ``elixir-optimal`` (fp32) and ``elixir-optimal-bf16`` (bf16 chunks, fp32 masters): the plan
  ``optimal_search`` picks by itself for this step (traced) and the per-rank budget ``--budget``
  (default: the box's memory divided by the ranks); elixir's HybridAdam. The line records the
  search's predicted step time next to the measured one.
- ``elixir-optimal-fused``: ``elixir-optimal`` with ``use_fused_kernels`` applied before the
  search (eager attention switched to torch's fused SDPA); run with ``--attn eager`` to measure it.
- ``elixir-tight``: the same search under the tight per-rank device budget ``--tight-budget``
  (default: ``--tight-fraction`` of the way from the least budget any plan fits in to the budget
  ``elixir-optimal``'s plan needs), enforced
  by the runtime's memory ledger (``memory_limit``: an allocation past it raises), so the plan is
  proven to fit. ``elixir-tight-zero3`` / ``elixir-tight-zero2``: the same budget (computed from
  the unrestricted search, as for ``elixir-tight``), but the search keeps every body chunk
  sharded (ZeRO-3) / ZeRO-1/2 (``body_sharding``): with ``elixir-tight`` they show whether the
  mixed plan the search picks beats both pure plans on one budget (a line whose pure plan does
  not fit fails and says so). Issue 13's mixed case: GPT-2 medium, batch 1, sequence 8 (the
  step is communication-bound) on 5.75 GiB per rank, just short of what pure ZeRO-1/2 needs,
  ``--systems elixir-tight:2@medium elixir-tight-zero3:2@medium elixir-tight-zero2:2@medium
  --batch 1 --seq 8 --tight-budget 5.75``: the search keeps most body chunks ZeRO-1 and shards
  the rest; measured 0.77x pure ZeRO-3 on 2026-11-26, and pure ZeRO-1/2 does not fit
  (docs/benchmarks.md, with the 6.0 GiB budget where pure ZeRO-1/2 fits and wins by 6%).
- ``elixir`` / ``elixir-hybrid`` / ``elixir-bf16``: ``minimum_waste_search``'s plan, with torch
  AdamW / HybridAdam / bf16 chunks and HybridAdam.
- ``elixir-zero2`` / ``elixir-zero1``: the same chunks as ZeRO-2 / ZeRO-1 chunks (what
  ``LowLevelZeroPlugin(stage=2|1)`` runs: parameters whole on every rank, fp32 master and optimizer
  state split, gradients reduce-scattered / all-reduced, updated parameters all-gathered after the
  step), with HybridAdam.
- ``ddp``, ``fsdp2`` (per block plus root), ``plain`` (world 1 only), each with torch AdamW, and
  ``-fused`` variants with ``fused=True``; ``ddp-bf16`` (autocast bf16), ``fsdp2-bf16``
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=--bf16-reduce)``), ``fsdp2-offload``
  (``CPUOffloadPolicy``); all ``-bf16``/``-offload`` peers use fused AdamW.

**Like with like** (issue 35). bf16 lines reduce gradients in one dtype, ``--bf16-reduce``
(default fp32, FSDP2's usual ``reduce_dtype``): elixir's bf16 lines with ``reduce_always_fp32``
(and the search prices fp32 reductions), FSDP2's ``reduce_dtype``, DeepSpeed's
``communication_data_type``; DDP's autocast reduces fp32 gradients anyway. Each line records its
``reduce_dtype``. Where a budget is claimed (an ``elixir-tight`` line), *every* line of that
model and world, whatever its system (DDP, FSDP2, DeepSpeed, elixir), runs under one RSS cap at
it, per rank, measured as ``bench/capacity.py`` caps its trials (``bench/rss_cap.py``; a rank
past it kills the line; ``--no-rss-cap`` lifts it): the budget given by ``--tight-budget``, or
the one the ``elixir-tight`` line's search set (that line runs first in its group). A line that
claims the budget (``elixir-tight*``, the ``-offload`` peers) fails when killed; any other is
listed as over the cap. elixir's ledger limit on that line is the cap less what the process
holds outside the ledger (its size before the model and the step's untracked bytes the hardware
profile declares: the search's ``process_bytes``) and what the runtime does not book, so elixir
gets no looser budget than the cap the others run under. ``elixir-tight`` is then ranked
against every line of its model and world whose peak RSS per rank stayed under the cap.
- ``deepspeed`` (ZeRO-3, fp32), ``deepspeed-bf16``, ``deepspeed-offload`` (ZeRO-3 with optimizer
  state and parameters offloaded to CPU), built outside ``zero.Init`` (broken with transformers
  5.x), gloo through ``deepspeed.init_distributed``, torch's fused AdamW as the client optimizer
  (``zero_force_ds_cpu_optimizer: false``, so no JIT build of DeepSpeedCPUAdam).

On this CPU-only box "device" and "host" are the same memory: the tight budget is an emulated
device budget (the ledger) for elixir, and every line reports its peak RSS (whole process, model
construction included) and its RSS above the process's baseline after start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from rss_cap import rank_rss  # bench/rss_cap.py: the cap bench/capacity.py enforces, measured the same way

GiB = 2**30

ELIXIR_SYSTEMS = (
    "elixir-optimal", "elixir-optimal-bf16", "elixir-optimal-fused", "elixir-tight", "elixir", "elixir-hybrid", "elixir-bf16",
    "elixir-zero2", "elixir-zero1", "elixir-tight-zero3", "elixir-tight-zero2",
)
PEER_SYSTEMS = (
    "ddp", "ddp-fused", "ddp-bf16", "fsdp2", "fsdp2-fused", "fsdp2-bf16", "fsdp2-offload",
    "deepspeed", "deepspeed-bf16", "deepspeed-offload", "plain", "plain-fused",
)
SYSTEMS = ELIXIR_SYSTEMS + PEER_SYSTEMS

MODELS = {  # name: (n_embd, n_layer, n_head)
    "tiny": (64, 2, 2),
    "small": (768, 6, 12),
    "medium": (1024, 24, 16),
}

# The done-when figures, in one invocation: fp32 at 81.9M, bf16, 350M, and the tight budget.
DEFAULT_LINES = (
    "elixir-optimal:2", "fsdp2-fused:2", "ddp-fused:2", "deepspeed:2", "elixir:2", "fsdp2:2", "ddp:2",
    "elixir-optimal-bf16:2", "fsdp2-bf16:2", "ddp-bf16:2", "deepspeed-bf16:2",
    "elixir-tight:2", "fsdp2-offload:2", "deepspeed-offload:2",
    "elixir-optimal:2@medium", "fsdp2-fused:2@medium", "deepspeed:2@medium", "ddp-fused:2@medium",
    "elixir-zero2:2", "elixir-zero1:2", "elixir-tight-zero3:2", "elixir-tight-zero2:2",
)
# (numerator, denominator, step-time target, memory target): the targets. The memory
# target compares per-rank peak RSS.
RATIOS = (
    ("elixir-optimal:2", "fsdp2-fused:2", 0.8, 1.0),
    ("elixir-optimal:2", "fsdp2:2", 0.8, 1.0),
    ("elixir-optimal:2", "deepspeed:2", 0.8, None),
    ("elixir-optimal:2", "ddp-fused:2", 1.05, None),
    ("elixir-optimal:2", "ddp:2", 1.05, None),
    ("elixir:2", "fsdp2:2", 0.8, 1.0),
    ("elixir:2", "ddp:2", 1.1, None),
    ("elixir:1", "plain:1", 1.05, None),
    ("elixir-hybrid:2", "fsdp2-fused:2", 0.8, None),
    ("elixir-hybrid:1", "plain-fused:1", 1.05, None),
    ("elixir-optimal-bf16:2", "fsdp2-bf16:2", 0.8, None),
    ("elixir-optimal-bf16:2", "deepspeed-bf16:2", 0.8, None),
    ("elixir-optimal-bf16:2", "ddp-bf16:2", None, None),
    ("elixir-optimal-fused:2", "elixir-optimal:2", None, None),
    ("elixir-bf16:2", "fsdp2-bf16:2", None, None),
    ("elixir-tight:2", "fsdp2-offload:2", 1.0, None),
    ("elixir-tight:2", "deepspeed-offload:2", 1.0, None),
    ("elixir-optimal:2@medium", "fsdp2-fused:2@medium", 1.0, None),
    ("elixir-optimal:2@medium", "fsdp2:2@medium", 1.0, None),
    ("elixir-optimal:2@medium", "deepspeed:2@medium", 1.0, None),
    ("elixir-optimal:2@medium", "ddp-fused:2@medium", 1.05, None),
    ("elixir-zero2:2", "ddp-fused:2", None, None),
    ("elixir-tight:2", "elixir-tight-zero3:2", 1.0, None),
    ("elixir-tight:2", "elixir-tight-zero2:2", 1.0, None),
    ("elixir-zero2:2", "elixir-hybrid:2", None, None),
    ("elixir-tight:2@medium", "elixir-tight-zero3:2@medium", 1.0, None),
    ("elixir-tight:2@medium", "elixir-tight-zero2:2@medium", 1.0, None),
)


@dataclass(frozen=True)
class BenchConfig:
    """The workload (the same for every line of one model) and the budgets."""

    model: str = "small"
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
    budget: Optional[int] = None  # per-rank device budget for elixir-optimal (bytes); None: box memory / ranks
    tight_budget: Optional[int] = None  # per-rank device budget for elixir-tight (bytes)
    tight_fraction: float = 0.5  # else this fraction of elixir-optimal's predicted device bytes
    attn: str = ""  # attention implementation of the model ("eager", "sdpa"); "": transformers' default
    line_budget: float = 0.0  # seconds of timed steps after which a line stops early (0: always cfg.steps)
    bf16_reduce: str = "float32"  # gradient reduction dtype of every bf16 line that can choose it (see --bf16-reduce)

    def for_model(self, name: str, layers: Optional[int] = None) -> BenchConfig:
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; choose from {sorted(MODELS)}")
        e, n, h = MODELS[name]
        return replace(self, model=name, n_embd=e, n_layer=layers or n, n_head=h)


@dataclass
class LineResult:
    system: str
    world: int
    model: str
    step_s: float
    step_times: list[float]
    peak_rss: list[int]  # bytes, per rank
    base_rss: list[int]  # bytes, per rank, after start-up (imports, process group), before the model
    losses: list[float]
    params: int
    extra: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return line_key(self.system, self.world, self.model)


def line_key(system: str, world: int, model: str) -> str:
    return f"{system}:{world}" + ("" if model == "small" else f"@{model}")


def split_tree(line: str) -> tuple[str, str]:
    """``system:world[@model][#tree]`` -> (the line without its tree, the tree's name or "")."""
    line, _, tree = line.partition("#")
    return line, tree


def tree_worker(trees: dict[str, str], tree: str, cfg: dict) -> tuple[str, dict, dict]:
    """The worker script, config and environment of a line run from another checkout (``--tree``):
    that tree's own ``bench/step_time.py`` and ``elixir``, given only the config fields its
    ``BenchConfig`` declares (a newer field it lacks keeps its default meaning there)."""
    if tree not in trees:
        raise SystemExit(f"line names tree {tree!r}, but no --tree {tree}=PATH was given")
    root = os.path.abspath(trees[tree])
    script = os.path.join(root, "bench", "step_time.py")
    with open(script) as f:
        src = f.read()
    known = {k: v for k, v in cfg.items() if re.search(rf"^    {k}: ", src, re.M)}
    return script, known, {"PYTHONPATH": root}


def parse_line(line: str) -> tuple[str, int, str]:
    line, _ = split_tree(line)
    head, _, model = line.partition("@")
    system, _, world_s = head.partition(":")
    if system not in SYSTEMS:
        raise SystemExit(f"unknown system {system!r} in {line!r}; choose from {SYSTEMS}")
    if not world_s.isdigit() or int(world_s) < 1:
        raise SystemExit(f"line {line!r}: write system:world[@model], e.g. elixir-optimal:2@medium")
    model = model or "small"
    if model not in MODELS:
        raise SystemExit(f"unknown model {model!r} in {line!r}; choose from {sorted(MODELS)}")
    if system.startswith("plain") and int(world_s) != 1:
        raise SystemExit(f"{line!r}: plain torch runs at world 1 only")
    return system, int(world_s), model


# ---------------------------------------------------------------------------------------------
# worker: one system, one world size


def build_model(cfg: BenchConfig):
    from transformers import GPT2Config, GPT2LMHeadModel

    c = GPT2Config(
        vocab_size=cfg.vocab, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, n_positions=max(1024, cfg.seq),
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(c)
    if cfg.attn:
        model.set_attn_implementation(cfg.attn)
    return model


def make_batch(cfg: BenchConfig, step: int, rank: int, world: int):
    import torch

    g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    ids = torch.randint(0, cfg.vocab, (world * cfg.batch, cfg.seq), generator=g)
    return ids[rank * cfg.batch : (rank + 1) * cfg.batch]


def box_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _train_step(model, batch):
    loss = model(**batch).loss
    loss.backward()
    return loss


def _runtime_share(plan) -> int:
    """Bytes of the plan's predicted device peak that the runtime's ledger does not hold:
    activations, buffers, and the optimizer moments of device-placed chunks (the inner optimizer
    allocates those: this rank's part of every chunk whose state is split, the ZeRO-1/2 chunks'
    as well as the sharded ones', and a replicated chunk's whole)."""
    from elixir.plan.footprint import ADAM_STATE_BYTES

    mem = plan.info["predicted_memory"]
    moments = sum((c.chunk_size // plan.world_size if c.state_sharded else c.chunk_size) * ADAM_STATE_BYTES
                  for c in plan.chunks if c.optim_placement.value == "device")
    return mem.get("activations", 0) + mem.get("buffers", 0) + moments


def _optimal_plan(system: str, model, cfg: BenchConfig, world: int, dtype, extra: dict):
    """``optimal_search``'s plan for this line's budget; records what it predicts."""
    from elixir.hardware import default_profile
    from elixir.search import optimal_search
    from elixir.search.cost_model import unified_memory

    ids = make_batch(cfg, 0, 0, world)
    inp = {"input_ids": ids, "labels": ids}
    host = box_memory() // world
    budget = cfg.budget or host

    unified = unified_memory(default_profile())

    reduce = _reduce_dtype(cfg, dtype)

    measured: dict = {}

    def search(memory: int, body_sharding: str = "mixed"):
        # on a CPU-only profile device and host are one pool: the budget bounds both together;
        # every search of the line plans on the process size the first one measured (the process
        # grows between searches, and a budget found by one search must fit in the next)
        sr = optimal_search(model, world, unified_dtype=dtype, overlap=True, inp=inp, step_fn=_train_step,
                            device_memory=memory, host_memory=memory if unified else host, body_sharding=body_sharding,
                            reduce_dtype=reduce, process_bytes=measured.get("process_bytes"))
        measured.setdefault("process_bytes", sr.info["process_bytes"])
        return sr

    t0 = time.perf_counter()
    sr = search(budget)
    limit = None
    if system.startswith("elixir-tight"):
        if cfg.tight_budget:
            budget = cfg.tight_budget
        else:  # between the least budget any plan fits in and what the unconstrained plan needs
            from elixir.search.optimal import DoesNotFitError

            try:
                search(1)
                least = 1
            except DoesNotFitError as e:
                least = e.needs.get("memory") or e.needs["device_memory"]
            peak = sr.prediction.peak_device_bytes + (sr.prediction.peak_host_bytes if unified else 0)
            need = int(peak / (1 - sr.info["margins"]["device"])) + 1
            budget = least + int(cfg.tight_fraction * max(0, need - least))
        extra["least_budget"] = least if not cfg.tight_budget else None
        sr = search(budget, {"elixir-tight-zero3": "sharded", "elixir-tight-zero2": "zero"}.get(system, "mixed"))
        # the ledger enforces what the plan may use of the budget, which is the RSS cap every line
        # of this model runs under: the cap less what the process holds outside the ledger (its
        # size before the model, and the step's untracked bytes the hardware profile declares,
        # both in the search's process_bytes) and what the runtime does not account (activations,
        # buffers, device optimizer moments). The search's own margin (usable_after_margins) left
        # the process's bytes out, so the ledger let elixir's tensors alone fill 90% of the cap
        limit = max(1, budget - sr.info["process_bytes"] - _runtime_share(sr))
    extra.update(
        search_s=time.perf_counter() - t0, budget=budget, memory_limit=limit,
        predicted_step_s=sr.prediction.step_time_s, predicted_device_bytes=sr.prediction.peak_device_bytes,
        predicted_host_bytes=sr.prediction.peak_host_bytes, predicted_breakdown=sr.prediction.breakdown,
        predicted_activation_bytes=sr.info["predicted_memory"].get("activations", 0),
        plan=plan_summary(sr),
    )
    return sr, limit


def _reduce_dtype(cfg: BenchConfig, dtype):
    """The gradient reduction dtype of a line computing in ``dtype``: its own in fp32, else
    ``cfg.bf16_reduce`` (the same on every bf16 line that can choose it)."""
    import torch

    return dtype if dtype == torch.float32 else getattr(torch, cfg.bf16_reduce)


def plan_summary(sr) -> dict:
    from collections import Counter

    code = {"device": "D", "host": "H", "disk": "K"}
    kind = {"sharded": "S", "zero2": "2", "zero1": "1", "replicated": "R"}
    kinds = Counter(kind[c.sharding.value] + code[c.shard_placement.value] + code[c.optim_placement.value] for c in sr.chunks)
    shared = [n for c in sr.chunks for n in c.params if "wte" in n]
    tied_sharded = any(c.sharded for c in sr.chunks for n in c.params if "wte" in n)
    return {"search": sr.search, "chunk_size": sr.chunk_size, "chunks": len(sr.chunks), "cache_blocks": sr.cache_blocks,
            "prefetch_depth": sr.prefetch_depth, "kinds": dict(kinds), "tied_embedding_sharded": tied_sharded if shared else None,
            "waste": sr.waste()}


def wrap(system: str, model, cfg: BenchConfig, world: int):
    """Return ``(model, optimizer, extra)`` for ``system``."""
    import torch

    extra: dict = {}
    bf16 = system.endswith("-bf16")
    if system.startswith("elixir"):
        from elixir.optim import HybridAdam
        from elixir.search import minimum_waste_search
        from elixir.wrapper import ElixirModule, ElixirOptimizer

        dtype = torch.bfloat16 if bf16 else torch.float32
        limit = None
        if system == "elixir-optimal-fused":
            from elixir.wrapper.fused_kernels import apply_fused_kernels

            # before the search, so that it traces the fused step
            extra["fused_kernels"] = apply_fused_kernels(model)
        if system in ("elixir-optimal", "elixir-optimal-bf16", "elixir-optimal-fused", "elixir-tight",
                      "elixir-tight-zero3", "elixir-tight-zero2"):
            sr, limit = _optimal_plan(system, model, cfg, world, dtype, extra)
        else:
            t0 = time.perf_counter()
            sr = minimum_waste_search(model, world, unified_dtype=dtype)
            if system in ("elixir-zero2", "elixir-zero1"):
                from elixir.booster.low_level_zero import zero_plan
                from elixir.search import Sharding

                sr = zero_plan(sr, Sharding.ZERO2 if system == "elixir-zero2" else Sharding.ZERO1)
            extra.update(search_s=time.perf_counter() - t0, plan=plan_summary(sr))
        if system == "elixir":
            inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        else:
            inner = HybridAdam(model.parameters(), lr=cfg.lr)
        reduce = _reduce_dtype(cfg, dtype)
        extra["reduce_dtype"] = str(reduce).replace("torch.", "")
        wrapped = ElixirModule(model, sr, dtype=dtype, output_fp32=True, memory_limit=limit,
                               prefetch=sr.param_order is not None,
                               reduce_always_fp32=dtype != torch.float32 and reduce == torch.float32)
        return wrapped, ElixirOptimizer(wrapped, inner), extra
    fused = system.endswith(("-fused", "-bf16", "-offload"))
    if system.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        extra["reduce_dtype"] = "float32"  # autocast leaves parameters and their gradients fp32
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=fused), extra
    if system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        kw: dict = {}
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, cfg.bf16_reduce))
            extra["reduce_dtype"] = cfg.bf16_reduce
        if system == "fsdp2-offload":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=fused), extra
    if system.startswith("deepspeed"):
        import deepspeed

        zero: dict = {"stage": 3}
        if system == "deepspeed-offload":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        ds_config = {
            "train_micro_batch_size_per_gpu": cfg.batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "bf16": {"enabled": bf16},
            # the same reduction dtype as the other bf16 lines (DeepSpeed's own default: the compute dtype)
            **({"communication_data_type": "fp32" if cfg.bf16_reduce == "float32" else "bf16"} if bf16 else {}),
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 1 << 30,
        }
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        if bf16:
            extra["reduce_dtype"] = cfg.bf16_reduce
        return engine, ds_opt, extra
    if system.startswith("plain"):
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=fused), extra
    raise SystemExit(f"unknown system {system!r}; choose from {SYSTEMS}")


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(system: str, cfg: BenchConfig, out: str, profile: Optional[str]) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    if system.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    from elixir import device as dev
    from elixir import distributed as edist

    info = edist.init_distributed(backend="gloo")
    rank, world = info.rank, info.world_size
    base_rss = _rss_now()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    model, optim, extra = wrap(system, model, cfg, world)
    is_ds = system.startswith("deepspeed")
    autocast = system == "ddp-bf16"

    comm = _time_collectives(edist) if system.startswith("elixir") else None
    phases: list[tuple[float, float, float, float]] = []  # forward, backward, optimizer, collectives

    def step(i: int) -> float:
        ids = make_batch(cfg, i, rank, world)
        c0 = comm.total if comm else 0.0
        t0 = time.perf_counter()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        if is_ds:
            model.backward(loss)
        else:
            loss.backward()
        t2 = time.perf_counter()
        if is_ds:
            model.step()
        else:
            optim.step()
            optim.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        phases.append((t1 - t0, t2 - t1, t3 - t2, (comm.total - c0) if comm else float("nan")))
        return float(loss.detach().float())

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
        if cfg.line_budget and i >= cfg.warmup and i + 1 < cfg.warmup + cfg.steps:
            # a slow line (a peer's bf16 on a CPU without bf16 kernels) stops early, after the
            # same step on every rank: rank 0's clock decides
            if edist.all_gather_object(sum(times[cfg.warmup:]))[0] > cfg.line_budget:
                break
    rss = dev.peak_rss_bytes()
    if system.startswith("elixir"):
        extra["memory"] = model.memory_report()
        extra["collectives"] = dict(comm.seconds)
    timed_phases = phases[cfg.warmup :]
    extra["phases"] = {k: statistics.median(p[j] for p in timed_phases)
                       for j, k in enumerate(("forward", "backward", "optimizer", "collectives"))}
    rss_all = edist.all_gather_object(rss)
    base_all = edist.all_gather_object(base_rss)
    if rank == 0:
        timed = times[cfg.warmup :]
        res = LineResult(system, world, cfg.model, statistics.median(timed), timed, rss_all, base_all, losses, params, extra)
        with open(out, "w") as f:
            json.dump(asdict(res), f)
    if hasattr(model, "drain"):
        model.drain()
    if dist.is_initialized():
        dist.barrier()
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


def claims_budget(system: str) -> bool:
    """Lines that claim the tight budget (``elixir-tight*``, and the peers' CPU-offload variants
    beside it): passing its RSS cap fails them."""
    return system.startswith("elixir-tight") or system.endswith("-offload")


def tight_groups(lines: list[str]) -> set[tuple[int, str]]:
    """(world, model) of each ``elixir-tight`` line: a budget is claimed there, and every line of
    that world and model runs under its RSS cap."""
    return {(w, m) for s, w, m in map(parse_line, lines) if s == "elixir-tight"}


def run_order(lines: list[str], cap_given: bool) -> list[str]:
    """``lines`` in the order to run them: without a given cap, each ``elixir-tight`` line before
    the other lines of its world and model (its search sets the budget they are all capped at)."""
    if cap_given:
        return list(lines)
    out = list(lines)
    for line in lines:
        system, world, model = parse_line(line)
        if system == "elixir-tight" and not split_tree(line)[1]:
            first = next(i for i, x in enumerate(out) if parse_line(x)[1:] == (world, model))
            out.remove(line)
            out.insert(first, line)
    return out


def run_line(line: str, base: BenchConfig, layers: Optional[int], timeout: float, profile_dir: Optional[str],
             rss_cap: Optional[int] = None, trees: Optional[dict[str, str]] = None) -> LineResult:
    """Run one line in fresh processes. With ``rss_cap`` (bytes), the line is killed as soon as
    any of its processes (a rank) holds more, and fails saying so. A line ending ``#tree`` runs
    from the checkout ``trees[tree]`` (see :func:`tree_worker`)."""
    system, world, model = parse_line(line)
    cfg = base.for_model(model, layers)
    script, config, tree_env = os.path.abspath(__file__), asdict(cfg), {}
    if split_tree(line)[1]:
        script, config, tree_env = tree_worker(trees or {}, split_tree(line)[1], config)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        args = [script, "--worker", system, "--out", out, "--config", json.dumps(config)]
        if profile_dir:
            args += ["--profile", os.path.join(profile_dir, f"{system}-w{world}-{model}.txt")]
        if world > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone", *args]
        else:
            cmd = [sys.executable, *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)),
                   TRANSFORMERS_VERBOSITY="error", DS_BUILD_OPS="0", **tree_env)
        # to files, not pipes: a chatty line fills a pipe nobody reads while it is watched
        with open(os.path.join(tmp, "out"), "w") as fo, open(os.path.join(tmp, "err"), "w") as fe:
            p = subprocess.Popen(cmd, env=env, stdout=fo, stderr=fe, text=True, start_new_session=True)
        t0, peak, killed = time.monotonic(), 0, ""
        while p.poll() is None:
            if rss_cap is not None:
                peak = max(peak, rank_rss(p.pid, world))
                if peak > rss_cap:
                    killed = f"killed: a rank's RSS passed the {rss_cap / GiB:.2f} GiB cap ({peak / GiB:.2f} GiB)"
            if not killed and time.monotonic() - t0 > timeout:
                killed = f"killed after {timeout:g} s"
            if killed:
                os.killpg(p.pid, 9)
                p.wait()
                raise RuntimeError(f"{line} {killed}")
            time.sleep(0.1)
        with open(os.path.join(tmp, "out")) as fo, open(os.path.join(tmp, "err")) as fe:
            proc = subprocess.CompletedProcess(cmd, p.returncode, fo.read(), fe.read())
        if proc.returncode != 0 or not os.path.exists(out):
            # the workers' own error first (torchrun's traceback follows it and would bury it):
            # e.g. a pure plan that does not fit the tight budget says so and what it needs
            own = [ln for ln in proc.stderr.splitlines() if "Error: " in ln and "ChildFailedError" not in ln]
            why = f"{own[0].strip()}\n" if own else ""
            raise RuntimeError(f"{line} failed (exit {proc.returncode}): {why}{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        with open(out) as f:
            return LineResult(**json.load(f))


def ratios(results: dict[str, LineResult]) -> list[dict]:
    rows = []
    # each line run from another tree against the same line from this one: this code over the other's
    trees = [(line_key(r.system.partition("#")[0], r.world, r.model), key) for key, r in results.items() if "#" in r.system]
    for num, den, t_target, m_target in (*RATIOS, *((new, old, None, None) for new, old in trees)):
        if num in results and den in results:
            a, b = results[num], results[den]
            pa, pb = a.extra.get("predicted_step_s"), b.extra.get("predicted_step_s")
            rows.append({
                "ratio": f"{num} / {den}",
                "time": a.step_s / b.step_s,
                "predicted_time": pa / pb if pa and pb else None,  # the search's own ratio, where both lines searched
                "peak_rss": max(a.peak_rss) / max(b.peak_rss),
                "time_target": t_target,
                "rss_target": m_target,
            })
    return rows


def _fmt_gib(b: Optional[int]) -> str:
    return "-" if b is None else f"{b / GiB:.2f}"


def print_results(results: dict[str, LineResult], cfg: BenchConfig, wall: float,
                  over_cap: Optional[dict[str, str]] = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    by_model: dict[str, list[LineResult]] = {}
    for r in results.values():
        by_model.setdefault(r.model, []).append(r)
    for model, rs in by_model.items():
        t = Table(title=f"step time: GPT-2 {model} ({rs[0].params / 1e6:.1f}M), batch {cfg.batch}/rank, seq {cfg.seq}, "
                        f"median of {cfg.steps} steps after {cfg.warmup} warm-up"
                        + (f" (fewer where a line's timed steps passed {cfg.line_budget:.0f} s)" if cfg.line_budget else ""))
        for col in ("line", "step (s)", "min..max (s)", "fwd / bwd / opt (s)", "elixir comm (s)",
                    "peak RSS/rank (GiB)", "above start (GiB)", "first losses"):
            t.add_column(col, justify="right")
        for r in rs:
            ph = r.extra.get("phases", {})
            comm = ph.get("collectives", float("nan"))
            t.add_row(r.key, f"{r.step_s:.3f}", f"{min(r.step_times):.2f}..{max(r.step_times):.2f}",
                      " / ".join(f"{ph.get(k, float('nan')):.2f}" for k in ("forward", "backward", "optimizer")),
                      "-" if comm != comm else f"{comm:.2f}",
                      " / ".join(f"{b / GiB:.2f}" for b in r.peak_rss),
                      " / ".join(f"{(p - b) / GiB:.2f}" for p, b in zip(r.peak_rss, r.base_rss)),
                      " ".join(f"{x:.3f}" for x in r.losses[:2]))
        console.print(t)
    plans = [r for r in results.values() if "plan" in r.extra]
    if plans:
        pt = Table(title="elixir plans: the search's prediction against the measurement (rank 0)")
        for col in ("line", "search", "chunk", "blocks/depth", "chunk kinds", "tied emb.", "budget (GiB)",
                    "pred. step (s)", "measured (s)", "meas/pred", "pred. device (GiB)", "traced activations (GiB)",
                    "ledger peak (GiB)"):
            pt.add_column(col, justify="right", no_wrap=col == "line")
        for r in plans:
            p, x = r.extra["plan"], r.extra
            pred = x.get("predicted_step_s")
            kinds = " ".join(f"{k}x{v}" for k, v in sorted(p["kinds"].items()))
            tied = {True: "sharded", False: "replicated", None: "-"}[p.get("tied_embedding_sharded")]
            pt.add_row(r.key, p["search"], f"{p['chunk_size']:,}", f"{p['cache_blocks']}/{p['prefetch_depth']}", kinds, tied,
                       _fmt_gib(x.get("budget")), "-" if pred is None else f"{pred:.3f}", f"{r.step_s:.3f}",
                       "-" if not pred else f"{r.step_s / pred:.2f}", _fmt_gib(x.get("predicted_device_bytes")),
                       _fmt_gib(x.get("predicted_activation_bytes")),
                       _fmt_gib(x.get("memory", {}).get("device_peak_bytes")))
        console.print(pt)
        console.print("chunk kinds: S/R sharded/replicated, 2/1 ZeRO-2/ZeRO-1, then shard and optimizer placement (D device, H host, "
                      "K disk); the ledger peak is the runtime's own tensors (no activations, no inner-optimizer moments)")
    rt = Table(title="ratios (same invocation)")
    for col in ("ratio", "step time", "predicted", "target", "peak RSS (max rank)", "target ", "met"):
        rt.add_column(col, justify="right")
    for row in ratios(results):
        tt, mt = row["time_target"], row["rss_target"]
        if tt is None and mt is None:
            met = ""
        else:
            ok = (tt is None or row["time"] <= tt) and (mt is None or row["peak_rss"] <= mt + 1e-9)
            met = "yes" if ok else "NO"
        pt = row["predicted_time"]
        rt.add_row(row["ratio"], f"{row['time']:.2f}", "-" if pt is None else f"{pt:.2f}", "-" if tt is None else f"<= {tt}",
                   f"{row['peak_rss']:.2f}",
                   "-" if mt is None else f"<= {mt}", met)
    console.print(rt)
    for line in tight_verdicts(results, over_cap):
        console.print(line)
    console.print(f"bf16 lines reduce gradients in {cfg.bf16_reduce} (elixir, FSDP2, DeepSpeed; DDP autocast: float32)")
    console.print(f"total wall time {wall:.0f} s; load average at end {os.getloadavg()[0]:.1f} "
                  f"(other processes on the box make timings noisy; compare ratios only)")


def tight_verdicts(results: dict[str, LineResult], over_cap: Optional[dict[str, str]] = None) -> list[str]:
    """For each ``elixir-tight`` line: its rank against *every* line of the same model and world
    whose peak RSS per rank stayed under its budget (any system), not only the offload peers;
    the lines over it (``over_cap``: those the cap killed, by line) are named apart."""
    out = []
    over_cap = over_cap or {}
    for r in (x for x in results.values() if x.system == "elixir-tight"):
        budget = r.extra.get("budget")
        if not budget:
            continue
        peers = [x for x in results.values() if x.model == r.model and x.world == r.world and x is not r]
        under = [x for x in peers if max(x.peak_rss) <= budget]
        over = [x.key for x in peers if max(x.peak_rss) > budget]
        over += [k for k in over_cap if parse_line(k)[1:] == (r.world, r.model)]
        faster = [x.key for x in under if x.step_s < r.step_s]
        own = "under" if max(r.peak_rss) <= budget else f"OVER ({max(r.peak_rss) / GiB:.2f} GiB)"
        verdict = (f"slower than {', '.join(faster)}" if faster else
                   f"fastest of {len(under) + 1}: {', '.join([r.key] + [x.key for x in under])}")
        out.append(f"tight budget {_fmt_gib(budget)} GiB per rank: {r.key} peak RSS {own} it; among the lines under it, "
                   f"{verdict}" + (f"; over it (not ranked): {', '.join(over)}" if over else ""))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_LINES), help="lines to run, as system:world[@model]")
    p.add_argument("--steps", type=int, default=BenchConfig.steps, help="timed steps per line")
    p.add_argument("--warmup", type=int, default=BenchConfig.warmup, help="untimed steps per line")
    p.add_argument("--layers", type=int, help="override every model's number of GPT-2 blocks (smoke tests)")
    p.add_argument("--budget", type=float, help="per-rank device budget of elixir-optimal, GiB (default: box memory / ranks)")
    p.add_argument("--tight-budget", type=float, help="per-rank device budget of elixir-tight, GiB")
    p.add_argument("--tight-fraction", type=float, default=BenchConfig.tight_fraction,
                   help="without --tight-budget: this fraction of the way from the least budget any plan fits in to what "
                        "elixir-optimal's plan needs")
    p.add_argument("--seq", type=int, default=BenchConfig.seq, help="sequence length (attention's share grows with it)")
    p.add_argument("--batch", type=int, default=BenchConfig.batch, help="sequences per rank")
    p.add_argument("--attn", choices=("eager", "sdpa"), default="",
                   help="attention implementation of every model (default: transformers' own); with eager, "
                        "elixir-optimal-fused measures use_fused_kernels against elixir-optimal")
    p.add_argument("--json", dest="json_path", help="write all results to this file")
    p.add_argument("--profile-dir", help="write a torch.profiler table of the first timed step of each line here")
    p.add_argument("--timeout", type=float, default=900, help="seconds per line")
    p.add_argument("--line-budget", type=float, default=0.0,
                   help="stop timing a line once its timed steps took this many seconds (at least one timed step; "
                        "0: always --steps); for peers whose bf16 steps take minutes on CPUs without bf16 kernels")
    p.add_argument("--bf16-reduce", choices=("float32", "bfloat16"), default="float32",
                   help="gradient reduction dtype of every bf16 line that can choose it: elixir's (reduce_always_fp32), "
                        "FSDP2's (MixedPrecisionPolicy.reduce_dtype), DeepSpeed's (communication_data_type); DDP's "
                        "autocast reduces fp32 gradients either way (default: float32, FSDP2's usual setting)")
    p.add_argument("--no-rss-cap", action="store_true",
                   help="do not kill the lines that claim the tight budget when a rank's RSS passes it")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="another checkout (with its native extension built) whose lines end #NAME, e.g. "
                        "--tree old=/tmp/old --systems elixir-optimal:2#old elixir-optimal:2: old and new code "
                        "in one invocation")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--profile", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, BenchConfig(**json.loads(args.config)), args.out, args.profile)
        return 0
    gib = lambda x: None if x is None else int(x * GiB)  # noqa: E731
    cfg = BenchConfig(steps=args.steps, warmup=args.warmup, budget=gib(args.budget), tight_budget=gib(args.tight_budget),
                      tight_fraction=args.tight_fraction, attn=args.attn, line_budget=args.line_budget, seq=args.seq, batch=args.batch,
                      bf16_reduce=args.bf16_reduce)
    trees = dict(t.split("=", 1) for t in args.tree)
    for line in args.systems:
        parse_line(line)  # refuse a bad line before running anything
        if split_tree(line)[1]:
            tree_worker(trees, split_tree(line)[1], {})
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[str, LineResult] = {}
    failed: dict[str, str] = {}
    over_cap: dict[str, str] = {}  # lines that do not claim the budget, killed by its cap: ranked out, not failed
    groups = tight_groups(args.systems)
    for line in run_order(args.systems, cfg.tight_budget is not None):
        print(f"running {line} ...", file=sys.stderr, flush=True)
        system, world, model = parse_line(line)
        # the tight budget: given, or the one the elixir-tight line of this model and world ran on
        # (run first in its group); every line of the group runs under it, whatever its system
        cap = cfg.tight_budget or next((x.extra.get("budget") for x in results.values() if x.system == "elixir-tight"
                                        and x.model == model and x.world == world), None)
        cap = cap if (world, model) in groups and not args.no_rss_cap else None
        if cap:
            print(f"  RSS cap {cap / GiB:.2f} GiB per rank (the tight budget)", file=sys.stderr, flush=True)
        try:
            r = run_line(line, cfg, args.layers, args.timeout, args.profile_dir, rss_cap=cap, trees=trees)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # one broken line must not lose the others
            msg = str(e)
            head = msg.splitlines()[0] if msg else ""
            if "RSS passed" in head and not claims_budget(system):
                over_cap[line] = head
                print(f"  {line}: over the cap ({head})", file=sys.stderr, flush=True)
                continue
            failed[line] = head + "\n" + msg[-2000:]
            print(f"  {line} FAILED: {head}\n{msg[-1500:]}", file=sys.stderr, flush=True)
            continue
        if split_tree(line)[1]:
            r.system += "#" + split_tree(line)[1]
        results[r.key] = r
        print(f"  {line}: {r.step_s:.3f} s/step, peak RSS {max(r.peak_rss) / GiB:.2f} GiB", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    if results:
        print_results(results, cfg, wall, over_cap)
    if failed:
        print(f"FAILED lines: {', '.join(failed)}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"config": asdict(cfg), "command": " ".join(sys.argv), "wall_s": wall,
                       "results": {k: asdict(v) for k, v in results.items()}, "ratios": ratios(results),
                       "failed": failed, "over_cap": over_cap, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
