"""Dequantising a frozen NF4 / int8 shard to the compute dtype: elixir's native kernel
(csrc/nf4.cpp) and its torch path (:mod:`elixir.chunk.quant`) against torchao's
``NF4Tensor.get_original_weight`` on the same codes, interleaved round by round so other
processes' noise hits them alike. Also: a plain ``copy_`` of
the output's bytes (what an unquantised bf16 shard costs to gather on one rank), and quantising.

    python bench/nf4_dequant.py                    # 16M elements, bf16, 7 rounds
    python bench/nf4_dequant.py --numel 4e6 --rounds 3 --dtype float32

Prints ns/element (median and best over rounds) and each path's ratio to elixir's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import time
from typing import Callable

import torch

from elixir.chunk.quant import FrozenCodec


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=16 * 2**20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args()
    n, dt = int(a.numel) // 16384 * 16384, getattr(torch, a.dtype)
    torch.manual_seed(0)
    x = (torch.randn(n) * 0.02).to(dt)
    nf4, i8, nf4_torch = FrozenCodec("nf4", n, dt), FrozenCodec("int8", n, dt), FrozenCodec("nf4", n, dt)
    nf4_torch.use_native = False
    t0 = time.perf_counter()
    buf = nf4.encode(x)
    t_enc = time.perf_counter() - t0
    buf8 = i8.encode(x)
    out = torch.empty(n, dtype=dt)
    if nf4.native_kernel(x.device) is None:
        print("native extension not built (or no nf4_decode): the 'elixir nf4' row is the torch path")
    paths: dict[str, Callable[[], object]] = {
        "elixir nf4": lambda: nf4.decode(buf, out),
        "elixir nf4 (torch path)": lambda: nf4_torch.decode(buf, out),
        "elixir int8": lambda: i8.decode(buf8, out),
        "copy_ (unquantised)": lambda: out.copy_(x),
    }
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        ref = to_nf4(x)
        if not torch.equal(ref.get_original_weight(), nf4.decode(buf)) or not torch.equal(nf4_torch.decode(buf), nf4.decode(buf)):
            raise SystemExit("torchao and elixir decode differently: the comparison is void")
        paths["torchao get_original_weight"] = ref.get_original_weight
    except ImportError:
        print("torchao not installed: its row is left out")
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(a.rounds):
        for k, fn in paths.items():
            times[k].append(_time(fn) / n * 1e9)
    base = statistics.median(times["elixir nf4"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, commit {commit}, load {os.getloadavg()[0]:.2f}, "
          f"{n / 2**20:.0f}M elements {a.dtype}, {torch.get_num_threads()} threads, {a.rounds} rounds")
    print(f"{'path':30s} {'ns/el median':>12s} {'best':>8s} {'x elixir nf4':>13s}")
    for k, ts in times.items():
        print(f"{k:30s} {statistics.median(ts):12.3f} {min(ts):8.3f} {statistics.median(ts) / base:13.2f}")
    print(f"elixir nf4 encode (once): {t_enc / n * 1e9:.2f} ns/element")


if __name__ == "__main__":
    main()
