"""Fine-tune a pretrained OPT causal LM with elixir on the Python standard library's source.

    python example/opt_finetune.py                                           # make the checkpoint if missing, fine-tune
    torchrun --nproc-per-node 2 --standalone example/opt_finetune.py --plan optimal
    python example/opt_finetune.py --plan cpu --pretrained opt-pretrained --steps 200

The pretrained checkpoint is an ordinary Hugging Face directory (``config.json`` +
``model.safetensors``). If ``--pretrained`` does not exist yet, a small byte-level OPT is first
trained from scratch for ``--pretrain-steps`` steps on the first half of the training split and
written there with ``save_pretrained``, so it is a real pretrained model. Fine-tuning then loads it
with ``from_pretrained``, plans it (``--plan optimal``: ``optimal_search`` picks chunks and
placement; ``--plan cuda`` / ``cpu``: ``minimum_waste_search`` with everything on the compute device /
shards and optimizer state in host memory), trains on the second half of the training split, and
prints the validation perplexity (held-out files) before and after.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import OPTConfig, OPTForCausalLM

from elixir import distributed as edist
from elixir.data import VOCAB_SIZE, lm_loss, load_corpus, sample_batch
from elixir.data import perplexity as data_perplexity
from elixir.optim import HybridAdam
from elixir.search import minimum_waste_search, optimal_search
from elixir.wrapper import ElixirModule, ElixirOptimizer


def plan_for(model, args, world: int, dtype: torch.dtype, verbose: bool):
    if args.plan == "optimal":
        return optimal_search(model, world, unified_dtype=dtype, verbose=verbose)
    return minimum_waste_search(model, world, unified_dtype=dtype, cpu_offload=args.plan == "cpu", verbose=verbose)


def perplexity(model, data: torch.Tensor, args, info) -> float:
    return data_perplexity(model, data, args.batch, args.seq, args.eval_batches, info.rank, info.world_size)


def train(model, optimizer, data: torch.Tensor, steps: int, args, info, tag: str, seed: int) -> None:
    for step in range(steps):
        x, y = sample_batch(data, args.batch, args.seq, step, seed=seed, rank=info.rank, world_size=info.world_size)
        loss = lm_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if info.is_main and (step % 50 == 0 or step == steps - 1):
            print(f"{tag} step {step:4d}  loss {loss.item():.3f}", flush=True)


def make_pretrained(path: str, corpus_half: torch.Tensor, args, info) -> None:
    """Train a small OPT from scratch and write it as a Hugging Face directory."""
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=VOCAB_SIZE, hidden_size=args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=max(1, args.hidden // 32), ffn_dim=4 * args.hidden,
                       max_position_embeddings=args.seq, word_embed_proj_dim=args.hidden,
                       pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = OPTForCausalLM(config)
    plan = minimum_waste_search(model, info.world_size)
    em = ElixirModule(model, plan)
    opt = ElixirOptimizer(em, HybridAdam(em.parameters(), lr=2e-3, weight_decay=0.01), max_norm=1.0)
    train(em, opt, corpus_half, args.pretrain_steps, args, info, "pretrain", seed=1)
    state = em.state_dict(rank0_only=True)  # gathered on rank 0, one chunk at a time
    if info.is_main:
        model.save_pretrained(path, state_dict=state)
        print(f"wrote the pretrained checkpoint to {path}", flush=True)
    edist.barrier()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--pretrained", default="opt-pretrained", help="HF checkpoint directory (made if missing; default ./opt-pretrained)")
    p.add_argument("--plan", choices=("optimal", "cuda", "cpu"), default="cuda",
                   help="optimal_search, or minimum_waste_search with placement policy cuda/cpu (default cuda)")
    p.add_argument("--steps", type=int, default=60, help="fine-tuning steps (default 60)")
    p.add_argument("--pretrain-steps", type=int, default=200, help="steps to make the checkpoint (default 200)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length in bytes (default 128)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the checkpoint made (default 128)")
    p.add_argument("--layers", type=int, default=2, help="layers of the checkpoint made (default 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate (default 1e-3)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (default 8)")
    p.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of stdlib source to read (default 2e6)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 master weights")
    args = p.parse_args(argv)

    info = edist.init_distributed()
    corpus = load_corpus(max_bytes=args.corpus_bytes)
    half = corpus.train.numel() // 2
    pretrain_text, finetune_text = corpus.train[:half], corpus.train[half:]
    if not os.path.isfile(os.path.join(args.pretrained, "config.json")):
        make_pretrained(args.pretrained, pretrain_text, args, info)

    t0 = time.perf_counter()
    model = OPTForCausalLM.from_pretrained(args.pretrained)  # every rank reads it; each keeps its shards
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    plan = plan_for(model, args, info.world_size, dtype, verbose=info.is_main)
    model = ElixirModule(model, plan, dtype=dtype, output_fp32=True)
    optimizer = ElixirOptimizer(model, HybridAdam(model.parameters(), lr=args.lr, weight_decay=0.01), max_norm=1.0)

    before = perplexity(model, corpus.val, args, info)
    train(model, optimizer, finetune_text, args.steps, args, info, "finetune", seed=2)
    after = perplexity(model, corpus.val, args, info)
    if info.is_main:
        print(f"validation perplexity: {before:.2f} before, {after:.2f} after {args.steps} fine-tuning steps "
              f"(plan {args.plan}, world size {info.world_size}, {time.perf_counter() - t0:.0f} s)")
    edist.shutdown()


if __name__ == "__main__":
    main()
