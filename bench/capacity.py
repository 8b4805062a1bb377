"""The largest LLaMA-style model each system trains on this machine (batch 1, seq 256, 3 steps by default).

Systems: (a) plain torch AdamW fp32, (b) plain torch bf16 autocast, (c) FSDP2 with
``CPUOffloadPolicy``, (d) DeepSpeed ZeRO-3 with NVMe offload (or CPU offload when its async-I/O op
cannot be built; the error is recorded), (e) elixir built on meta with ``optimal_search`` placing
every chunk (disk included). The LoRA line (rank 8 on every attention and MLP projection, the base
frozen in bf16, adapters fp32): (f) plain PEFT on torch, (g) PEFT under FSDP2 with
``CPUOffloadPolicy`` (bf16 all-gathers), (h) elixir: PEFT built on meta, frozen chunks in bf16 (or,
with ``--frozen nf4|int8``, stored quantised: ``MixedPrecisionPolicy.frozen``, issue 33) with no
gradient, master or optimizer state, ``optimal_search`` placing them (disk included: read for
each gather, never written back). A size passes when 3 steps finish with finite, falling losses under
the memory cap. Sizes come from a ladder of LLaMA configs; each system's largest passing rung is
found by bisection (training memory grows with the rung).

Every trial runs in its own process, watched by this one: when the trial's resident memory passes
``--mem-cap`` it is killed (an OOM fails cleanly instead of taking the box down). Free disk is
checked first; each trial's offload directory is removed after it. Prints a rich table: largest
size, step time, peak RSS, disk bytes read and written per step, and what stopped the next rung.

    python bench/capacity.py                       # all systems, the full ladder (long: hours)
    python bench/capacity.py --tiny --systems a,e  # a smoke test at toy sizes (a minute)
    python bench/capacity.py --systems e --master bf16-sr --moments int8  # (e) with low-precision state
                                                   # (issue 33: 4 B/param on disk instead of 12)
    python bench/capacity.py --systems h --frozen nf4 --seq 64 --rungs 20 --plan-only  # (h)'s plan
                                                   # for a 64.9B NF4 base, on meta (seconds; nothing trained)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

from rss_cap import tree_rss  # bench/rss_cap.py: the RSS cap step_time.py enforces too

from elixir.plan.state_format import FROZEN_FORMATS, MASTER_FORMATS, MOMENT_FORMATS

SYSTEMS = {
    "a": "torch fp32 AdamW",
    "b": "torch bf16 autocast",
    "c": "FSDP2 CPUOffloadPolicy",
    "d": "DeepSpeed ZeRO-3 offload",
    "e": "elixir (meta, optimal_search)",
    "f": "LoRA: PEFT on torch",
    "g": "LoRA: PEFT + FSDP2 CPUOffloadPolicy",
    "h": "LoRA: elixir (meta, frozen chunks)",
}
LORA_SYSTEMS = {"f", "g", "h"}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (hidden, layers): parameters grow roughly 12 * hidden^2 * layers
LADDER = [(1024, 8), (1536, 12), (1792, 14), (2048, 16), (2048, 22), (2304, 22), (2560, 24), (2816, 24),
          (3072, 26), (3328, 26), (3584, 28), (3840, 28), (4096, 30), (4096, 36), (5120, 36), (5120, 44),
          (6144, 44), (6656, 52), (7168, 56), (8192, 60), (8192, 80), (9216, 80)]  # 165M .. 82.1B, ~1.2-1.4x per rung
TINY = [(64, 1), (64, 2), (128, 2), (128, 4)]
GIB = 2**30
SHAPE = (1, 256)  # (batch, seq): the default trial
FP32_STATE = ("fp32", "fp32")  # (master, moments): MixedPrecisionPolicy's defaults


def llama_config(hidden: int, layers: int, vocab: int = 32000):
    from transformers import LlamaConfig

    heads = max(1, hidden // 128)
    return LlamaConfig(hidden_size=hidden, intermediate_size=max(64, int(hidden * 8 / 3) // 64 * 64),
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       vocab_size=vocab, max_position_embeddings=1024, tie_word_embeddings=False)


def n_params(hidden: int, layers: int, vocab: int) -> int:
    inter = max(64, int(hidden * 8 / 3) // 64 * 64)
    return layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + 2 * vocab * hidden + hidden


# --------------------------------------------------------------------------------------------
# one trial (in its own process)


def _vm_hwm() -> int:
    """This process's peak resident bytes (VmHWM; ru_maxrss would include the parent's at fork)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])


def _written(b: dict, params: int) -> str:
    """The disk-written cell: the process's counter, and elixir's stores' own count where they wrote."""
    cell = f"{b['written_per_step'] / GIB:.2f} GiB ({b['written_per_step'] / params:.3f} B/param)"
    own = b.get("store_written_per_step", 0)
    return cell + (f"; stores: {own / params:.3f} B/param" if own else "")


