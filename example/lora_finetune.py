"""LoRA fine-tuning of a LLaMA-style model from a pretrained checkpoint directory, on a local text corpus.

    python example/lora_finetune.py --make-tiny                          # write a tiny checkpoint first, then fine-tune
    torchrun --nproc-per-node 2 --standalone example/lora_finetune.py --pretrained llama-tiny
    python example/lora_finetune.py --pretrained /models/llama --corpus ./my_texts --bf16 --save adapters

The model is built on the meta device (no weights anywhere), adapters are added with PEFT
(``get_peft_model``), and ``ElixirModule`` materialises it one chunk at a time: the frozen base goes
into frozen chunks (sharded across ranks, weights only: no gradient, no fp32 master, no optimizer
state) and the adapters into ordinary trainable chunks. ``load_pretrained`` then streams the base
checkpoint into the frozen chunks, each rank reading only the rows of its own shards. The corpus is
every file under ``--corpus`` (default: the Python standard library's source), read as bytes, so the
checkpoint's vocabulary must cover 256 byte values (``--make-tiny`` makes one that does). With
``--save`` the trained adapters (and the optimizer state) are written as an elixir checkpoint without
the frozen weights (``checkpoint.save(..., frozen=False)``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from elixir import checkpoint
from elixir import distributed as edist
from elixir.data import VOCAB_SIZE, lm_loss, load_corpus, sample_batch
from elixir.data import perplexity as data_perplexity
from elixir.search import minimum_waste_search, optimal_search
from elixir.wrapper import ElixirModule, ElixirOptimizer


def make_tiny(path: str, args) -> None:
    """A small LLaMA with a byte vocabulary, written with ``save_pretrained`` (random weights: it
    shows the mechanics, not what a pretrained base learns)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 32),
                         num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=max(256, args.seq),
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)


def add_lora(model: torch.nn.Module, rank: int, alpha: float, targets: str) -> torch.nn.Module:
    """PEFT LoRA adapters of ``rank`` on the comma-separated ``targets`` modules (no dropout: the
    step is deterministic), over ``model``'s frozen weights; on a meta-built model too (elixir
    materialises the adapters as PEFT initialises them). ``example/finetune_large.py --lora`` uses it."""
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets.split(",")))


def perplexity(model, data: torch.Tensor, args, info) -> float:
    return data_perplexity(model, data, args.batch, args.seq, args.eval_batches, info.rank, info.world_size)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--pretrained", default="llama-tiny", help="HF checkpoint directory of a LLaMA-style model (default ./llama-tiny)")
    p.add_argument("--make-tiny", action="store_true", help="write a tiny LLaMA checkpoint at --pretrained first (if missing)")
    p.add_argument("--corpus", default=None, help="directory of text files to train on (default: the stdlib's source)")
    p.add_argument("--plan", choices=("optimal", "minimum_waste"), default="optimal", help="the search (default optimal)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (default 16)")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="modules to adapt, comma-separated")
    p.add_argument("--steps", type=int, default=40, help="fine-tuning steps (default 40)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--seq", type=int, default=128, help="sequence length in bytes (default 128)")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate (default 2e-3)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the --make-tiny checkpoint (default 128)")
    p.add_argument("--layers", type=int, default=2, help="layers of the --make-tiny checkpoint (default 2)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches (default 4)")
    p.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of the corpus to read (default 2e6)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute: frozen chunks hold bf16 weights, no fp32 copy")
    p.add_argument("--save", default=None, help="write the adapters (and optimizer state) here as an elixir checkpoint")
    args = p.parse_args(argv)

    info = edist.init_distributed()
    if args.make_tiny and not os.path.isfile(os.path.join(args.pretrained, "config.json")):
        if info.is_main:
            make_tiny(args.pretrained, args)
            print(f"wrote a tiny checkpoint to {args.pretrained}", flush=True)
        edist.barrier()
    files = sorted(f for f in Path(args.corpus).rglob("*") if f.is_file()) if args.corpus else None
    corpus = load_corpus(max_bytes=args.corpus_bytes, files=files, val_every=4)

    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(args.pretrained)
    if config.vocab_size < VOCAB_SIZE:
        raise SystemExit(f"{args.pretrained} has a vocabulary of {config.vocab_size}; this byte-level example needs >= {VOCAB_SIZE}")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    with torch.device("meta"):  # no weights yet: every rank will hold only its shards
        base = AutoModelForCausalLM.from_config(config)
    model = add_lora(base, args.rank, args.alpha, args.targets)
    if info.is_main:
        model.print_trainable_parameters()
    if args.plan == "optimal":
        x, y = sample_batch(corpus.train, args.batch, args.seq, 0, seed=2)
        plan = optimal_search(model, info.world_size, unified_dtype=dtype, inp={"x": x, "y": y},
                              step_fn=lambda m, b: lm_loss(m, b["x"], b["y"]).backward(), verbose=info.is_main)
    else:
        plan = minimum_waste_search(model, info.world_size, unified_dtype=dtype, verbose=info.is_main)
    model = ElixirModule(model, plan, dtype=dtype, output_fp32=True)
    report = checkpoint.load_pretrained(args.pretrained, model)  # the base into the frozen chunks
    optimizer = ElixirOptimizer(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr))
    mem = model.memory_report()
    if info.is_main:
        print(f"loaded {args.pretrained} ({len(report.missing_keys)} missing keys); this rank holds "
              f"{mem['frozen_shard_bytes'] / 2**20:.1f} MiB of frozen shards in {len(model.frozen_chunks)} frozen chunks, "
              f"{mem['shard_bytes'] / 2**20:.2f} MiB of trainable shards", flush=True)

    before = perplexity(model, corpus.val, args, info)
    for step in range(args.steps):
        x, y = sample_batch(corpus.train, args.batch, args.seq, step, seed=2, rank=info.rank, world_size=info.world_size)
        loss = lm_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if info.is_main and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
    after = perplexity(model, corpus.val, args, info)
    if args.save:
        checkpoint.save(args.save, model, optimizer, frozen=False)  # adapters only, as PEFT saves them
    if info.is_main:
        print(f"validation perplexity: {before:.2f} before, {after:.2f} after {args.steps} LoRA steps "
              f"(world size {info.world_size}, {time.perf_counter() - t0:.0f} s)"
              + (f"; adapters saved to {args.save}" if args.save else ""))
    edist.shutdown()


if __name__ == "__main__":
    main()
