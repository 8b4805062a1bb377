"""Checkpoint save/load time: elixir.checkpoint (sharded and full) against torch.save/torch.load
and torch.distributed.checkpoint (DCP), same state, same run, world 1.

The state: ``--layers`` x Linear(``--dim``, ``--dim``) wrapped in an ElixirModule with AdamW after
one step (fp32 params plus two moments: 12 bytes per parameter). Every variant fsyncs what it
wrote (elixir does so itself; the peers get an explicit fsync of their files), so the times include
reaching the disk. Median of ``--reps``, variants in turn.

    python bench/checkpoint_io.py            # 24 x 1024^2 (25M params, ~300 MB on disk)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn as nn


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from elixir import checkpoint
    from elixir.search import minimum_waste_search
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)])
    em = ElixirModule(model, minimum_waste_search(model, 1))
    opt = ElixirOptimizer(em, torch.optim.AdamW(em.parameters(), lr=1e-3))
    em(torch.randn(4, args.dim)).pow(2).mean().backward()
    opt.step()
    root = tempfile.mkdtemp(dir=args.dir, prefix="elixir_ckpt_bench_")

    def torch_save():
        p = os.path.join(root, "torch.pt")
        torch.save({"model": em.state_dict(), "optim": opt.state_dict()}, p)
        _fsync_tree(p)

    def torch_load():
        sd = torch.load(os.path.join(root, "torch.pt"), weights_only=True)
        em.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def dcp_save():
        import torch.distributed.checkpoint as dcp

        p = os.path.join(root, "dcp")
        shutil.rmtree(p, ignore_errors=True)
        dcp.save({"model": em.state_dict(), "optim": opt.state_dict()}, checkpoint_id=p)
        _fsync_tree(p)

    def dcp_load():
        import torch.distributed.checkpoint as dcp

        sd = {"model": em.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(root, "dcp"))
        em.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    variants = {
        "elixir sharded": (lambda: checkpoint.save(os.path.join(root, "sharded"), em, opt),
                           lambda: checkpoint.load(os.path.join(root, "sharded"), em, opt), "sharded"),
        "elixir full": (lambda: checkpoint.save(os.path.join(root, "full"), em, opt, shard=False),
                        lambda: checkpoint.load(os.path.join(root, "full"), em, opt), "full"),
        "torch.save/load": (torch_save, torch_load, "torch.pt"),
        "torch DCP": (dcp_save, dcp_load, "dcp"),
    }
    times: dict = {k: ([], []) for k in variants}
    try:
        for _ in range(args.reps):
            for name, (save, load, _) in variants.items():
                for i, fn in enumerate((save, load)):
                    try:
                        t0 = time.perf_counter()
                        fn()
                        times[name][i].append(time.perf_counter() - t0)
                    except Exception as e:  # a peer that does not run here
                        times[name][i].append(float("nan"))
                        print(f"{name}: {type(e).__name__}: {e}")
        n = sum(p.numel() for p in em.parameters())
        table = Table(title=f"checkpoint I/O, {n / 1e6:.1f}M params + AdamW state, world 1, medians of {args.reps}")
        for col in ("variant", "MB on disk", "save s", "save GB/s", "load s", "load GB/s"):
            table.add_column(col, justify="right")
        for name, (_, _, sub) in variants.items():
            size = _size(os.path.join(root, sub)) if os.path.exists(os.path.join(root, sub)) else 0
            s, ld = statistics.median(times[name][0]), statistics.median(times[name][1])
            table.add_row(name, f"{size / 1e6:.0f}", f"{s:.2f}", f"{size / s / 1e9:.2f}", f"{ld:.2f}", f"{size / ld / 1e9:.2f}")
        Console().print(table)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
