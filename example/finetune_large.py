"""Fine-tune a LLaMA-style model larger than this machine's RAM in fp32, from a pretrained checkpoint.

First make a checkpoint (random weights, saved in bf16 one shard at a time, never the whole model
in memory):

    python example/finetune_large.py --make-checkpoint /tmp/llama-ckpt --hidden 4096 --layers 32

then fine-tune it, on 1 or more local ranks (CPU: gloo; GPUs: NCCL):

    torchrun --nproc-per-node 2 --standalone example/finetune_large.py /tmp/llama-ckpt --steps 20

The model is built on the meta device, ``optimal_search`` places every chunk's bf16 shard and its
fp32 master and optimizer state on the device, in host memory or on disk (``--offload-dir``; a
chunk may go there whole, shard included) to fit ``--host-memory``, and
``load_pretrained`` streams the checkpoint into each rank's shards. The text is the Python
standard library's source (``elixir.data``), byte-level, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from elixir import checkpoint
from elixir import distributed as edist
from elixir.data import load_corpus, sample_batch
from elixir.optim import HybridAdam
from elixir.search import minimum_waste_search, optimal_search
from elixir.wrapper import ElixirModule, ElixirOptimizer


def make_checkpoint(path: str, hidden: int, layers: int, shard_size: str) -> None:
    """Random LLaMA-style weights, materialised shard by shard and saved in bf16."""
    info = edist.init_distributed()
    heads = max(1, hidden // 128)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64 or 64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=256, max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    # frozen chunks in bf16: no fp32 master and no optimizer state, so each rank holds only its
    # bf16 shards (2 bytes per parameter over the ranks), never the model in fp32
    model.requires_grad_(False)
    plan = minimum_waste_search(model, info.world_size, cpu_offload=True)
    em = ElixirModule(model, plan, init_seed=0, dtype=torch.bfloat16)
    checkpoint.save_pretrained(path, em, max_shard_size=shard_size, dtype=torch.bfloat16)
    if info.is_main:
        print(f"saved {n / 1e9:.2f}B parameters ({n * 2 / 2**30:.1f} GiB in bf16, {n * 4 / 2**30:.1f} GiB as fp32) to {path}")


def finetune(args) -> list[float]:
    info = edist.init_distributed()
    config = AutoConfig.from_pretrained(args.checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.train()
    vocab = config.vocab_size
    batch = {"input_ids": torch.randint(0, vocab, (args.batch, args.seq))}

    def step_fn(m, b):
        loss = m(input_ids=b["input_ids"], labels=b["input_ids"]).loss
        loss.backward()
        return loss

    gib = 2**30
    dtype = getattr(torch, args.dtype)
    offload_root = os.path.abspath(args.offload_dir or tempfile.gettempdir())
    while not os.path.isdir(offload_root):  # not created yet: the disk it will be created on
        offload_root = os.path.dirname(offload_root)
    # default disk budget: 90% of what is free where the offload files go, shared by the ranks
    disk = args.disk * gib if args.disk else 0.9 * shutil.disk_usage(offload_root).free / info.world_size
    plan = optimal_search(
        model, info.world_size, unified_dtype=dtype, optimizer_type="HybridAdam", inp=batch, step_fn=step_fn,
        verbose=info.is_main,
        host_memory=int(args.host_memory * gib) if args.host_memory else None,
        device_memory=int(args.host_memory * gib) if args.host_memory else None,
        disk=int(disk),
    )
    em = ElixirModule(model, plan, dtype=dtype, offload_dir=args.offload_dir)
    checkpoint.load_pretrained(args.checkpoint, em)
    opt = ElixirOptimizer(em, HybridAdam(em.parameters(), lr=args.lr, weight_decay=0.0))

    data = load_corpus().train
    losses = []
    for step in range(args.steps):
        x, y = sample_batch(data, args.batch, args.seq, step % 4, rank=info.rank, world_size=info.world_size)
        logits = em(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if info.is_main:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    if args.save:
        checkpoint.save_pretrained(args.save, em, dtype=torch.bfloat16)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", help="a Hugging Face checkpoint directory to fine-tune")
    p.add_argument("--make-checkpoint", metavar="DIR", help="write a random bf16 checkpoint to DIR and exit")
    p.add_argument("--hidden", type=int, default=2048, help="with --make-checkpoint: hidden size")
    p.add_argument("--layers", type=int, default=16, help="with --make-checkpoint: layers")
    p.add_argument("--shard-size", default="1GB", help="with --make-checkpoint: max bytes per file")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="compute dtype of the chunks (the optimizer keeps fp32 masters)")
    p.add_argument("--host-memory", type=float, help="GiB per rank the plan may use (default: the hardware profile's)")
    p.add_argument("--disk", type=float, help="GiB of disk per rank for offloaded chunks (default: 90%% of the "
                   "offload directory's free space over the ranks)")
    p.add_argument("--offload-dir", default=os.environ.get("ELIXIR_OFFLOAD_DIR"), help="where disk chunks live")
    p.add_argument("--save", help="save the fine-tuned model here (HF layout, bf16)")
    args = p.parse_args()
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.hidden, args.layers, args.shard_size)
    elif args.checkpoint:
        finetune(args)
    else:
        p.error("give a checkpoint directory, or --make-checkpoint DIR")


if __name__ == "__main__":
    main()