def _store_written(model) -> int:
    """Bytes elixir's offload stores wrote so far (their own count; 0 for the other systems): the
    ``/proc`` counter above takes in every write of the process."""
    stores = [getattr(model, k, None) for k in ("disk_store", "shard_store")]
    return sum(st.bytes_written for st in stores if st is not None)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    # adapters in fp32 over the bf16 base (PEFT's autocast_adapter_dtype), as PEFT recommends
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS))


def _build_lora(system: str, cfg, offload: str, mem_cap: int, frozen: Optional[str] = None,
                shape: tuple[int, int] = SHAPE):
    import torch
    from transformers import AutoModelForCausalLM

    lr = 1e-3
    if system == "f":
        model = _lora(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)).train()
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=True)
    if system == "g":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        dist.init_process_group("gloo", rank=0, world_size=1)
        with torch.device("meta"):
            model = _lora(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)).train()
        mesh = init_device_mesh("cpu", (1,))
        kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.to_empty(device="cpu")
        model.get_base_model().initialize_weights()  # weights and buffers (rotary inv_freq), as system c
        with torch.no_grad():  # the adapters as PEFT starts them: lora_B zero
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.to_local().zero_() if "lora_B" in n else p.to_local().normal_(0.0, 0.02)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    if system == "h":
        from elixir.wrapper import ElixirModule, ElixirOptimizer

        model, plan, policy = _plan_lora_elixir(cfg, offload, mem_cap, frozen, shape)
        em = ElixirModule(model, plan, offload_dir=offload, mp_policy=policy)
        return em, ElixirOptimizer(em, torch.optim.AdamW([p for p in em.parameters() if p.requires_grad], lr=lr))
    raise ValueError(system)


def _traced_step(shape: tuple[int, int]):
    """The batch (``shape``: batch x seq, as the trial trains on) and the step the search traces."""
    import torch

    batch = {"input_ids": torch.zeros(*shape, dtype=torch.long)}

    def step_fn(m, b):
        loss = m(input_ids=b["input_ids"], labels=b["input_ids"]).loss
        loss.backward()
        return loss

    return batch, step_fn


def _plan_lora_elixir(cfg, offload: str, mem_cap: int, frozen: Optional[str], shape: tuple[int, int]):
    """System (h)'s model (PEFT on meta) and plan: ``optimal_search`` with the cap as the one
    memory pool and the free disk (the search keeps its own margin, ``MemoryPolicy.disk_margin``),
    given the ``MixedPrecisionPolicy`` the run trains with, so it prices the frozen base in the
    format the policy stores it in (``frozen``: None for bf16, ``"nf4"`` or ``"int8"``) and the
    plan records it. The frozen shards may stream from disk (read per gather, never written back)."""
    import torch
    from transformers import AutoModelForCausalLM

    from elixir.search import optimal_search
    from elixir.wrapper.policies import MixedPrecisionPolicy

    with torch.device("meta"):
        model = _lora(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)).train()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, frozen=frozen)
    batch, step_fn = _traced_step(shape)
    plan = optimal_search(model, 1, unified_dtype=torch.bfloat16, optimizer_type="AdamW", inp=batch,
                          step_fn=step_fn, device_memory=mem_cap, host_memory=mem_cap,
                          disk=shutil.disk_usage(offload).free, mp_policy=policy)
    figures = _lora_plan_figures(plan, frozen)
    print(json.dumps({"note": _lora_plan_note(figures), "plan": figures}), flush=True)
    _print_predicted_peak(plan)
    return model, plan, policy


def _placements(chunks) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in chunks:
        out[c.shard_placement.value] = out.get(c.shard_placement.value, 0) + 1
    return out


def _lora_plan_figures(plan, frozen: Optional[str]) -> dict:
    """System (h)'s plan in numbers: its chunks and where they are, the frozen shards' bytes (the
    library's rule, ``frozen_shard_bytes``: the runtime books by it) and the search's predictions."""
    from elixir.plan.state_format import frozen_shard_bytes

    fbytes = [frozen_shard_bytes(frozen, c.shard_size(plan.world_size), 2) for c in plan.frozen_chunks]
    on_disk = sum(b for b, c in zip(fbytes, plan.frozen_chunks) if c.shard_placement.value == "disk")
    numel = sum(math.prod(s) for c in plan.frozen_chunks for s in c.shapes)
    p = plan.prediction
    return {"frozen_format": plan.frozen_format or "bf16", "frozen_chunks": len(plan.frozen_chunks),
            "frozen_chunk_size": plan.frozen_chunks[0].chunk_size if plan.frozen_chunks else 0,
            "frozen_placements": _placements(plan.frozen_chunks), "trainable_chunks": len(plan.chunks),
            "trainable_placements": _placements(plan.chunks), "cache_blocks": plan.cache_blocks,
            "frozen_params": numel, "frozen_bytes": sum(fbytes), "frozen_disk_bytes": on_disk,
            "frozen_bytes_per_param": sum(fbytes) / max(1, numel),
            "predicted_peak": p.peak_device_bytes + p.peak_host_bytes, "predicted_disk": p.peak_disk_bytes,
            "predicted_step_s": p.step_time_s, "breakdown": p.breakdown}


