"""Train a GPT-2 with elixir, in about forty lines of plain PyTorch.

Run it on 2 local ranks (CPU, gloo; on GPUs the same command uses NCCL):

    torchrun --nproc-per-node 2 --standalone example/train_gpt.py --steps 50

or as one process: ``python example/train_gpt.py``. The model is a byte-level GPT-2 built from a
config, the text is the Python standard library's source (``elixir.data``), so nothing is
downloaded. ``elixir demo`` is the same loop with progress bars and a memory report.
"""

import argparse

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from elixir import distributed as edist
from elixir.data import load_corpus, sample_batch
from elixir.optim import HybridAdam
from elixir.search import minimum_waste_search
from elixir.wrapper import ElixirModule, ElixirOptimizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 master weights")
    args = p.parse_args()

    info = edist.init_distributed()  # torchrun's environment, or a single process
    torch.manual_seed(0)  # every rank builds the same initial model
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=384, n_layer=6, n_head=6))
    optimizer = HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.01)  # any torch optimizer works

    # 1. plan: pack the parameters into equal chunks with the least padding
    plan = minimum_waste_search(model, info.world_size, verbose=info.is_main)
    # 2. wrap: each rank keeps 1/world of every chunk; chunks are gathered on use and released after
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = ElixirModule(model, plan, dtype=dtype, output_fp32=True)
    # 3. the optimizer steps on this rank's shards only
    optimizer = ElixirOptimizer(model, optimizer)

    data = load_corpus().train
    for step in range(args.steps):
        x, y = sample_batch(data, args.batch, args.seq, step, rank=info.rank, world_size=info.world_size)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        loss.backward()  # gradients are reduce-scattered into the shards as they complete
        optimizer.step()
        optimizer.zero_grad()
        if info.is_main and step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")

    state = model.state_dict(rank0_only=True)  # full, unsharded, Hugging Face keys
    if info.is_main:
        print(f"done; state dict has {len(state)} tensors, memory: {model.memory_report()['shard_bytes'] / 2**20:.1f} MiB of shards")


if __name__ == "__main__":
    main()
