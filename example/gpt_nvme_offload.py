"""Train GPT-2 on the CPU with HybridAdam keeping its optimizer state on disk (NVMe offload).

    python example/gpt_nvme_offload.py --fraction 0.0      # moments in memory
    python example/gpt_nvme_offload.py --fraction 1.0      # moments in files under --dir
    python example/gpt_nvme_offload.py --small --steps 3   # a tiny config (what CI runs)

No wrapper: plain PyTorch training with ``HybridAdam(..., nvme_offload_fraction=f,
nvme_offload_dir=d)``. Each step reads the moments ahead, updates and writes them behind, two
buckets in memory at most; the results are bitwise those of ``--fraction 0.0``. Run the two
fractions as separate processes and compare the printed peak RSS: GPT-2 small's moments are about
1 GB. The files are private to the run and gone when it ends. The text is the Python standard
library's source (``elixir.data``), tokenised as bytes, so nothing is downloaded.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from elixir.data import load_corpus, sample_batch
from elixir.device import peak_rss_bytes
from elixir.optim import HybridAdam


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fraction", type=float, default=1.0, help="nvme_offload_fraction")
    p.add_argument("--dir", default=None, help="nvme_offload_dir (default: a private temp dir)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--small", action="store_true", help="a tiny GPT-2 instead of GPT-2 small (124M)")
    args = p.parse_args()

    torch.manual_seed(0)
    if args.small:
        config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4)
    else:  # GPT-2 small's shape; byte-level data uses the first 256 token ids
        config = GPT2Config(n_positions=max(args.seq, 1024), n_embd=768, n_layer=12, n_head=12)
    model = GPT2LMHeadModel(config)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e6:.1f}M parameters ({n * 4 / 2**20:.0f} MiB fp32), moments {n * 8 / 2**20:.0f} MiB")
    optimizer = HybridAdam(model.parameters(), lr=1e-3, nvme_offload_fraction=args.fraction, nvme_offload_dir=args.dir)

    data = load_corpus().train
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = sample_batch(data, args.batch, args.seq, step)
        loss = F.cross_entropy(model(input_ids=x).logits.reshape(-1, config.vocab_size), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")
    elapsed = time.perf_counter() - t0
    on_disk = optimizer.nvme.offloaded_bytes if optimizer.nvme is not None else 0
    print(f"fraction {args.fraction}: {elapsed:.2f} s ({elapsed / args.steps:.3f} s/step), "
          f"moments on disk {on_disk / 2**20:.0f} MiB, peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
