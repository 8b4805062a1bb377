"""Fine-tune a LLaMA-style model larger than this machine's RAM in fp32, from a pretrained checkpoint.

First make a checkpoint (random weights, saved in bf16 one shard at a time, never the whole model
in memory; ``--vocab 32000 --intermediate 11008`` gives LLaMA-2-7B's shape):

    python example/finetune_large.py --make-checkpoint /tmp/llama-ckpt --hidden 4096 --layers 32

then fine-tune it, on 1 or more local ranks (CPU: gloo; GPUs: NCCL), every weight:

    torchrun --nproc-per-node 2 --standalone example/finetune_large.py /tmp/llama-ckpt --steps 20

or only LoRA adapters (PEFT) on a frozen base:

    python example/finetune_large.py /tmp/llama-ckpt --lora 8 --steps 5 --host-memory 8 --save adapters

The model is built on the meta device, ``optimal_search`` places every chunk's bf16 shard and its
fp32 master and optimizer state on the device, in host memory or on disk (``--offload-dir``; a
chunk may go there whole, shard included) to fit ``--host-memory`` (default: 90% of the memory
available now, over the local ranks; ``min``: the least that fits, everything else on disk), and
``load_pretrained`` streams the checkpoint into each rank's shards. The text is the Python
standard library's source (``elixir.data``), byte-level, so nothing is downloaded.

**LoRA mode** (``--lora RANK``) is for a model beyond RAM in fp32 on a box whose disk cannot hold
full fine-tuning's state either (about 14 bytes per parameter offloaded: bf16 shard, fp32 master,
two Adam moments; a 7B model needs ~90 GiB of offload besides the checkpoint). PEFT adds adapters
to ``--lora-targets`` (default: every attention and MLP projection) of the meta-built model; the
base goes into frozen chunks holding only bf16 weights (no gradient, master or optimizer state:
2 bytes per parameter), which the search keeps in RAM or, when RAM binds, on disk, where
``load_pretrained`` writes them once and every gather after only reads them. Only the adapters
get fp32 masters and Adam state. ``--save`` then writes the adapters alone (and their optimizer
state) as an elixir checkpoint (``checkpoint.save(..., frozen=False)``): load the base with
``load_pretrained`` and then this to resume.

Before any heavy work the script prints what the run needs (parameters, the bytes of the model
state, the plan's predicted peak RAM and offload disk per rank) and stops with the fix when the
offload directory's free space or the memory available cannot hold it. Each step prints its loss,
time, the peak RSS so far and the bytes elixir read from and wrote to its offload files.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from elixir import checkpoint
from elixir import device as dev
from elixir import distributed as edist
from elixir.checkpoint.pretrained import parse_size
from elixir.data import VOCAB_SIZE, lm_loss, load_corpus, sample_batch
from elixir.optim import HybridAdam
from elixir.search import DoesNotFitError, Placement, SearchResult, minimum_waste_search, optimal_search
from elixir.wrapper import ElixirModule, ElixirOptimizer

GIB = 2**30
ADAM_STATE = 4 + 8  # fp32 master and two fp32 moments per trainable element


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def mem_available() -> int:
    """Bytes the kernel could give processes now without swapping (``MemAvailable``; 0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def local_ranks(world_size: int) -> int:
    """Ranks on this node: they share its RAM and the offload directory's disk."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def existing_dir(path: str) -> str:
    """``path``, or its nearest existing ancestor (the disk a directory not made yet will be on)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def fail(message: str) -> None:
    """Stop every rank with ``message`` (each rank checks the same figures, so all stop)."""
    raise SystemExit(f"finetune_large: {message}")


# ------------------------------------------------------------------------------------------------
# the checkpoint


def make_checkpoint(path: str, hidden: int, layers: int, shard_size: str, intermediate: Optional[int] = None,
                    vocab: int = VOCAB_SIZE, offload_dir: Optional[str] = None, stage_on_disk: Optional[bool] = None) -> None:
    """Random LLaMA-style weights, materialised shard by shard and saved in bf16. When the bf16
    shards do not fit in the available RAM they are staged in an offload file under
    ``offload_dir`` (default: the system's temporary directory) instead, and read back one chunk
    at a time while the checkpoint is written (``stage_on_disk``: True or False forces the choice)."""
    info = edist.init_distributed()
    heads = max(1, hidden // 128)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate or int(hidden * 8 / 3) // 64 * 64 or 64,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    # up front: each rank holds the process, its bf16 shards, the construction's staging (about
    # two fp32 copies of the largest parameter) and one file's tensors while it writes (measured
    # at 0.55B: 2.30 GiB peak for 2.33 estimated), and the checkpoint needs its bf16 bytes on disk
    ranks = local_ranks(info.world_size)
    largest = max(p.numel() for p in model.parameters())
    staging = 8 * largest + parse_size(shard_size)
    ram = dev.rss_bytes() + 2 * n // info.world_size + staging
    disk, free, avail = 2 * n, shutil.disk_usage(existing_dir(path)).free, mem_available()
    # the bf16 shards go to an offload file when they do not fit in RAM
    on_disk = (bool(avail) and ram * ranks > avail) if stage_on_disk is None else stage_on_disk
    if on_disk:
        ram = dev.rss_bytes() + staging + 4 * largest  # one chunk read back at a time
        offload_dir = tempfile.mkdtemp(prefix="elixir-make-checkpoint-", dir=offload_dir)
        shared = os.stat(offload_dir).st_dev == os.stat(existing_dir(path)).st_dev
        off_free = shutil.disk_usage(offload_dir).free - (disk if shared else 0)
        need = int(2 * n * 1.3)  # the shards, with room for the chunks' padding
        if off_free < need:
            shutil.rmtree(offload_dir, ignore_errors=True)
            fail(f"the bf16 shards do not fit in RAM ({_gib(avail)} available), and {offload_dir}'s disk has "
                 f"{_gib(off_free)} free{' beside the checkpoint' if shared else ''} for about {_gib(need)} of them: "
                 "give --offload-dir a directory on a larger disk, or make the checkpoint on a machine with more RAM")
    if info.is_main:
        print(f"making a checkpoint of {n / 1e9:.2f}B parameters: needs about {_gib(ram)} of RAM per rank "
              f"({ranks} here; {_gib(avail)} available) and {_gib(disk)} of disk in {path} ({_gib(free)} free)"
              + (f"; the bf16 shards are staged on disk in {offload_dir}" + (", as they do not fit in RAM" if stage_on_disk is None else "")
                 if on_disk else ""),
              flush=True)
    if free < disk * 1.05:
        fail(f"{existing_dir(path)} has {_gib(free)} free, the checkpoint needs {_gib(disk * 1.05)}: free space there "
             "or give --make-checkpoint a directory on a larger disk")
    if avail and ram * ranks > avail:
        fail(f"making the checkpoint needs about {_gib(ram * ranks)} of RAM over {ranks} local ranks, "
             f"{_gib(avail)} is available: stop other processes, or run it on more machines")
    # frozen chunks in bf16: no fp32 master and no optimizer state, so each rank holds only its
    # bf16 shards (2 bytes per parameter over the ranks), never the model in fp32
    model.requires_grad_(False)
    plan = minimum_waste_search(model, info.world_size, cpu_offload=True)
    if on_disk:
        plan = dataclasses.replace(plan, frozen_chunks=tuple(
            dataclasses.replace(c, shard_placement=Placement.DISK, optim_placement=Placement.DISK)
            for c in plan.frozen_chunks))  # (a frozen chunk has no optimizer state: its placement names the shard's)
    t0 = time.perf_counter()
    try:
        em = ElixirModule(model, plan, init_seed=0, dtype=torch.bfloat16, offload_dir=offload_dir if on_disk else None)
        t1 = time.perf_counter()
        checkpoint.save_pretrained(path, em, max_shard_size=shard_size, dtype=torch.bfloat16)
    finally:
        if on_disk:
            shutil.rmtree(offload_dir, ignore_errors=True)
    if info.is_main:
        print(f"saved {n / 1e9:.2f}B parameters ({n * 2 / GIB:.1f} GiB in bf16, {n * 4 / GIB:.1f} GiB as fp32) to {path} "
              f"(initialised in {t1 - t0:.0f} s, written in {time.perf_counter() - t1:.0f} s; peak RSS "
              f"{_gib(dev.peak_rss_bytes())})")


# ------------------------------------------------------------------------------------------------
# fine-tuning


@dataclasses.dataclass
class Run:
    """What :func:`finetune` did: the per-step losses and offload I/O, the plan and the module."""

    losses: list[float]
    step_io: list[tuple[int, int]]  # bytes read from / written to the offload files per step
    load_io: tuple[int, int]  # the same for construction and load_pretrained together
    plan: SearchResult
    module: ElixirModule
    optimizer: ElixirOptimizer


def offload_io(em: ElixirModule) -> tuple[int, int]:
    """Bytes this rank has read from and written to its offload files (masters and optimizer
    state, and compute shards placed on disk, frozen ones included)."""
    stores = em.offload_stores
    return sum(s.bytes_read for s in stores), sum(s.bytes_written for s in stores)


def state_bytes(model: torch.nn.Module, elem: int) -> tuple[int, int, int]:
    """(trainable params, frozen params, bytes of the model state): a trainable element costs its
    compute-dtype shard, fp32 master and Adam moments; a frozen one only its compute-dtype weight."""
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return train, frozen, train * (elem + ADAM_STATE) + frozen * elem


def plan_model(model, args, info, batch, dtype: torch.dtype, host: Optional[int], disk: int) -> SearchResult:
    """``optimal_search`` under the budgets; ``host`` None: the least host memory that fits."""

    def step_fn(m, b):
        loss = lm_loss(m, b["x"], b["y"])
        loss.backward()
        return loss

    kw = dict(unified_dtype=dtype, optimizer_type="HybridAdam", inp=batch, step_fn=step_fn, disk=disk,
              verbose=info.is_main and args.verbose)
    if args.lora:  # the adapters' gradients are a few MiB: keep them in fp32, stepped after backward
        kw.update(grad_dtype=torch.float32, fused_step=False)
    if host is not None:
        return optimal_search(model, info.world_size, host_memory=host, **kw)
    # --host-memory min: learn the least memory that fits from the search's no-fit answer, then
    # plan for it. The process's own bytes (counted in the budget; by default its RSS when the
    # search starts, which the first search itself raises a little) are measured once, so the
    # second search sees the same figure and its plan is the smallest one, not a near one.
    rss = dev.rss_bytes()  # the model is on meta: none of its bytes are resident
    kw["process_bytes"] = max(edist.all_gather_object(rss)) if info.world_size > 1 else rss
    try:
        optimal_search(model, info.world_size, host_memory=1, **kw)
        host = 1
    except DoesNotFitError as e:
        host = e.needs.get("memory") or e.needs.get("host_memory")
        if host is None:
            raise
    if info.is_main:
        print(f"--host-memory min: the least that fits is {_gib(host)} per rank", flush=True)
    return optimal_search(model, info.world_size, host_memory=host, **kw)


def finetune(args) -> Run:
    info = edist.init_distributed()
    ranks = local_ranks(info.world_size)
    config = AutoConfig.from_pretrained(args.checkpoint)
    if config.vocab_size < VOCAB_SIZE:
        fail(f"{args.checkpoint} has a vocabulary of {config.vocab_size}; the byte-level text needs >= {VOCAB_SIZE}")
    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    with torch.device("meta"):  # no weights anywhere: each rank will hold only what its plan gives it
        model = AutoModelForCausalLM.from_config(config)
    if args.lora:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from lora_finetune import add_lora  # the LoRA example's adapters: one PEFT config for both

        model = add_lora(model, args.lora, args.lora_alpha or 2 * args.lora, args.lora_targets)
    model.train()

    # ---- what the run needs, before any heavy work ----
    offload_root = existing_dir(args.offload_dir or tempfile.gettempdir())
    free = shutil.disk_usage(offload_root).free
    avail = mem_available()
    n_train, n_frozen, need = state_bytes(model, elem)
    host = None if args.host_memory == "min" else int(float(args.host_memory) * GIB) if args.host_memory else (
        int(0.9 * avail / ranks) if avail else None)
    disk = int(args.disk * GIB) if args.disk else int(0.9 * free / ranks)  # per rank; the ranks share the disk
    if info.is_main:
        what = (f"LoRA rank {args.lora} on {args.lora_targets}: {_count(n_train)} trainable, {_count(n_frozen)} frozen"
                if args.lora else "every weight trainable")
        print(f"model: {_count(n_train + n_frozen)} parameters ({what}); {_gib(4 * (n_train + n_frozen))} as fp32. "
              f"Its state (bf16 weights{', adapters' if args.lora else ''} + fp32 masters + Adam moments): "
              f"{_gib(need)}, {_gib(need / info.world_size)} per rank, in RAM or offloaded to {offload_root} "
              f"({_gib(free)} free there; {_gib(avail)} of RAM available, budget "
              f"{'min' if host is None else _gib(host)} per rank over {ranks} local ranks)", flush=True)
    if host is not None and need / info.world_size > host + disk:
        short = need / info.world_size - host
        where = (f"--disk allows {args.disk:g} GiB per rank: raise it ({offload_root} has {_gib(free)} free)"
                 if args.disk else f"{offload_root} has {_gib(free)} free: free space there or pass --offload-dir "
                 f"on a larger disk")
        fail(f"the model state needs {_gib(need / info.world_size)} per rank; with {_gib(host)} of RAM per rank "
             f"about {_gib(short)} per rank ({_gib(short * ranks)} over {ranks} local ranks) must go to disk, but "
             f"{where}{'' if args.lora else ', or fine-tune LoRA adapters only (--lora 8)'}")

    corpus = load_corpus(max_bytes=args.corpus_bytes)
    x, y = sample_batch(corpus.train, args.batch, args.seq, 0)
    t0 = time.perf_counter()
    plan = plan_model(model, args, info, {"x": x, "y": y}, dtype, host, disk)
    pred = plan.prediction
    ram = pred.peak_device_bytes + pred.peak_host_bytes if dev.default_device().type == "cpu" else pred.peak_host_bytes
    on_disk = [c for c in plan.frozen_chunks if c.shard_placement is Placement.DISK]
    if info.is_main:
        frozen = (f"; {len(plan.frozen_chunks)} frozen chunks, {len(on_disk)} of them on disk" if plan.frozen_chunks else "")
        print(f"plan ({time.perf_counter() - t0:.0f} s): {len(plan.chunks)} trainable chunks{frozen}; predicted per rank: "
              f"peak RAM {_gib(ram)}, offload disk {_gib(pred.peak_disk_bytes)}, step {pred.step_time_s:.1f} s", flush=True)
    if pred.peak_disk_bytes * ranks > free:
        fail(f"the plan puts {_gib(pred.peak_disk_bytes)} per rank ({ranks} local ranks) in {offload_root}, which has "
             f"{_gib(free)} free: free space there, pass --offload-dir on a larger disk, or raise --host-memory")
    if avail and ram * ranks > avail:
        fail(f"the plan needs {_gib(ram)} of RAM per rank ({ranks} local ranks), {_gib(avail)} is available: "
             f"pass --host-memory {max(0.1, 0.9 * avail / ranks / GIB):.1f} or lower (the rest goes to disk), "
             "or stop other processes")

    # ---- build (one chunk at a time), load, train ----
    t0 = time.perf_counter()
    # the frozen base is overwritten by the checkpoint: not initialised first (zeros until loaded)
    em = ElixirModule(model, plan, dtype=dtype, offload_dir=args.offload_dir, init_seed=args.seed, init_frozen=False)
    report = checkpoint.load_pretrained(args.checkpoint, em)  # the base into its (frozen) chunks
    if report.missing_keys and args.lora:
        fail(f"the checkpoint lacks {len(report.missing_keys)} frozen weights ({report.missing_keys[0]!r}, ...): "
             "they would train as zeros; point at the base model's checkpoint")
    load_io = offload_io(em)
    trainable = [p for p in em.parameters() if p.requires_grad]
    opt = ElixirOptimizer(em, HybridAdam(trainable, lr=args.lr or (1e-3 if args.lora else 1e-4), weight_decay=0.0))
    if info.is_main:
        mem = em.memory_report()
        print(f"built and loaded in {time.perf_counter() - t0:.0f} s ({len(report.missing_keys)} missing keys): "
              f"offload files read {_gib(load_io[0])}, written {_gib(load_io[1])}; this rank holds "
              f"{_gib(mem['frozen_shard_bytes'])} of frozen shards in memory, peak RSS {_gib(dev.peak_rss_bytes())}",
              flush=True)

    losses, step_io = [], []
    for step in range(args.steps):
        x, y = sample_batch(corpus.train, args.batch, args.seq, step % args.batches, rank=info.rank,
                            world_size=info.world_size)
        io0, t0 = offload_io(em), time.perf_counter()
        loss = lm_loss(em, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        io1 = offload_io(em)
        step_io.append((io1[0] - io0[0], io1[1] - io0[1]))
        if info.is_main:
            print(f"step {step}: loss {losses[-1]:.6f}  {time.perf_counter() - t0:.2f} s  peak RSS "
                  f"{_gib(dev.peak_rss_bytes())}  disk read {_gib(step_io[-1][0])} written {_gib(step_io[-1][1])}",
                  flush=True)
    if args.save:
        if args.lora:
            checkpoint.save(args.save, em, opt, frozen=False)  # the adapters (and their optimizer state) only
        else:
            checkpoint.save_pretrained(args.save, em, dtype=torch.bfloat16)
        if info.is_main:
            print(f"saved {'the adapters' if args.lora else 'the model'} to {args.save}", flush=True)
    return Run(losses, step_io, load_io, plan, em, opt)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("checkpoint", nargs="?", help="a Hugging Face checkpoint directory to fine-tune")
    p.add_argument("--make-checkpoint", metavar="DIR", help="write a random bf16 checkpoint to DIR and exit")
    p.add_argument("--hidden", type=int, default=2048, help="with --make-checkpoint: hidden size")
    p.add_argument("--layers", type=int, default=16, help="with --make-checkpoint: layers")
    p.add_argument("--intermediate", type=int, help="with --make-checkpoint: MLP size (default: 8/3 hidden, rounded to 64)")
    p.add_argument("--vocab", type=int, default=VOCAB_SIZE, help=f"with --make-checkpoint: vocabulary (default {VOCAB_SIZE})")
    p.add_argument("--shard-size", default="1GB", help="with --make-checkpoint: max bytes per file")
    p.add_argument("--stage-on-disk", action=argparse.BooleanOptionalAction, default=None,
                   help="with --make-checkpoint: stage the bf16 shards in --offload-dir instead of RAM "
                        "(default: only when they do not fit in the available RAM)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="train LoRA adapters of this rank on a frozen base instead of every weight (PEFT)")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: 2 x rank)")
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="modules to adapt, comma-separated (default: every attention and MLP projection)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batches", type=int, default=4, help="distinct batches, cycled (default 4)")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000, help="bytes of text to read (default 4e6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the adapters' initialisation (default 0)")
    p.add_argument("--lr", type=float, help="learning rate (default 1e-4; 1e-3 with --lora)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="compute dtype of the chunks (the optimizer keeps fp32 masters)")
    p.add_argument("--host-memory", help="GiB of RAM per rank the plan may use, or 'min' for the least that fits "
                   "(default: 90%% of the memory available now, over the local ranks)")
    p.add_argument("--disk", type=float, help="GiB of disk per rank for offloaded chunks (default: 90%% of the "
                   "offload directory's free space over the local ranks)")
    p.add_argument("--offload-dir", default=os.environ.get("ELIXIR_OFFLOAD_DIR"),
                   help="where disk chunks live (default: $ELIXIR_OFFLOAD_DIR, else a temporary directory)")
    p.add_argument("--save", help="save the fine-tuned model here (HF layout, bf16), or with --lora the adapters only")
    p.add_argument("--verbose", action="store_true", help="print the search's report")
    args = p.parse_args(argv)
    if args.host_memory not in (None, "min"):
        try:
            float(args.host_memory)
        except ValueError:
            p.error(f"--host-memory takes GiB or 'min', not {args.host_memory!r}")
    if not args.make_checkpoint and not args.checkpoint:
        p.error("give a checkpoint directory, or --make-checkpoint DIR")
    return args


def main() -> None:
    args = parse_args()
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.hidden, args.layers, args.shard_size, args.intermediate, args.vocab,
                        args.offload_dir, args.stage_on_disk)
    else:
        finetune(args)
    edist.shutdown()


if __name__ == "__main__":
    main()
