"""Train a GPT-2 with elixir, in about fifty lines of plain PyTorch.

Run it on 2 local ranks (CPU, gloo; on GPUs the same command uses NCCL):

    torchrun --nproc-per-node 2 --standalone example/train_gpt.py --steps 50

or as one process: ``python example/train_gpt.py``. The model is a byte-level GPT-2 built from a
config, the text is the Python standard library's source (``elixir.data``), so nothing is
downloaded. ``elixir demo`` is the same loop with progress bars and a memory report.

Checkpoints and restarts: ``--ckpt DIR --save-every 50`` saves ``DIR/step-00000050``, ...
(atomic, sharded); ``--resume auto`` starts from the newest complete one there (or from scratch).
Under ``torchrun --max-restarts 3`` a run that loses a rank is restarted and resumes from the
last checkpoint; every step's batch and dropout are drawn from (seed, step, rank), so the
resumed run ends with the same parameters as an uninterrupted one, bit for bit in fp32.
"""

import argparse

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from elixir import checkpoint
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
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384, help="hidden size (a multiple of 64)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 master weights")
    p.add_argument("--ckpt", default=None, help="directory of numbered checkpoints")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (needs --ckpt)")
    p.add_argument("--resume", default=None, help="'auto' (the newest checkpoint in --ckpt) or a checkpoint directory")
    p.add_argument("--out", default=None, help="write the final fp32 weights here (safetensors)")
    args = p.parse_args()

    info = edist.init_distributed()  # torchrun's environment, or a single process
    torch.manual_seed(0)  # every rank builds the same initial model
    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=args.width // 64)
    model = GPT2LMHeadModel(config)
    optimizer = HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.01)  # any torch optimizer works

    # 1. plan: pack the parameters into equal chunks with the least padding
    plan = minimum_waste_search(model, info.world_size, verbose=info.is_main)
    # 2. wrap: each rank keeps 1/world of every chunk; chunks are gathered on use and released after
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = ElixirModule(model, plan, dtype=dtype, output_fp32=True)
    # 3. the optimizer steps on this rank's shards only
    optimizer = ElixirOptimizer(model, optimizer)

    start = 0
    resume = checkpoint.latest(args.ckpt) if args.resume == "auto" and args.ckpt else args.resume
    if resume:
        start = checkpoint.load(resume, model, optimizer)["step"]
        if info.is_main:
            print(f"resumed from {resume} at step {start}")

    data = load_corpus().train
    for step in range(start, args.steps):
        torch.manual_seed(step * info.world_size + info.rank)  # dropout: the same after a resume
        x, y = sample_batch(data, args.batch, args.seq, step, rank=info.rank, world_size=info.world_size)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        loss.backward()  # gradients are reduce-scattered into the shards as they complete
        optimizer.step()
        optimizer.zero_grad()
        if info.is_main and step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")
        if args.save_every and (step + 1) % args.save_every == 0:
            checkpoint.save(checkpoint.step_path(args.ckpt, step + 1), model, optimizer, extra={"step": step + 1})

    state = model.state_dict(rank0_only=True)  # full, unsharded, Hugging Face keys
    if info.is_main:
        print(f"done; state dict has {len(state)} tensors, memory: {model.memory_report()['shard_bytes'] / 2**20:.1f} MiB of shards")
        if args.out:
            from safetensors.torch import save_file

            save_file({k: v.clone() for k, v in state.items()}, args.out)  # tied weights: one copy each


if __name__ == "__main__":
    main()
