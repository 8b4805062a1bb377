"""Activation and parameter memory of one OPT-175B training step, on fake tensors (no GPU, no weights).

    python example/activation/opt_profile.py                      # OPT-175B, seq 2048, fp16, batch 1 and 2
    python example/activation/opt_profile.py --model opt-1.3b --batch 1 2 4 8

The model is built on ``torch.device("meta")`` from its config (nothing is downloaded or allocated)
and ``cuda_memory_profiling`` runs one forward + backward on fake tensors, with and without
gradient checkpointing of every layer. Each row gives what the step holds: parameters, gradients
and the activation peak; the activation peak is what checkpointing trades for recomputation.
The same figures come from ``elixir profile opt-175b --batch 1 --seq 2048 --dtype fp16``.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from elixir import models
from elixir.tracer import cuda_memory_profiling

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="opt-175b", help="registry name (elixir profile --list) or config.json (default opt-175b)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2], help="batch sizes to profile (default 1 2)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="training dtype (default fp16)")
    p.add_argument("--no-plain", action="store_true", help="profile only with gradient checkpointing")
    args = p.parse_args(argv)

    console = Console(width=110)
    table = Table(title=f"{args.model}, seq {args.seq}, {args.dtype}: memory of one training step (per replica)")
    for col in ("checkpointing", "batch", "params", "param bytes", "grad bytes", "activation peak", "traced in"):
        table.add_column(col, justify="right")
    for checkpointing in ([False, True] if not args.no_plain else [True]):
        for batch in args.batch:
            model = models.build_model(args.model)  # on meta: no weights
            if checkpointing:
                models.enable_checkpointing(model)
            inp = models.make_batch(model, batch, args.seq)
            t0 = time.perf_counter()
            occ = cuda_memory_profiling(model, inp, models.lm_step_fn, DTYPES[args.dtype])
            n = sum(p.numel() for p in model.parameters())
            table.add_row(
                "yes" if checkpointing else "no", str(batch), f"{n / 1e9:.2f}B", gib(occ["param_occ"]),
                gib(occ["grad_occ"]), gib(occ["activation_occ"]), f"{time.perf_counter() - t0:.1f} s",
            )
    console.print(table)


if __name__ == "__main__":
    main()