def _lora_plan_note(f: dict) -> str:
    return (f"plan: {f['frozen_chunks']} frozen chunks ({f['frozen_format']}) of {f['frozen_chunk_size']:,} el on "
            f"{f['frozen_placements']}, {f['frozen_bytes_per_param']:.3f} B/frozen param "
            f"({f['frozen_disk_bytes'] / GIB:.1f} GiB on disk), {f['trainable_chunks']} trainable chunks on "
            f"{f['trainable_placements']}, {f['cache_blocks']} cache blocks, predicted peak "
            f"{f['predicted_peak'] / GIB:.2f} GiB (+{f['predicted_disk'] / GIB:.1f} GiB disk), step "
            f"{f['predicted_step_s']:.1f} s")


def deepspeed_config(cfg, offload: str, where: str = "nvme") -> dict:
    """System (d)'s DeepSpeed config: ZeRO-3 with parameters and optimizer state on NVMe, and every
    RAM buffer that a setting sizes fitted to this model instead of to a big GPU box.

    ``largest`` (P) is the largest tensor: the embedding, vocab x hidden (the untied lm_head is as
    large). Peak RSS measured at 165M, 438M, 651M and 564M (h1024 x 40 layers), with
    ``DEEPSPEED_MALLOC_ENV``, is 0.51 GB + 2 B/param + 36 B x P + 12.4 kB x hidden x layers
    (activations at seq 256); with the 2 B/param fixed, the fit misses no point by 0.1 MB. The
    2 B/param is the whole-model bf16 gradient buffer (no setting removes it, see
    ``_build_deepspeed``); the P term is the swap buffers and the first step's moments of the
    largest tile. DeepSpeed's defaults (fp32) hold 2 GB of fixed parameter swap buffers plus about
    36 B/param (sub-group buffers 16, first-step moments 8, weights kept in RAM 4, gradient buffer
    4, reduce bucket 4): over 14 GiB at 438M.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        largest = max(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    cpu = where == "cpu"
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},  # DeepSpeedCPUAdam once offloaded
        # bf16 weights and gradients with fp32 masters and moments in the optimizer, the precision
        # (e) trains in; in fp32 DeepSpeed would keep two fp32 copies (the "fp16" one and the master)
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            # 1: every tensor is its own optimizer tile, so the NVMe optimizer swapper's buffers (4
            # page-locked fp32 buffers of the largest tile) are 16 P bytes. The default, 1e9
            # elements, puts any model under 1B in one tile: 16 B/param locked, plus 8 B/param of
            # Adam moments that the first step creates for the whole tile
            "sub_group_size": 1,
            # gradients are reduced through one contiguous bucket; the largest gradient sets its
            # size (default 5e8 elements: 2 GB allocated in fp32, touched as it fills)
            "reduce_bucket_size": largest,
            # release a parameter right after its module runs; the default (1e9) keeps every
            # parameter that is used again within 1e9 elements, i.e. whole models gathered from the
            # forward until their backward, each holding a parameter swap buffer
            "stage3_max_reuse_distance": 0,
            # bound only the all-gather prefetch of parameters kept in RAM (norms, tensors under
            # 1 MB); NVMe parameters are prefetched into the free parameter swap buffers below
            "stage3_max_live_parameters": largest,
            "stage3_prefetch_bucket_size": largest,
            "offload_param": ({"device": "cpu", "pin_memory": False} if cpu else {
                "device": "nvme", "nvme_path": offload,
                # every parameter on NVMe; the default (1e9 elements) keeps the first 1e9 in RAM:
                # "nvme" offload of any model under 1B then holds all its weights in RAM
                "max_in_cpu": 0,
                # a swap buffer holds one parameter partition, so it must fit the largest (the
                # default, 1e8 elements, is too small past hidden 3125, and 5 x 1e8 x 4 B = 2 GB
                # page-locked in fp32 at any model size)
                "buffer_size": largest,
                # transformers' ZeRO-3 init gathers an attention block's q, k, v and o projections
                # together: 4 is the fewest it runs with (3: "Not enough buffers 3 for swapping 4")
                "buffer_count": 4,
                # no effect on the CPU accelerator (pinning is a no-op; DeepSpeed's aio op locks
                # its own swap buffers); off, as its docs advise for small resident RAM
                "pin_memory": False,
            }),
            "offload_optimizer": ({"device": "cpu", "pin_memory": False} if cpu else {
                "device": "nvme", "nvme_path": offload,
                # Adam swaps 4 tensors per tile (master, gradient, 2 moments): DeepSpeed's minimum
                "buffer_count": 4,
                "pin_memory": False,  # as above
                # pipelined reads/writes overlap the next tile's I/O with this tile's Adam but
                # need a second set of tile buffers; fast_init reserves every parameter buffer
                "pipeline_read": False, "pipeline_write": False, "fast_init": False,
            }),
        },
        # DeepSpeed's defaults: 1 MB blocks (also the smallest tensor it swaps; smaller ones stay in
        # RAM), 8 requests in flight, one I/O thread per request (this box has 2 cores), events
        # overlapped; they set speed, not RAM (a few MB)
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
    }


def _build_deepspeed(cfg, offload: str):
    """System (d). The model is built the way transformers documents for ZeRO-3: with an
    ``HfDeepSpeedConfig`` alive, ``from_config`` constructs it under ``deepspeed.zero.Init`` (each
    parameter partitioned and offloaded as it is created) and then runs ``_init_weights`` on each
    module with its parameters gathered, as every other system initialises. Entering
    ``zero.Init`` by hand instead leaves torch's default initialisation (measured: embedding std
    1.0, projections 0.036, against 0.02 from ``initializer_range``).

    Not configurable: ZeRO-3 allocates one flat gradient buffer over every parameter partition,
    in the gradient-accumulation dtype (``grad_partitions_flat_buffer`` in
    ``DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer``, deepspeed/runtime/zero/stage3.py,
    0.19.8), and keeps it in RAM for the whole run whatever is offloaded: 2 B/param in bf16, the
    term that bounds (d)'s size.
    """
    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    where = "nvme"
    if not AsyncIOBuilder().is_compatible():  # the op cannot build here (libaio missing): CPU offload
        where = "cpu"
        print(json.dumps({"note": "NVMe offload unavailable (DeepSpeed's async_io op cannot build: libaio's "
                                  "io_submit not found); CPU offload"}), flush=True)
    ds = deepspeed_config(cfg, offload, where)
    hf_ds = HfDeepSpeedConfig(ds)  # transformers holds it by weakref: kept alive on the engine
    model = AutoModelForCausalLM.from_config(cfg).train()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    engine.hf_deepspeed_config = hf_ds
    print(json.dumps({"note": f"DeepSpeed ZeRO-3 bf16, parameters and optimizer offloaded to {where}"}), flush=True)
    return engine, ("deepspeed", where)


def _build(system: str, cfg, offload: str, mem_cap: int, formats: tuple[str, str] = FP32_STATE,
           frozen: Optional[str] = None, shape: tuple[int, int] = SHAPE):
    """The model and optimizer of ``system``; elixir's (e, h) planned for batches of ``shape``
    (batch, seq), (e)'s state in ``formats``, (h)'s frozen base stored in ``frozen``."""
    import torch
    from transformers import AutoModelForCausalLM

    if system in LORA_SYSTEMS:
        return _build_lora(system, cfg, offload, mem_cap, frozen, shape)

    if system in ("a", "b"):
        model = AutoModelForCausalLM.from_config(cfg).train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if system == "c":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        dist.init_process_group("gloo", rank=0, world_size=1)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg).train()
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        model.to_empty(device="cpu")
        model.initialize_weights()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    if system == "d":
        return _build_deepspeed(cfg, offload)
    if system == "e":
        return _build_elixir(cfg, offload, mem_cap, formats, shape)
    raise ValueError(system)


def _build_elixir(cfg, offload: str, mem_cap: int, formats: tuple[str, str], shape: tuple[int, int] = SHAPE):
    """System (e): built on meta, ``optimal_search`` places every chunk (disk included); bf16
    chunks, HybridAdam, the optimizer state in ``formats`` (master, moments)."""
    import torch

    from elixir.optim import HybridAdam
    from elixir.wrapper import ElixirModule, ElixirOptimizer
    from elixir.wrapper.policies import MixedPrecisionPolicy

    model, plan = _plan_elixir(cfg, offload, mem_cap, formats, shape)
    em = ElixirModule(model, plan, offload_dir=offload,
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, master=formats[0], moments=formats[1]))
    return em, ElixirOptimizer(em, HybridAdam(em.parameters(), lr=1e-4))


def _plan_elixir(cfg, offload: str, mem_cap: int, formats: tuple[str, str], shape: tuple[int, int]):
    """System (e)'s model (on meta) and plan."""
    import torch
    from transformers import AutoModelForCausalLM

    from elixir.search import optimal_search

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg).train()
    batch, step_fn = _traced_step(shape)
    disk = shutil.disk_usage(offload).free
    # bf16 chunks with fp32 masters (mixed precision, as (b) computes) unless --master/--moments ask
    # for low-precision state; on a CPU box device and host are one pool, so the cap budgets both;
    # the search may put any chunk's state on disk, all the free space but its own margin
    # (MemoryPolicy.disk_margin); the search prices the state in `formats` (bytes on device, host
    # and disk, and its Adam kernel's rate) and records them in the plan
    plan = optimal_search(model, 1, unified_dtype=torch.bfloat16, optimizer_type="HybridAdam", inp=batch,
                          step_fn=step_fn, device_memory=mem_cap, host_memory=mem_cap, disk=disk,
                          master=formats[0], moments=formats[1])
    kinds: dict[str, int] = {}
    for c in plan.chunks:
        key = f"{'shard' if c.sharded else 'repl'}:{c.shard_placement.value}/opt:{c.optim_placement.value}"
        kinds[key] = kinds.get(key, 0) + 1
    print(json.dumps({"note": f"plan: {plan.chunk_size:,} el/chunk, {kinds}, grads {plan.grad_dtype}, "
                              f"fused step {plan.fused_step}, state {_formats_label(formats)}, predicted peak "
                              f"{(plan.prediction.peak_device_bytes + plan.prediction.peak_host_bytes) / GIB:.2f} GiB "
                              f"(+{plan.prediction.peak_disk_bytes / GIB:.1f} GiB disk), step "
                              f"{plan.prediction.step_time_s:.1f} s"}), flush=True)
    _print_predicted_peak(plan)
    return model, plan


