"""Train a small GPT-2 with the Hugging Face Trainer on elixir (``ElixirTrainer``).

    python example/hf_trainer_gpt.py                                          # 1 process
    torchrun --nproc-per-node 2 --standalone example/hf_trainer_gpt.py --bf16
    torchrun --nproc-per-node 2 --standalone example/hf_trainer_gpt.py --placement cpu --accumulate 2

``ElixirTrainer`` takes the Trainer's own arguments plus ``placement_policy=`` (or ``plan=`` /
``search=``). The data are random windows of the Python standard library's source
(``elixir.data``, byte-level, nothing downloaded). Checkpoints go to ``--out/checkpoint-N``
(``--save-steps``; resume with ``--resume``), and the final model to ``--out/final`` as an ordinary
Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` reads.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from elixir.data import VOCAB_SIZE, eval_batches, load_corpus, sample_batch
from elixir.integrations.transformers import ElixirTrainer


def windows(data: torch.Tensor, seq: int, n: int, seed: int) -> list[dict]:
    x, _ = sample_batch(data, n, seq, step=0, seed=seed)
    return [{"input_ids": row, "labels": row.clone()} for row in x]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", default="hf-trainer-gpt", help="output directory (default ./hf-trainer-gpt)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-step (default 8)")
    p.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps (default 1)")
    p.add_argument("--seq", type=int, default=64, help="sequence length in bytes (default 64)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate (default 2e-3)")
    p.add_argument("--placement", choices=("cuda", "cpu", "auto"), default="cuda", help="elixir placement_policy (default cuda)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 masters")
    p.add_argument("--fp16", action="store_true", help="fp16 compute with fp32 masters and dynamic loss scaling")
    p.add_argument("--save-steps", type=int, default=0, help="save checkpoint-N every N steps (default: only the final model)")
    p.add_argument("--resume", default=None, help="resume from this checkpoint-N directory")
    p.add_argument("--corpus-bytes", type=int, default=1_000_000, help="bytes of stdlib source to read (default 1e6)")
    args = p.parse_args(argv)

    corpus = load_corpus(max_bytes=args.corpus_bytes)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    train = windows(corpus.train, args.seq, args.batch * world * args.accumulate * args.steps, seed=1)
    val = [{"input_ids": x_row, "labels": x_row.clone()}
           for x, _ in eval_batches(corpus.val, args.batch, args.seq, 4) for x_row in x]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=args.seq, n_embd=args.hidden,
                                       n_layer=args.layers, n_head=max(1, args.hidden // 64)))
    targs = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, gradient_accumulation_steps=args.accumulate,
        learning_rate=args.lr, warmup_steps=max(1, args.steps // 10), max_grad_norm=1.0, weight_decay=0.01,
        bf16=args.bf16, fp16=args.fp16, logging_steps=10, report_to=[], disable_tqdm=True,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        use_cpu=not torch.cuda.is_available(), seed=0,
    )
    trainer = ElixirTrainer(model=model, args=targs, train_dataset=train, eval_dataset=val,
                            placement_policy=args.placement)
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=args.resume)
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(args.out, "final"))
    if trainer.is_world_process_zero():
        print(f"validation perplexity: {math.exp(before):.2f} before, {math.exp(after):.2f} after "
              f"{trainer.state.global_step} steps; model saved to {os.path.join(args.out, 'final')}")


if __name__ == "__main__":
    main()
