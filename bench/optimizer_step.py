"""ElixirOptimizer.step: the fused CPUAdam path against the plain path, same run, same shards.

One process (world 1), a stack of Linear layers (``--layers`` x ``--dim``^2 params) wrapped in an
ElixirModule with bf16 or fp16 compute chunks and fp32 masters; one backward fills the shard
gradients, then ``step()`` is timed (median of ``--reps``) with global-norm clipping on:

- ``plain``: ElixirOptimizer(torch AdamW fused=True): norm pass, one pass scaling the gradients by
  clip/unscale, torch's fused AdamW, then the runtime's master -> compute-shard copy pass;
- ``fused``: ElixirOptimizer(CPUAdam): norm pass, then one kernel pass per fragment that unscales
  and clips (``div_scale``), updates and writes the bf16/fp16 compute shard (``out_lowp``);
- ``torch``: the peer without elixir: ``clip_grad_norm_`` + ``AdamW(fused=True).step()`` + a
  ``_foreach_copy_`` of the params into bf16/fp16 copies, on the same number of parameters.

    python bench/optimizer_step.py                   # 24 x 1024^2 (25M params), bf16 and fp16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn


def _model(layers: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def _interleaved(fns: dict, reps: int) -> dict:
    """Median seconds per call of each fn, calling them in turn (so load drift hits all alike)."""
    for fn in fns.values():
        fn()  # warm-up (state allocation)
    times: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _elixir(kind: str, dtype: torch.dtype, layers: int, dim: int):
    from elixir.optim import CPUAdam
    from elixir.search import minimum_waste_search
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    model = _model(layers, dim)
    em = ElixirModule(model, minimum_waste_search(model, 1), dtype=dtype, output_fp32=True)
    params = list(em.parameters())
    inner = CPUAdam(params, lr=1e-4) if kind == "fused" else torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt = ElixirOptimizer(em, inner, max_norm=1.0, initial_scale=1.0)
    x = torch.randn(8, dim)
    em(x).float().pow(2).mean().backward()
    return opt.step


def _torch(dtype: torch.dtype, layers: int, dim: int):
    model = _model(layers, dim)
    params = list(model.parameters())
    model(torch.randn(8, dim)).pow(2).mean().backward()
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    lowp = [p.detach().to(dtype) for p in params]

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        torch._foreach_copy_(lowp, [p.detach() for p in params])

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from elixir.optim.functional import kernel_level

    n = args.layers * args.dim * args.dim
    table = Table(title=f"ElixirOptimizer.step, {n / 1e6:.1f}M params, clipping on, kernel {kernel_level()}, {torch.get_num_threads()} threads")
    for col in ("compute dtype", "variant", "ms/step", "Mparam/s", "vs torch"):
        table.add_column(col, justify="right")
    for dtype in (torch.bfloat16, torch.float16):
        fns = {"torch": _torch(dtype, args.layers, args.dim)}
        for kind in ("plain", "fused"):
            fns[kind] = _elixir(kind, dtype, args.layers, args.dim)
        times = _interleaved(fns, args.reps)
        t_torch = times["torch"]
        for kind, t in times.items():
            table.add_row(str(dtype).removeprefix("torch."), kind, f"{t * 1e3:.1f}", f"{n / t / 1e6:.0f}", f"{t_torch / t:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