def _print_predicted_peak(plan) -> None:
    """The plan's predicted peak (device + host: one pool on a CPU box), for the driver to set
    beside the trial's measured peak (issue 21: measured <= predicted, within 10%)."""
    print(json.dumps({"predicted_peak": plan.prediction.peak_device_bytes + plan.prediction.peak_host_bytes}), flush=True)


def plan_trial(system: str, hidden: int, layers: int, vocab: int, shape: tuple[int, int], offload: str,
               mem_cap: int, formats: tuple[str, str] = FP32_STATE, frozen: Optional[str] = None) -> dict:
    """``--plan-only``: elixir's plan for the rung, made exactly as its trial makes it (same process
    kind, same call), printed; nothing is materialised or trained."""
    import torch

    torch.manual_seed(0)
    cfg = llama_config(hidden, layers, vocab)
    t0 = time.perf_counter()
    if system == "e":
        _plan_elixir(cfg, offload, mem_cap, formats, shape)
    elif system == "h":
        _plan_lora_elixir(cfg, offload, mem_cap, frozen, shape)
    else:
        raise ValueError(f"--plan-only plans elixir's systems (e, h) only, not {system!r}")
    return {"ok": True, "planned_only": True, "plan_s": time.perf_counter() - t0, "peak_rss": _vm_hwm(),
            "reason": "", "losses": []}


