"""Train GPT-2 through the Booster API with GeminiPlugin (code written for ColossalAI runs as is).

    torchrun --nproc-per-node 2 --standalone example/booster_gemini.py --steps 20
    torchrun --nproc-per-node 2 --standalone example/booster_gemini.py --small --steps 3   # CI size

The plugin is ``GeminiPlugin(placement_policy="static", offload_optim_frac=1.0)``: every chunk
sharded across the ranks, every fp32 master and Adam state in host memory (on a CPU box that is
where everything lives anyway; on a GPU box the optimizer steps on the host with HybridAdam).
The text is the Python standard library's source tokenised as bytes (``elixir.data``).
"""

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from elixir import distributed as edist
from elixir.booster import Booster, GeminiPlugin
from elixir.data import load_corpus, sample_batch
from elixir.device import peak_rss_bytes
from elixir.optim import HybridAdam


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--small", action="store_true", help="a tiny GPT-2")
    p.add_argument("--save", default=None, help="save model (HF layout) and optimizer here at the end")
    args = p.parse_args()

    info = edist.init_distributed()
    torch.manual_seed(0)
    if args.small:
        config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4)
    else:
        config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=384, n_layer=6, n_head=6)
    model = GPT2LMHeadModel(config)
    optimizer = HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))

    plugin = GeminiPlugin(placement_policy="static", offload_optim_frac=1.0, precision=args.precision, max_norm=1.0)
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, lr_scheduler = booster.boost(model, optimizer, lr_scheduler=lr_scheduler)
    if info.is_main:
        n = sum(p.numel() for p in model.module.parameters())
        print(f"GPT-2 {n / 1e6:.1f}M params on {info.world_size} ranks, GeminiPlugin static, offload_optim_frac=1.0")

    data = load_corpus().train
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = sample_batch(data, args.batch, args.seq, step, rank=info.rank, world_size=info.world_size)
        loss = F.cross_entropy(model(input_ids=x).logits.reshape(-1, config.vocab_size).float(), y.reshape(-1))
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
        if info.is_main:
            print(f"step {step}: loss {loss.item():.4f}")
    if args.save:
        booster.save_model(model, f"{args.save}/model")
        booster.save_optimizer(optimizer, f"{args.save}/optimizer")
    if info.is_main:
        dt = time.perf_counter() - t0
        print(f"{dt / args.steps:.3f} s/step, peak RSS rank 0 {peak_rss_bytes() / 2**20:.0f} MiB")
    edist.shutdown()


if __name__ == "__main__":
    main()
