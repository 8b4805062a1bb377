"""Train a small GPT-2 with the Lightning Trainer and strategy="elixir".

    python example/lightning_gpt.py                                   # 1 process
    python example/lightning_gpt.py --devices 2 --precision bf16-mixed  # Lightning starts the 2nd rank itself
    python example/lightning_gpt.py --devices 2 --strategy elixir_cpu_offload --accumulate 2 --clip 1.0

The data are random windows of the Python standard library's source (``elixir.data``, byte-level,
nothing downloaded). Importing ``elixir.integrations.lightning`` registers the strategy names;
``--ckpt`` writes an elixir checkpoint directory at the end (resume with ``--resume DIR``).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import elixir.integrations.lightning  # noqa: F401  (registers strategy="elixir" and its variants)
from elixir.data import VOCAB_SIZE, eval_batches, load_corpus, sample_batch


class Windows(torch.utils.data.Dataset):
    """``length`` fixed random windows (input, target) of a byte corpus."""

    def __init__(self, data: torch.Tensor, seq: int, length: int, seed: int) -> None:
        self.x, self.y = sample_batch(data, length, seq, step=0, seed=seed)

    def __len__(self) -> int:
        return self.x.size(0)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class GPT(L.LightningModule):
    def __init__(self, seq: int, hidden: int, layers: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_positions=seq, n_embd=hidden,
                                                n_layer=layers, n_head=max(1, hidden // 64)))

    def forward(self, x):
        return self.model(input_ids=x).logits

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB_SIZE).float(), y.reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, VOCAB_SIZE).float(), y.reshape(-1)), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        return opt


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--devices", type=int, default=1, help="ranks on this node (default 1)")
    p.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"), help="cpu (gloo) or gpu (NCCL); default cpu")
    p.add_argument("--strategy", default="elixir", help="elixir, elixir_cpu_offload, elixir_auto, ... (default elixir)")
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed", "16-mixed", "bf16-true"))
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-step (default 8)")
    p.add_argument("--seq", type=int, default=64, help="sequence length in bytes (default 64)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches (default 1)")
    p.add_argument("--clip", type=float, default=None, help="gradient_clip_val (norm); default none")
    p.add_argument("--ckpt", default=None, help="save an elixir checkpoint directory here at the end")
    p.add_argument("--resume", default=None, help="resume from this checkpoint directory")
    p.add_argument("--corpus-bytes", type=int, default=1_000_000, help="bytes of stdlib source to read (default 1e6)")
    args = p.parse_args(argv)

    L.seed_everything(0, verbose=False)
    corpus = load_corpus(max_bytes=args.corpus_bytes)
    train = Windows(corpus.train, args.seq, length=args.batch * args.devices * args.accumulate * args.steps, seed=1)
    val_x = torch.cat([x for x, _ in eval_batches(corpus.val, args.batch, args.seq, 4)])
    val_y = torch.cat([y for _, y in eval_batches(corpus.val, args.batch, args.seq, 4)])
    val = torch.utils.data.TensorDataset(val_x, val_y)

    trainer = L.Trainer(
        strategy=args.strategy, accelerator=args.accelerator, devices=args.devices, precision=args.precision,
        max_steps=args.steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip,
        logger=False, enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=10,
        val_check_interval=None, check_val_every_n_epoch=1,
    )
    model = GPT(args.seq, args.hidden, args.layers, args.lr)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch, shuffle=True)
    val_loader = torch.utils.data.DataLoader(val, batch_size=args.batch)
    before = trainer.validate(model, val_loader, verbose=False)[0]["val_loss"]
    trainer.fit(model, loader, val_loader, ckpt_path=args.resume)
    after = trainer.validate(model, val_loader, verbose=False)[0]["val_loss"]
    if args.ckpt:
        trainer.save_checkpoint(args.ckpt)
    if trainer.is_global_zero:
        print(f"validation loss: {before:.3f} before, {after:.3f} after {trainer.global_step} steps "
              f"(strategy {args.strategy}, {args.devices} rank(s), {args.precision})")


if __name__ == "__main__":
    main()