def trial(system: str, hidden: int, layers: int, vocab: int, seq: int, steps: int, offload: str, mem_cap: int,
          formats: tuple[str, str] = FP32_STATE, frozen: Optional[str] = None, batch: int = 1) -> dict:
    import torch

    torch.manual_seed(0)
    cfg = llama_config(hidden, layers, vocab)
    t0 = time.perf_counter()
    model, opt = _build(system, cfg, offload, mem_cap, formats, frozen, (batch, seq))
    build_s = time.perf_counter() - t0
    build_peak, step_peaks = _vm_hwm(), []  # where the peak comes from: the build or which step
    ids = torch.randint(0, vocab, (batch, seq))
    losses, times, io, by_store = [], [], [], []
    for _ in range(steps):
        r0, w0 = _io()
        s0 = _store_written(model)
        t0 = time.perf_counter()
        if isinstance(opt, tuple):  # DeepSpeed's engine steps itself
            loss = model(input_ids=ids, labels=ids).loss
            model.backward(loss)
            model.step()
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=system == "b"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
        r1, w1 = _io()
        io.append((r1 - r0, w1 - w0))
        by_store.append(_store_written(model) - s0)
        losses.append(float(loss))
        step_peaks.append(_vm_hwm())
    ok = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    later = io[1:] or io
    return {
        "ok": ok, "losses": losses, "step_s": sum(times[1:]) / max(1, len(times) - 1), "build_s": build_s,
        "steps_s": times,
        "peak_rss": _vm_hwm(), "peak_rss_build": build_peak, "peak_rss_after_step": step_peaks,
        "read_per_step": sum(r for r, _ in later) // len(later), "written_per_step": sum(w for _, w in later) // len(later),
        "store_written_per_step": sum(by_store[1:] or by_store) // len(by_store[1:] or by_store),
        "reason": "" if ok else f"losses not finite and falling: {losses}",
    }


