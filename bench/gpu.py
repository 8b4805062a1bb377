"""The GPU bench: elixir against plain torch and FSDP2 on one GPU, in one invocation.

    python bench/gpu.py --out OUTDIR                   # the whole bench, about 9 minutes
    python bench/gpu.py --out OUTDIR --parts capacity --budget-s 540
    python bench/gpu.py --out OUTDIR --tiny            # tiny models, runs on CPU too (a smoke test)

Parts, in order, each with its share of ``--budget-s`` (default 540 s):

1. ``hw``: a quick hardware profile of this machine (``elixir hwprofile --quick`` without the
   collectives and calibration), which the elixir runs plan with; the shipped reference profile
   stands in if it fails.
2. ``step``: step time and peak device memory of a LLaMA-style model of about 1B parameters
   (``--size``, bf16 compute with fp32 master weights and AdamW everywhere): elixir with the plan
   the search makes for the whole GPU (device placement), plain torch (autocast, fused AdamW),
   FSDP2 (``fully_shard`` per decoder layer, world size 1) and elixir with every chunk's shard and
   optimizer state in host memory (``minimum_waste_search(cpu_offload=True)``; HybridAdam steps
   them on the CPU).
3. ``capacity``: with the device capped at ``--cap-gib`` GiB
   (``torch.cuda.set_per_process_memory_fraction``), the largest model each system trains for 3
   steps: elixir (the search's plan for the cap, host memory and disk), FSDP2 with
   ``CPUOffloadPolicy`` and plain torch. Sizes are tried in rounds, smallest first, one rung per
   system per round, until a system fails (OOM, plan does not fit, error or out of time).

Every trial runs in its own subprocess, so an OOM or a crash is contained; its log goes to
``OUTDIR/logs/``. Results are written after every trial (``OUTDIR/gpu_bench.json`` and the
markdown tables in ``OUTDIR/gpu_bench.md``; ``--name`` changes the file name), so a run cut short still leaves its data. The
search's predicted peak memory and step time are set beside the measured ones for every elixir
run that used a searched plan.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GiB = 1 << 30

# name: (hidden, layers, intermediate, heads); head_dim 128 for the real sizes, as in LLaMA
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (64, 2, 128, 4),
    "tiny2": (96, 3, 192, 4),
    "tiny3": (128, 4, 256, 4),
    "0.7B": (1536, 20, 4096, 12),
    "1.1B": (2048, 20, 5504, 16),
    "2.0B": (2560, 24, 6912, 20),
    "3.4B": (3072, 28, 8192, 24),
    "4.9B": (3584, 30, 9728, 28),
    "6.7B": (4096, 32, 11008, 32),
    "9.0B": (4608, 34, 12288, 36),
}
VOCAB = 32000
TINY_VOCAB = 256
LADDERS = {  # capacity: sizes tried per system, smallest first (coarse: a big trial takes minutes)
    "plain": ("1.1B", "2.0B", "3.4B"),
    "fsdp2-offload": ("2.0B", "4.9B", "6.7B", "9.0B"),
    "elixir": ("2.0B", "4.9B", "6.7B", "9.0B"),
}
TINY_LADDERS = {k: ("tiny", "tiny2") for k in LADDERS}
STEP_SYSTEMS = ("elixir", "plain", "fsdp2", "elixir-host")  # the step part's default line-up
ALL_STEP_SYSTEMS = STEP_SYSTEMS + ("fsdp2-offload",)
TARGETS = {"step_vs_plain": 1.05, "capacity_vs_fsdp2_offload": 2.0, "capacity_vs_plain": 5.0,
           "memory_error": 0.15, "time_error": 0.25}


# ---------------------------------------------------------------------------------------------
# the model


def llama_config(size: str, seq: int):
    from transformers import LlamaConfig

    hidden, layers, inter, heads = SIZES[size]
    return LlamaConfig(
        vocab_size=TINY_VOCAB if size.startswith("tiny") else VOCAB, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max(seq, 128), tie_word_embeddings=False,
    )


def param_count(size: str) -> int:
    hidden, layers, inter, heads = SIZES[size]
    vocab = TINY_VOCAB if size.startswith("tiny") else VOCAB
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def build_model(size: str, seq: int, device, seed: int = 0):
    """The model with random weights, built on meta and materialised on ``device`` (no slow
    per-module init; RMSNorm weights 1, everything else N(0, 0.02)). Buffers (rotary frequencies)
    come from a one-layer twin built normally."""
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(size, seq)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    twin_cfg = llama_config(size, seq)
    twin_cfg.hidden_size, twin_cfg.num_attention_heads, twin_cfg.num_key_value_heads = head_dim, 1, 1
    twin_cfg.num_hidden_layers, twin_cfg.intermediate_size, twin_cfg.vocab_size = 1, 8, 8
    if hasattr(twin_cfg, "head_dim"):
        twin_cfg.head_dim = head_dim
    twin_buffers = dict(LlamaForCausalLM(twin_cfg).named_buffers())
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for name, b in model.named_buffers():
            src = twin_buffers.get(re.sub(r"layers\.\d+\.", "layers.0.", name))
            if src is None or src.shape != b.shape:
                raise RuntimeError(f"bench: no value for buffer {name} {tuple(b.shape)}")
            b.copy_(src)
    return model


# ---------------------------------------------------------------------------------------------
# one trial (runs in a subprocess)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_single_rank_group(backend: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(backend=backend)


def _host_budgets(offload_dir: str) -> tuple[int, int]:
    """(host bytes, disk bytes) the elixir search may plan with: 80% of what is free now."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not avail:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    return int(avail * 0.8), int(shutil.disk_usage(offload_dir).free * 0.8)


