"""Fine-tune BERT for sequence classification with elixir: minimum_waste_search, ElixirModule, ElixirOptimizer.

    python example/bert_finetune.py                                        # one process
    torchrun --nproc-per-node 2 --standalone example/bert_finetune.py      # 2 ranks (gloo on CPU, NCCL on GPUs)

This is the "simple example" of the Elixir README on a task that needs no download: a labelled set
built from the Python standard library's source (``elixir.data``). Each example is a 64-byte window
of real source (label 1) or a corrupted one, with a fraction ``--corrupt`` of its bytes replaced by
random bytes (label 0); a [CLS] token is prepended. Validation windows come from files never
trained on, and classes are balanced, so chance is 50%. A small byte-level BERT is built from a
config, planned with ``minimum_waste_search``, trained for ``--steps`` steps, and its validation
accuracy printed before and after.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import BertConfig, BertForSequenceClassification

from elixir import distributed as edist
from elixir.data import load_corpus
from elixir.optim import HybridAdam
from elixir.search import minimum_waste_search
from elixir.wrapper import ElixirModule, ElixirOptimizer

CLS = 256  # one token past the 256 byte values


def labelled_batch(
    data: torch.Tensor, n: int, seq: int, gen: torch.Generator, corrupt: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` windows of ``data`` behind a [CLS] token; label 0 windows have a ``corrupt`` fraction
    of their bytes replaced by random ones."""
    starts = torch.randint(0, data.numel() - seq, (n,), generator=gen)
    x = data[starts.unsqueeze(1) + torch.arange(seq)].long()
    labels = torch.randint(0, 2, (n,), generator=gen)
    hit = (torch.rand(n, seq, generator=gen) < corrupt) & (labels == 0).unsqueeze(1)
    x = torch.where(hit, torch.randint(0, 256, (n, seq), generator=gen), x)
    return torch.cat([torch.full((n, 1), CLS), x], dim=1), labels


def accuracy(model, data: torch.Tensor, args, rank: int, world: int) -> float:
    """Accuracy on a fixed validation set (each rank scores its slice; the counts are summed)."""
    gen = torch.Generator().manual_seed(1234)
    correct = torch.zeros(2)
    model.eval()
    with torch.no_grad():
        for _ in range(args.eval_batches):
            x, y = labelled_batch(data, args.batch * world, args.seq, gen, args.corrupt)
            x, y = x[rank * args.batch : (rank + 1) * args.batch], y[rank * args.batch : (rank + 1) * args.batch]
            pred = model(input_ids=x).logits.argmax(-1)
            correct += torch.tensor([(pred == y).sum().item(), y.numel()], dtype=torch.float)
    model.train()
    if world > 1:
        torch.distributed.all_reduce(correct)
    return (correct[0] / correct[1]).item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--batch", type=int, default=16, help="examples per rank per step (default 16)")
    p.add_argument("--seq", type=int, default=64, help="window length in bytes (default 64)")
    p.add_argument("--corrupt", type=float, default=0.3, help="fraction of bytes replaced in label-0 windows (default 0.3)")
    p.add_argument("--hidden", type=int, default=64, help="BERT hidden size (default 64)")
    p.add_argument("--layers", type=int, default=2, help="BERT layers (default 2)")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate (default 2e-3)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (default 8)")
    p.add_argument("--corpus-bytes", type=int, default=1_000_000, help="bytes of stdlib source to read (default 1e6)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 master weights")
    args = p.parse_args(argv)

    info = edist.init_distributed()
    torch.manual_seed(0)  # every rank builds the same model
    config = BertConfig(vocab_size=CLS + 1, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                        max_position_embeddings=args.seq + 1, num_labels=2)
    model = BertForSequenceClassification(config)
    corpus = load_corpus(max_bytes=args.corpus_bytes)

    # the simple example: plan, wrap, optimize
    plan = minimum_waste_search(model, info.world_size, verbose=info.is_main)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = ElixirModule(model, plan, dtype=dtype, output_fp32=True)
    optimizer = ElixirOptimizer(model, HybridAdam(model.parameters(), lr=args.lr, weight_decay=0.01), max_norm=1.0)

    before = accuracy(model, corpus.val, args, info.rank, info.world_size)
    gen = torch.Generator().manual_seed(info.rank + 1)
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = labelled_batch(corpus.train, args.batch, args.seq, gen, args.corrupt)
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if info.is_main and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    after = accuracy(model, corpus.val, args, info.rank, info.world_size)
    if info.is_main:
        print(f"validation accuracy: {before:.1%} before, {after:.1%} after {args.steps} steps "
              f"({time.perf_counter() - t0:.0f} s, world size {info.world_size}; chance is 50%)")
    edist.shutdown()


if __name__ == "__main__":
    main()