# --------------------------------------------------------------------------------------------
# the driver


OFFLOADS_TO_DISK = {"d", "e", "h"}


def _exception_line(stderr: str) -> str:
    """The exception a trial died of: the last unindented line of its traceback."""
    lines = [ln for ln in stderr.strip().splitlines() if ln and not ln[0].isspace() and not ln.startswith("[")]
    return lines[-1] if lines else "(no output)"


def _drop_build_locks(since: float) -> None:
    """Remove torch JIT-extension build locks left by a trial killed mid-build (DeepSpeed's ops):
    torch's file baton would make every later trial wait on them forever."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    started = time.time() - (time.monotonic() - since)
    for dirpath, _, files in os.walk(root):
        if "lock" in files and os.path.getmtime(os.path.join(dirpath, "lock")) >= started:
            os.remove(os.path.join(dirpath, "lock"))


def _formats_label(formats: tuple[str, str]) -> str:
    """``master/moments`` and the bytes per parameter they keep on disk (the footprint rule)."""
    from elixir.plan import disk_bytes_per_element

    return f"{formats[0]}/{formats[1]}, {disk_bytes_per_element(formats=formats)} B/param on disk"


# LoRA's elixir (h) packs its frozen weights greedily, in use order, into chunks as large as the
# largest frozen tensor (the embedding, or the untied lm_head): the pre-check bounds the padding at
# 1.5x the weights (its plans: 1.30x at 20.3B in bf16)
FROZEN_PADDING = 1.5


def _disk_need(rung: tuple[int, int], vocab: int, system: str = "e", formats: tuple[str, str] = FP32_STATE,
               frozen: Optional[str] = None) -> int:
    """The most offload space a rung can take: elixir (e) keeps the master and Adam moments in
    ``formats``, at the footprint rule's bytes (``disk_bytes_per_element``: fp32/fp32 12 B/param,
    bf16-sr/int8 4; a chunk whose shard is on disk too derives it from the master, so no
    compute-dtype copy; its search checks the exact need, padding included, against the free disk
    less its own margin); the other systems 16 B/param;
    DeepSpeed (d) also swaps fp32 gradients out (measured: 18.0 B/param of swap files); LoRA's
    elixir (h) only its frozen weights, in ``frozen``'s format at the library's rule
    (``frozen_element_bytes``: bf16 2 B/param, NF4 0.516, int8 1.06), in chunks padded to the
    largest frozen tensor (:data:`FROZEN_PADDING`; the search planned 2.6 B/param at 20.3B in bf16)."""
    if system == "e":
        from elixir.plan import disk_bytes_per_element

        return disk_bytes_per_element(formats=formats) * n_params(*rung, vocab)
    if system == "h":
        from elixir.plan.state_format import frozen_element_bytes

        return int(FROZEN_PADDING * frozen_element_bytes(frozen, 2) * n_params(*rung, vocab))
    return {"d": 18}.get(system, 16) * n_params(*rung, vocab)


# glibc raises its mmap threshold to the size of each large block freed (up to 32 MB), after which
# such buffers come from the heap and the holes they leave stay resident. DeepSpeed's build and
# step interleave short-lived tensor-sized buffers with long-lived ones, the pattern elixir trims
# itself (elixir.device.trim_host_memory); a fixed threshold returns them instead: at 438M (d)'s
# peak was 4.45 GB without it, 3.37 GB with it. Set in (d)'s trial process only.
DEEPSPEED_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def run_trial(args, system: str, rung: tuple[int, int]) -> dict:
    free = shutil.disk_usage(args.offload_dir).free
    need = _disk_need(rung, args.vocab, system, _formats(args), args.frozen)
    if system in OFFLOADS_TO_DISK and free < need and not args.plan_only:
        return {"ok": False, "peak_rss": 0, "reason": f"not run: {args.offload_dir} has {free / GIB:.1f} GiB free, "
                f"the rung may need {need / GIB:.1f} GiB of offload space"}
    offload = tempfile.mkdtemp(prefix=f"capacity-{system}-", dir=args.offload_dir)
    cmd = [sys.executable, os.path.abspath(__file__), "--trial", system, "--rung", f"{rung[0]}x{rung[1]}",
           "--vocab", str(args.vocab), "--seq", str(args.seq), "--steps", str(args.steps),
           "--trial-dir", offload, "--mem-cap", str(args.mem_cap), "--master", args.master, "--moments", args.moments,
           "--batch", str(args.batch), *(["--frozen", args.frozen] if args.frozen else []),
           *(["--plan-only"] if args.plan_only else [])]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               **(DEEPSPEED_MALLOC_ENV if system == "d" else {}))
    peak, killed = 0, False
    t0 = time.monotonic()
    log = os.path.join(args.log_dir, f"{system}-h{rung[0]}-L{rung[1]}")
    try:
        # to files, not pipes: a chatty trial (DeepSpeed) fills a pipe nobody reads and blocks
        with open(log + ".out", "w") as fo, open(log + ".err", "w") as fe:
            proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, env=env, start_new_session=True)
        while proc.poll() is None:
            rss = tree_rss(proc.pid)
            peak = max(peak, rss)
            if rss > args.mem_cap * GIB or time.monotonic() - t0 > args.timeout:
                killed = "memory" if rss > args.mem_cap * GIB else "timeout"
                os.killpg(proc.pid, 9)
                break
            time.sleep(0.2)
        proc.wait()
    finally:
        shutil.rmtree(offload, ignore_errors=True)
    with open(log + ".out") as fo, open(log + ".err") as fe:
        out, err = fo.read(), fe.read()
    result, notes, predicted, plan = None, [], None, None
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if "note" in d:
                notes.append(d["note"])
                plan = d.get("plan", plan)
            elif "predicted_peak" in d:
                predicted = d["predicted_peak"]
            else:
                result = d
    if killed:
        _drop_build_locks(since=t0)
        return {"ok": False, "reason": (f"killed: RSS passed the {args.mem_cap:g} GiB cap" if killed == "memory"
                else f"killed after {args.timeout:g} s") + f" (log: {log}.err)", "peak_rss": peak,
                "predicted_peak": predicted, "notes": notes}
    if result is None:
        return {"ok": False, "reason": _exception_line(err)[:300] + f" (log: {log}.err)", "peak_rss": peak, "notes": notes,
                "predicted_peak": predicted}
    result.update(notes=notes, predicted_peak=predicted, plan=plan, disk_need=need, disk_free=free)
    return result


def _against_prediction(r: dict) -> str:
    """``measured / predicted`` peak of a trial whose plan predicted one (elixir's), else ""."""
    pred, peak = r.get("predicted_peak"), r.get("peak_rss", 0)
    if not pred or not peak:
        return ""
    return f"{peak / GIB:.2f} / {pred / GIB:.2f} GiB = {peak / pred:.3f}"


def search(args, system: str, ladder: list) -> dict:
    lo, hi, best, fail = 0, len(ladder) - 1, None, None
    while lo <= hi:
        mid = (lo + hi) // 2
        r = run_trial(args, system, ladder[mid])
        r["rung"] = ladder[mid]
        vs = _against_prediction(r)
        print(f"  {SYSTEMS[system]}: {ladder[mid]} -> {'ok' if r['ok'] else 'FAIL: ' + r['reason']}"
              + (f" (peak RSS measured / predicted: {vs})" if vs else ""), flush=True)
        if r["ok"]:
            best, lo = r, mid + 1
        else:
            fail, hi = r, mid - 1
    return {"best": best, "first_fail": fail}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="a,b,c,d,e")
    p.add_argument("--tiny", action="store_true", help="toy sizes (a smoke test)")
    p.add_argument("--mem-cap", type=float, default=None, help="GiB (default: 90%% of this machine's RAM)")
    p.add_argument("--offload-dir", default=tempfile.gettempdir())
    p.add_argument("--batch", type=int, default=SHAPE[0], help="sequences per step (default %(default)s)")
    p.add_argument("--seq", type=int, default=SHAPE[1], help="tokens per sequence (default %(default)s)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per trial")
    p.add_argument("--rungs", help="bisect over these ladder indices only (comma-separated, e.g. 2,3,4), "
                   "to bound a system you already know roughly; default: the whole ladder")
    p.add_argument("--master", default="fp32", choices=MASTER_FORMATS,
                   help="elixir (e)'s master format (MixedPrecisionPolicy.master; default fp32)")
    p.add_argument("--moments", default="fp32", choices=MOMENT_FORMATS,
                   help="elixir (e)'s Adam moment format (MixedPrecisionPolicy.moments; default fp32)")
    p.add_argument("--frozen", default=None, choices=[f for f in FROZEN_FORMATS if f],
                   help="LoRA elixir (h)'s frozen base format (MixedPrecisionPolicy.frozen; default: bf16, unquantised)")
    p.add_argument("--plan-only", action="store_true",
                   help="elixir's systems (e, h): plan every given rung on meta, as its trial would, and print "
                   "the plan; nothing is materialised or trained")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--log-dir", default=None, help="each trial's stdout/stderr (default: a new temporary directory)")
    p.add_argument("--trial", help=argparse.SUPPRESS)
    p.add_argument("--rung", help=argparse.SUPPRESS)
    p.add_argument("--trial-dir", help=argparse.SUPPRESS)
    return p


