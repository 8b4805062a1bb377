"""A plain user script, launched by torchrun with no test harness: a few training steps, then exit.

    torchrun --nproc-per-node 2 --standalone tests/torchrun_plain_train.py [--optim hybrid]

It does what the README shows and nothing more: ``dist.init_process_group`` by hand, a plan,
``ElixirModule``/``ElixirOptimizer``, a few steps with prefetching, ``destroy_process_group``, and
a normal interpreter exit (no ``os._exit``). ``tests/test_exit.py`` runs it repeatedly: every run
must end with exit code 0 on every rank, never a native abort at interpreter finalisation.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from elixir.optim import HybridAdam
from elixir.search import minimum_waste_search, optimal_search
from elixir.wrapper import ElixirModule, ElixirOptimizer

VOCAB, WIDTH, SEQ, BATCH = 64, 64, 16, 2


class TinyLM(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(layers)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def step(model, batch) -> torch.Tensor:
    logits = model(batch["ids"])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
    loss.backward()
    return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--optim", choices=["adam", "hybrid"], default="adam")
    p.add_argument("--search", choices=["optimal", "minimum_waste"], default="optimal")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM()
    g = torch.Generator().manual_seed(rank)
    batch = {
        "ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
    }
    if args.search == "optimal":
        # small budgets force sharded chunks, so the runtime gathers (and prefetches) every step
        plan = optimal_search(
            model, world, overlap=True, inp=batch, step_fn=step, device_memory=1 << 20, host_memory=1 << 30
        )
    else:
        plan = minimum_waste_search(model, world, prefetch=True, inp=batch, step_fn=step)
    model = ElixirModule(model, plan, prefetch=True)
    params = [p for p in model.parameters() if p.requires_grad]
    inner = HybridAdam(params, lr=1e-3) if args.optim == "hybrid" else torch.optim.Adam(params, lr=1e-3)
    optimizer = ElixirOptimizer(model, inner)
    for _ in range(args.steps):
        loss = step(model, batch)
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {rank}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
