"""``elixir info``: what this installation can do."""

from __future__ import annotations

import argparse
import json
import platform

import torch
from rich.console import Console
from rich.table import Table

from elixir import __version__, _native, device, lowp_gemm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def collect() -> dict:
    return {
        "elixir": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "native_extension": _native.native_available(),
        "native_error": _native.native_error(),
        "simd_level": _native.simd_level(),
        "cpu_features": _native.cpu_features(),
        "cpu_bf16_gemm": lowp_gemm.describe(torch.bfloat16),
        "cpu_fp16_gemm": lowp_gemm.describe(torch.float16),
        "device": device.describe(),
        "cuda_available": torch.cuda.is_available(),
    }


def main(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    table = Table(title="elixir", show_header=False)
    for k, v in info.items():
        if k == "cpu_features":
            v = ", ".join(n for n, on in v.items() if on) or "none"
        table.add_row(k, str(v))
    Console().print(table)
    return 0