def run_trial(spec: dict) -> dict:
    """Build ``spec["system"]`` on ``spec["size"]``, train ``warmup + steps`` steps, measure."""
    import torch

    from elixir import device as dev

    device = dev.default_device()
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    out: dict[str, Any] = {"system": spec["system"], "size": spec["size"], "params": param_count(spec["size"]),
                           "device": dev.describe(device)}
    cap = spec.get("cap_bytes")
    if cap and on_gpu:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        out["cap_bytes"] = cap
    batch, seq = spec["batch"], spec["seq"]
    system = spec["system"]
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    ids_host = torch.randint(0, llama_config(spec["size"], seq).vocab_size, (batch, seq), generator=gen)
    ids = ids_host.to(device)
    t0 = time.perf_counter()

    if system in ("plain",):
        model = build_model(spec["size"], seq, device)
        fused = {"fused": True}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)

        def step() -> float:
            with torch.autocast(device.type, dtype=bf16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif system in ("fsdp2", "fsdp2-offload"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _init_single_rank_group("nccl" if on_gpu else "gloo")
        mesh = init_device_mesh(device.type, (1,))
        offload = system == "fsdp2-offload"
        model = build_model(spec["size"], seq, "cpu" if offload else device)
        kw: dict[str, Any] = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)}
        if offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=on_gpu)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        # CPU-offloaded DTensors step with the per-tensor loop; on the GPU with torch's fused kernel
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"foreach": True} if offload else {"fused": True}))

        def step() -> float:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif system in ("elixir", "elixir-host"):
        from elixir.hardware import load_profile
        from elixir.optim import HybridAdam
        from elixir.search import minimum_waste_search, optimal_search
        from elixir.wrapper import ElixirModule, ElixirOptimizer

        model = build_model(spec["size"], seq, "cpu")
        hw = load_profile(spec["hardware"])
        offload_dir = spec.get("offload_dir") or tempfile.gettempdir()
        host, disk = _host_budgets(offload_dir)
        device_budget = cap or dev.device_capacity(device)

        def traced_step(m, inp):
            loss = m(**inp).loss
            loss.backward()
            return loss

        t_search = time.perf_counter()
        inp = {"input_ids": ids_host, "labels": ids_host}
        if system == "elixir-host":  # every shard and every optimizer state in host memory
            plan = minimum_waste_search(model, 1, unified_dtype=bf16, cpu_offload=True, prefetch=True, inp=inp,
                                        step_fn=traced_step)
        else:
            plan = optimal_search(model, 1, unified_dtype=bf16, overlap=True, inp=inp, step_fn=traced_step,
                                  device_memory=device_budget, host_memory=host, disk=disk, hardware=hw)
        out["search_s"] = time.perf_counter() - t_search
        if system == "elixir":
            out["predicted_peak_device_bytes"] = plan.prediction.peak_device_bytes
            out["predicted_step_s"] = plan.prediction.step_time_s
            out["predicted_breakdown"] = plan.prediction.breakdown
        out["plan"] = {
            "chunks": len(plan.chunks), "chunk_size": max((c.chunk_size for c in plan.chunks), default=0),
            "cache_blocks": plan.cache_blocks, "prefetch_depth": plan.prefetch_depth,
            "sharded": sum(c.sharded for c in plan.chunks),
            "placements": sorted({f"{c.shard_placement.value}/{c.optim_placement.value}" for c in plan.chunks}),
        }
        em = ElixirModule(model, plan, prefetch=True, dtype=bf16, offload_dir=offload_dir)
        opt = ElixirOptimizer(em, HybridAdam([p for p in em.parameters() if p.requires_grad], lr=1e-4))

        def step() -> float:
            loss = em(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
    else:
        raise ValueError(f"unknown system {system!r}")

    out["build_s"] = time.perf_counter() - t0
    losses, times = [], []
    total = spec["warmup"] + spec["steps"]
    for i in range(total):
        if i == spec["warmup"]:
            dev.synchronize(device)
            dev.reset_peak_memory(device)
        t = time.perf_counter()
        loss = step()
        dev.synchronize(device)
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        _progress(out, spec, losses, times)
    timed = times[spec["warmup"]:]
    out.update(
        status="ok" if all(map(_finite, losses)) else "non-finite loss",
        losses=losses, step_times=times, step_s=statistics.median(timed) if timed else None,
        peak_device_bytes=dev.max_memory_allocated(device), peak_reserved_bytes=_peak_reserved(device),
        peak_host_rss_bytes=dev.peak_rss_bytes(),
    )
    if system.startswith("elixir"):
        out["elixir_memory"] = em.memory_report()
    return out


def _peak_reserved(device) -> int:
    import torch

    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _progress(out: dict, spec: dict, losses: list, times: list) -> None:
    """Write what the trial has so far, so a timeout still leaves its steps."""
    path = spec.get("result")
    if path:
        _write_json(path, dict(out, status="running", losses=losses, step_times=times))


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def measure_hardware(out_path: str, offload_dir: str) -> dict:
    """A quick measured hardware profile of this machine, written to ``out_path``."""
    from elixir.profiling import MeasureOptions, measure

    prof = measure(MeasureOptions.quick(offload_dir), collective_world=1)
    prof.save(out_path)
    return {"status": "ok", "profile": out_path, "name": prof.name,
            "h2d_pinned_GBps": max(prof.h2d_pinned.bytes_per_s) / 1e9,
            "h2d_pageable_GBps": max(prof.h2d_pageable.bytes_per_s) / 1e9,
            "adam_device_Mparams_per_s": prof.optimizer_params_per_s.get("device", 0) / 1e6,
            "adam_host_Mparams_per_s": prof.optimizer_params_per_s.get("host", 0) / 1e6}


def adam_overlap(spec: dict) -> dict:
    """HybridAdam with parameters on the device and on the host in one step: the device kernels
    are queued first, so the host kernel runs while the device works. Times each side alone and
    both together (medians of 5, after a warm-up) and reports how much of the shorter side hid."""
    import torch

    from elixir import device as dev
    from elixir.optim import HybridAdam

    d = dev.default_device()
    n_dev, n_host = spec["device_params"], spec["host_params"]

    def make(n: int, where) -> list:
        ps = [torch.zeros(n // 8, device=where, requires_grad=True) for _ in range(8)]
        for p in ps:
            p.grad = torch.full_like(p, 1e-3)
        return ps

    on_dev, on_host = make(n_dev, d), make(n_host, "cpu")
    opt = HybridAdam(on_dev + on_host, lr=1e-4)

    def timed(params: list) -> float:
        grads = [p.grad for p in params]
        opt.step_params(params, grads)  # warm-up (creates state)
        times = []
        for _ in range(5):
            dev.synchronize(d)
            t = time.perf_counter()
            opt.step_params(params, grads)
            dev.synchronize(d)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    t_dev, t_host, t_both = timed(on_dev), timed(on_host), timed(on_dev + on_host)
    hidden = (t_dev + t_host - t_both) / max(min(t_dev, t_host), 1e-9)
    return {"system": "adam-overlap", "status": "ok", "device_params": n_dev, "host_params": n_host,
            "device_s": t_dev, "host_s": t_host, "both_s": t_both, "overlap": hidden, "device": dev.describe(d)}


def _child(args: argparse.Namespace) -> int:
    spec = json.loads(args.trial)
    try:
        if spec["system"] == "hwprofile":
            res = measure_hardware(spec["profile_out"], spec["offload_dir"])
        elif spec["system"] == "adam-overlap":
            res = adam_overlap(spec)
        else:
            res = run_trial(spec)
    except BaseException as e:  # noqa: BLE001 - everything goes into the result
        text = traceback.format_exc()
        res = {"system": spec["system"], "size": spec.get("size"), "status": _classify(text), "error": f"{type(e).__name__}: {e}"[:500]}
        print(text, file=sys.stderr, flush=True)
    _write_json(args.result, dict(res, final=True))
    _end_trial()
    return 0


def _end_trial() -> None:
    """End the trial process now that its result is written: destroy a process group it made (an
    NCCL group never destroyed can keep the process from exiting), then leave without running
    the interpreter's teardown (CUDA contexts and backend threads have hung there), so the
    parent never sees a finished trial as a timeout."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the result is written; only the exit is left
        print(f"[trial] destroy_process_group failed: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def settle_result(res: dict, timed_out: bool) -> dict:
    """A trial's result once its process ended or was killed: a result the trial wrote as final
    stands even when the process then hung at exit and was killed (noted in ``exit``); a killed
    trial without one timed out (its partial steps kept)."""
    if timed_out:
        if res.get("final"):
            res["exit"] = "killed after writing its result (hung at exit)"
        else:
            res["status"] = "timeout"
    return res


def _classify(text: str) -> str:
    if "OutOfMemoryError" in text or "out of memory" in text or "ElixirMemoryError" in text:
        return "oom"
    if "DoesNotFitError" in text:
        return "does not fit"
    return "error"


# ---------------------------------------------------------------------------------------------
# the parent: parts, budgets, results


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = os.path.abspath(args.out)
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        self.t_end = time.monotonic() + args.budget_s
        self.offload_dir = tempfile.mkdtemp(prefix="elixir_gpu_bench_")
        self.results: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "device": _describe_device(),
            "hw": None, "step": [], "capacity": [], "notes": [],
        }
        self.hardware = "cpu-box" if args.tiny else "8xH100-80GB"
        self.child_cmd = [sys.executable, os.path.abspath(__file__)]  # a trial: this file with --trial

    def remaining(self) -> float:
        return self.t_end - time.monotonic()

    def save(self) -> None:
        base = os.path.join(self.out, self.args.name)
        _write_json(base + ".json", self.results)
        with open(base + ".md.tmp", "w") as f:
            f.write(render_markdown(self.results))
        os.replace(base + ".md.tmp", base + ".md")

    def trial(self, spec: dict, timeout: float) -> dict:
        name = f"{spec['system']}-{spec.get('size', '')}-{len(os.listdir(os.path.join(self.out, 'logs')))}"
        result = os.path.join(self.out, "logs", name + ".json")
        spec = dict(spec, result=result, offload_dir=self.offload_dir, hardware=self.hardware)
        log = os.path.join(self.out, "logs", name + ".log")
        print(f"[bench] {name}: up to {timeout:.0f} s", flush=True)
        t0 = time.monotonic()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # every system on the same allocator settings: expandable segments, so memory freed on
        # one stream is not held as reserved beside what another stream allocates
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        with open(log, "w") as f:
            proc = subprocess.Popen(self.child_cmd + ["--trial", json.dumps(spec), "--result", result],
                                    stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                proc.wait(timeout=max(1.0, timeout))
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        res: dict[str, Any] = {}
        if os.path.exists(result):
            with open(result) as f:
                res = json.load(f)
        res = settle_result(res, timed_out)
        if not res:
            with open(log) as f:
                tail = f.read()[-4000:]
            res = {"status": _classify(tail) if proc.returncode else "error", "error": f"exit code {proc.returncode}"}
        res.setdefault("system", spec["system"])
        res.setdefault("size", spec.get("size"))
        res["wall_s"] = time.monotonic() - t0
        res["log"] = os.path.relpath(log, self.out)
        print(f"[bench] {name}: {res.get('status')} in {res['wall_s']:.0f} s"
              + (f", step {res['step_s']:.3f} s" if res.get("step_s") else "") + (f" ({res.get('error')})" if res.get("error") else ""),
              flush=True)
        return res

    # ---- parts ----

    def part_hw(self, budget: float) -> None:
        profile = os.path.join(self.out, "hw.json")
        res = self.trial({"system": "hwprofile", "profile_out": profile}, min(budget, self.remaining()))
        self.results["hw"] = res
        if res.get("status") == "ok" and os.path.exists(profile):
            self.hardware = profile
        else:
            self.results["notes"].append(f"hardware profile not measured ({res.get('status')}); planned with {self.hardware}")
        self.save()

    def part_adam(self, budget: float) -> None:
        tiny = self.args.tiny
        spec = {"system": "adam-overlap", "device_params": 1 << (16 if tiny else 30), "host_params": 1 << (12 if tiny else 24)}
        self.results["adam"] = self.trial(spec, min(budget, self.remaining()))
        self.save()

    def part_step(self, budget: float) -> None:
        a = self.args
        end = time.monotonic() + budget
        systems = [x for x in a.systems or STEP_SYSTEMS if x in ALL_STEP_SYSTEMS]
        for i, system in enumerate(systems):
            left = min(end - time.monotonic(), self.remaining())
            if left < 15:
                self.results["step"].append({"system": system, "size": a.size, "status": "skipped: out of time"})
                continue
            share = left / (len(systems) - i)  # what is left, split over the systems still to run
            spec = {"system": system, "size": a.size, "batch": a.batch, "seq": a.seq, "warmup": 2, "steps": a.steps}
            self.results["step"].append(self.trial(spec, max(share, min(left, 90.0))))
            self.save()

    def part_capacity(self, budget: float) -> None:
        a = self.args
        end = time.monotonic() + budget
        cap = int(a.cap_gib * GiB)
        ladders = {k: list(v) for k, v in (TINY_LADDERS if a.tiny else LADDERS).items()
                   if not a.systems or k in a.systems}
        for pair in a.cap_sizes or []:  # one rung: system=size
            system, size = pair.split("=", 1)
            if system in ladders:
                ladders[system] = ["tiny" if a.tiny else size]
        alive = {k: True for k in ladders}
        best: dict[str, Optional[str]] = {k: None for k in ladders}
        for rung in range(max(len(v) for v in ladders.values())):
            for system in [x for x in ("plain", "fsdp2-offload", "elixir") if x in ladders]:
                if not alive[system] or rung >= len(ladders[system]):
                    continue
                left = min(end - time.monotonic(), self.remaining())
                if left < 20:
                    alive[system] = False
                    self.results["capacity"].append({"system": system, "size": ladders[system][rung], "status": "skipped: out of time"})
                    continue
                size = ladders[system][rung]
                spec = {"system": system, "size": size, "batch": a.cap_batch, "seq": a.cap_seq, "warmup": 0, "steps": 3,
                        "cap_bytes": cap}
                res = self.trial(spec, min(left, a.trial_max_s))
                self.results["capacity"].append(res)
                if res.get("status") == "ok":
                    best[system] = size
                else:
                    alive[system] = False
                self.results["capacity_best"] = {k: (v, param_count(v) if v else 0) for k, v in best.items()}
                self.save()

    def run(self) -> None:
        a = self.args
        parts = a.parts
        # budget shares: hw up to 12% (at most 90 s); step and capacity split the rest 40/60
        if a.hardware:
            self.hardware = a.hardware
        elif "hw" in parts:
            self.part_hw(min(60.0, 0.12 * a.budget_s))
        if "adam" in parts:
            self.part_adam(min(45.0, 0.08 * a.budget_s) if len(parts) > 1 else self.remaining())
        rest = self.remaining()
        if "step" in parts:
            self.part_step(rest * (0.45 if "capacity" in parts else 1.0))
        if "capacity" in parts:
            self.part_capacity(self.remaining())
        self.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self.save()
        shutil.rmtree(self.offload_dir, ignore_errors=True)


def _describe_device() -> str:
    try:
        from elixir import device as dev

        return dev.describe()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


# ---------------------------------------------------------------------------------------------
# the report


def _gib(x) -> str:
    return f"{x / GiB:.2f}" if x else "-"


def _pct(pred, meas) -> str:
    return f"{100 * (pred - meas) / meas:+.0f}%" if pred and meas else "-"


def render_markdown(r: dict) -> str:
    lines = [f"# GPU bench, {r['started']}", "", f"Device: {r['device']}", ""]
    a = r["args"]
    hw = r.get("hw") or {}
    if hw.get("status") == "ok":
        lines += [f"Measured: host->device {hw['h2d_pinned_GBps']:.1f} GB/s pinned, {hw['h2d_pageable_GBps']:.1f} GB/s "
                  f"pageable; Adam {hw['adam_device_Mparams_per_s']:.0f} Mparam/s on the device, "
                  f"{hw['adam_host_Mparams_per_s']:.0f} Mparam/s on the host.", ""]
    ad = r.get("adam") or {}
    if ad.get("status") == "ok":
        lines += ["## HybridAdam: the host step under the device step", "",
                  f"{ad['device_params'] / 1e6:.1f}M parameters on the device, {ad['host_params'] / 1e6:.1f}M on the host: "
                  f"device alone {ad['device_s'] * 1e3:.1f} ms, host alone {ad['host_s'] * 1e3:.1f} ms, both in one step "
                  f"{ad['both_s'] * 1e3:.1f} ms: {100 * ad['overlap']:.0f}% of the shorter side hidden.", ""]
    elif ad:
        lines += [f"HybridAdam overlap: {ad.get('status')}", ""]
    step = [s for s in r.get("step", [])]
    if step:
        lines += [f"## Step time, {a['size']} ({param_count(a['size']) / 1e9:.2f}B params), batch {a['batch']} x seq {a['seq']}, "
                  "bf16 compute, fp32 masters, AdamW", "",
                  "| system | step (s) | peak device (GiB) | peak host RSS (GiB) | vs plain | status |", "|---|---|---|---|---|---|"]
        plain = next((s.get("step_s") for s in step if s["system"] == "plain" and s.get("status") == "ok"), None)
        for s in step:
            ratio = f"{s['step_s'] / plain:.2f}x" if plain and s.get("step_s") and s.get("status") == "ok" else "-"
            st = f"{s['step_s']:.3f}" if s.get("step_s") else "-"
            lines.append(f"| {s['system']} | {st} | {_gib(s.get('peak_device_bytes'))} | {_gib(s.get('peak_host_rss_bytes'))} | "
                         f"{ratio} | {s.get('status')} |")
        lines += ["", f"Target: elixir <= {TARGETS['step_vs_plain']}x plain torch.", ""]
    cap = r.get("capacity", [])
    if cap:
        lines += [f"## Capacity with the device capped at {a['cap_gib']} GiB (3 steps, batch {a['cap_batch']} x seq {a['cap_seq']})", "",
                  "| system | largest trained | tried |", "|---|---|---|"]
        best = r.get("capacity_best", {})
        for system in ("elixir", "fsdp2-offload", "plain"):
            tried = ", ".join(f"{c['size']}: {c.get('status')}" for c in cap if c["system"] == system)
            b = best.get(system, (None, 0))
            lines.append(f"| {system} | {b[0] or 'none'} ({b[1] / 1e9:.2f}B) | {tried} |" if b[0] else f"| {system} | none | {tried} |")
        e = best.get("elixir", (None, 0))[1]
        f2 = best.get("fsdp2-offload", (None, 0))[1]
        pl = best.get("plain", (None, 0))[1]
        ratios = ([f"elixir / FSDP2+offload = {e / f2:.2f}x (target >= 2x)"] if f2 else []) + (
            [f"elixir / plain = {e / pl:.2f}x (target >= 5x)"] if pl else [])
        lines += ["", "Ratios: " + "; ".join(ratios) + "." if ratios else "Ratios: not available.", ""]
        lines += ["A trial that ends in `timeout` ran out of the bench's time, not of memory.", ""]
    preds = [s for s in step + cap if s.get("predicted_step_s") and s.get("status") == "ok"]
    if preds:
        lines += ["## The search's predictions against the measurements", "",
                  "| run | predicted peak (GiB) | measured peak (GiB) | error | peak reserved (GiB) | predicted step (s) | measured step (s) | error |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in preds:
            meas_t = s.get("step_s") or (statistics.median(s["step_times"][1:]) if len(s.get("step_times", [])) > 1 else None)
            lines.append(f"| {s['system']} {s['size']}{' (cap)' if s.get('cap_bytes') else ''} | {_gib(s['predicted_peak_device_bytes'])} | "
                         f"{_gib(s.get('peak_device_bytes'))} | {_pct(s['predicted_peak_device_bytes'], s.get('peak_device_bytes'))} | "
                         f"{_gib(s.get('peak_reserved_bytes'))} | "
                         f"{s['predicted_step_s']:.3f} | {meas_t:.3f} | {_pct(s['predicted_step_s'], meas_t)} |" if meas_t else
                         f"| {s['system']} {s['size']} | {_gib(s['predicted_peak_device_bytes'])} | {_gib(s.get('peak_device_bytes'))} | "
                         f"{_pct(s['predicted_peak_device_bytes'], s.get('peak_device_bytes'))} | {_gib(s.get('peak_reserved_bytes'))} | "
                         f"{s['predicted_step_s']:.3f} | - | - |")
        lines += ["", "Targets: memory within 15%, step time within 25%. Measured peak: `torch.cuda.max_memory_allocated` "
                  "over the timed steps (all steps for capacity runs).", ""]
    for n in r.get("notes", []):
        lines.append(f"- {n}")
    if a.get("hardware") or (hw.get("status") == "ok"):
        lines.append(f"- elixir planned with the hardware profile {a.get('hardware') or hw.get('profile')}")
    if not r.get("finished"):
        lines += ["", "(partial: the bench was still running or was cut short)"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output folder (results, tables, logs)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget for everything (default 540)")
    p.add_argument("--parts", nargs="+", default=["hw", "adam", "step", "capacity"], choices=["hw", "adam", "step", "capacity"])
    p.add_argument("--size", default="1.1B", choices=sorted(SIZES), help="model of the step-time part")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4, help="timed steps after 2 warm-up steps (step part)")
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--cap-batch", type=int, default=1)
    p.add_argument("--cap-seq", type=int, default=512)
    p.add_argument("--trial-max-s", type=float, default=150.0, help="longest one capacity trial may run")
    p.add_argument("--name", default="gpu_bench", help="results go to OUT/NAME.json and OUT/NAME.md")
    p.add_argument("--hardware", default=None, help="plan with this hardware profile (skips the hw part)")
    p.add_argument("--systems", nargs="+", default=None, choices=sorted(set(ALL_STEP_SYSTEMS)),
                   help="run only these systems (step and capacity parts; default: each part's line-up)")
    p.add_argument("--cap-sizes", nargs="+", default=None, metavar="SYSTEM=SIZE",
                   help="capacity: one rung, this size per system (e.g. elixir=6.7B plain=1.1B)")
    p.add_argument("--tiny", action="store_true", help="tiny models and short sequences (a smoke test; CPU works)")
    p.add_argument("--trial", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trial:
        return _child(args)
    if not args.out:
        p.error("--out is required")
    for pair in args.cap_sizes or []:
        system, _, size = pair.partition("=")
        if system not in ("plain", "fsdp2-offload", "elixir") or size not in SIZES:
            p.error(f"--cap-sizes {pair!r}: want SYSTEM=SIZE with SYSTEM plain, fsdp2-offload or elixir and SIZE one of {sorted(SIZES)}")
    if args.tiny:
        args.size = args.size if args.size.startswith("tiny") else "tiny"
        args.batch, args.seq, args.cap_seq, args.steps = min(args.batch, 2), min(args.seq, 32), min(args.cap_seq, 32), min(args.steps, 2)
        args.cap_gib = min(args.cap_gib, 1.0)
    bench = Bench(args)
    bench.save()
    bench.run()
    print(f"[bench] results: {os.path.join(bench.out, args.name + '.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
