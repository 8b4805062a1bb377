"""ElixirOptimizer.step with fp32 masters and Adam state on disk against the same on host.

One process (world 1), a stack of Linear layers (``--layers`` x ``--dim``^2 params) wrapped in an
ElixirModule with fp32 chunks whose shards live on host; the plan's optimizer placement is HOST
for every chunk, or DISK for the first N (``--disk``). One backward fills the shard gradients,
then ``step()`` (CPUAdam, the fused path) is timed: one warm-up step (creates the state), then the
median of ``--reps``. Variants, in turn, in the same run:

- ``host``: every master and moment in host memory (the reference);
- ``disk N buffered``: N chunks' masters and moments in the offload file through the page cache
  (reads may be served from memory that the kernel still caches);
- ``disk N direct``: the same with ``offload_direct=True`` (O_DIRECT for page-aligned buffers,
  which torch provides for large tensors under ``THP_MEM_ALLOC_ENABLE=1``, set here).

Reported per variant: step seconds, bytes read+written per step, the GB/s that implies, the peak
host bytes staged for disk chunks, and the host bytes of masters+moments the disk chunks saved.

    python bench/disk_offload.py                          # 32 x 2048^2 (134M params)
    python bench/disk_offload.py --layers 8 --disk 4,8 --reps 2
"""

from __future__ import annotations

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # page-aligned large tensors (O_DIRECT-eligible)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def _model(layers: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def _variant(layers: int, dim: int, n_disk: int, direct: bool, reps: int, offload_dir) -> dict:
    from elixir.optim import CPUAdam
    from elixir.plan import Placement
    from elixir.search import minimum_waste_search
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    model = _model(layers, dim)
    plan = minimum_waste_search(model, 1)
    chunks = tuple(
        dataclasses.replace(
            c, shard_placement=Placement.HOST, optim_placement=Placement.DISK if i < n_disk else Placement.HOST
        )
        for i, c in enumerate(plan.chunks)
    )
    em = ElixirModule(model, dataclasses.replace(plan, chunks=chunks), offload_dir=offload_dir, offload_direct=direct)
    opt = ElixirOptimizer(em, CPUAdam(list(em.parameters()), lr=1e-4))
    em(torch.randn(4, dim)).pow(2).mean().backward()
    opt.step()  # warm-up: creates (and, on disk, writes) the moments
    store = em.disk_store
    times, moved = [], []
    for _ in range(reps):
        before = (store.bytes_read + store.bytes_written) if store else 0
        if store is not None:
            store.reset_peak()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        moved.append(((store.bytes_read + store.bytes_written) if store else 0) - before)
    disk_elems = sum(em.chunks[i].spec.shard_numel for i in (store.chunks if store else ()))
    out = {
        "chunks": len(em.chunks),
        "disk": len(store.chunks) if store else 0,
        "step_s": statistics.median(times),
        "moved": statistics.median(moved),
        "peak_staged": store.peak_staged_bytes if store else 0,
        "saved": disk_elems * 12,  # fp32 master + two fp32 moments no longer resident
        "direct": bool(store and store.location.file.direct_fd is not None),
    }
    if store is not None:
        store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--disk", default="", help="comma-separated chunk counts on disk (default: half and all)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--offload-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    params = args.layers * args.dim * args.dim
    host = _variant(args.layers, args.dim, 0, False, args.reps, None)
    counts = [int(x) for x in args.disk.split(",")] if args.disk else sorted({host["chunks"] // 2, host["chunks"]})
    rows = [("host", host)]
    for n in counts:
        for direct in (False, True):
            rows.append((f"disk {n} {'direct' if direct else 'buffered'}", _variant(args.layers, args.dim, n, direct, args.reps, args.offload_dir)))
    table = Table(title=f"ElixirOptimizer.step, {params / 1e6:.1f}M fp32 params, {host['chunks']} chunks, CPUAdam, world 1")
    for col in ("variant", "disk chunks", "step s", "vs host", "moved/step", "GB/s", "peak staged", "host saved"):
        table.add_column(col, justify="right", no_wrap=True)
    for name, r in rows:
        gbps = r["moved"] / r["step_s"] / 1e9 if r["moved"] else 0.0
        table.add_row(
            name + ("" if r["direct"] or "direct" not in name else " (O_DIRECT unavailable)"),
            f"{r['disk']}/{r['chunks']}",
            f"{r['step_s']:.3f}",
            f"{r['step_s'] / host['step_s']:.1f}x",
            f"{r['moved'] / 1e6:.0f} MB",
            f"{gbps:.2f}",
            f"{r['peak_staged'] / 1e6:.0f} MB",
            f"{r['saved'] / 1e6:.0f} MB",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