def _trial_here(args) -> None:
    """The trial process: one rung of one system, its result as the last JSON line."""
    h, layers = (int(x) for x in args.rung.split("x"))
    cap = int(args.mem_cap * GIB)
    if args.plan_only:
        r = plan_trial(args.trial, h, layers, args.vocab, (args.batch, args.seq), args.trial_dir, cap, _formats(args),
                       args.frozen)
    else:
        r = trial(args.trial, h, layers, args.vocab, args.seq, args.steps, args.trial_dir, cap, _formats(args),
                  args.frozen, args.batch)
    print(json.dumps(r), flush=True)


def plan_rungs(args, system: str, ladder: list) -> dict:
    """``--plan-only``: each rung's plan (no bisection: nothing is trained, so nothing passes)."""
    out = []
    for rung in ladder:
        need, free = _disk_need(rung, args.vocab, system, _formats(args), args.frozen), shutil.disk_usage(args.offload_dir).free
        r = run_trial(args, system, rung)
        r.update(rung=rung, disk_need=need, disk_free=free)
        print(f"  {SYSTEMS[system]}: {rung} ({_count(n_params(*rung, args.vocab))}): "
              + ("; ".join(r.get("notes", [])) or "FAIL: " + r["reason"])
              + f"; the trial's disk pre-check: {need / GIB:.1f} GiB, {free / GIB:.1f} GiB free", flush=True)
        out.append(r)
    return {"plans": out}


def main() -> None:
    args = _parser().parse_args()
    if args.mem_cap is None:
        args.mem_cap = 0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    if args.trial:
        _trial_here(args)
        return
    ladder = TINY if args.tiny else LADDER
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="capacity-logs-")
    os.makedirs(args.log_dir, exist_ok=True)
    print(f"trial logs: {args.log_dir}", flush=True)
    if args.rungs:
        try:
            ladder = [ladder[int(i)] for i in args.rungs.split(",")]
        except (ValueError, IndexError):
            sys.exit(f"capacity: --rungs takes indices 0..{len(ladder) - 1} of the ladder, comma-separated; got {args.rungs!r}")
    if args.tiny:
        args.vocab = min(args.vocab, 512)
    systems = args.systems.split(",")
    if args.plan_only:
        results = {s: plan_rungs(args, s, ladder) for s in systems}
    else:
        free = shutil.disk_usage(args.offload_dir).free
        to_disk = set(systems) & OFFLOADS_TO_DISK
        need = max((_disk_need(ladder[0], args.vocab, s, _formats(args), args.frozen) for s in to_disk), default=0)
        if to_disk and free < need:
            sys.exit(f"capacity: {args.offload_dir} has {free / GIB:.1f} GiB free; the smallest rung needs up to "
                     f"{need / GIB:.1f} GiB of offload space. Free some, pass --offload-dir elsewhere, or use --tiny.")
        results = {}
        for s in systems:
            print(f"{SYSTEMS[s]}:", flush=True)
            results[s] = search(args, s, ladder)
        _report(results, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({s: r for s, r in results.items()}, f, indent=2, default=str)


def _formats(args) -> tuple[str, str]:
    return args.master, args.moments


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _report(results: dict, args) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Largest LLaMA-style model trained (batch {args.batch}, seq {args.seq}, {args.steps} steps, cap {args.mem_cap:.1f} GiB)")
    for col in ("system", "largest", "params", "step (s)", "peak RSS", "measured / predicted", "disk read/step",
                "disk written/step", "stopped by"):
        t.add_column(col)
    for s, r in results.items():
        b, f = r["best"], r["first_fail"]
        why = (f or {}).get("reason", "the ladder's top") if f else "the ladder's top"
        # elixir's row names its state formats and their bytes on disk per parameter (the rule)
        name = SYSTEMS[s] + (f", state {_formats_label(_formats(args))}" if s == "e" else "")
        name += f", frozen base {args.frozen}" if s == "h" and args.frozen else ""
        if b is None:
            t.add_row(name, "none", "", "", "", "", "", "", why)
            continue
        h, layers = b["rung"]
        params = n_params(h, layers, args.vocab)
        t.add_row(name, f"h{h} L{layers}", _count(params), f"{b['step_s']:.2f}",
                  f"{b['peak_rss'] / GIB:.2f} GiB", _against_prediction(b), f"{b['read_per_step'] / GIB:.2f} GiB",
                  _written(b, params), why)
    console = Console(width=max(140, Console().width))
    console.print(t)
    for s, r in results.items():
        for note in (r["best"] or {}).get("notes", []):
            console.print(f"{SYSTEMS[s]}: {note}")


if __name__ == "__main__":
    main()
