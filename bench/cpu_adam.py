"""CPU Adam step: the native fused kernel against torch's AdamW, on one flat tensor of N params.

Every variant updates the same fp32 master, moments and gradients (as ElixirOptimizer does on a
flat shard), interleaved round by round so that noise from other processes hits all of them alike.
Reported: ms/step (median and best over rounds), Mparam/s, effective GB/s (bytes the update must
move, see BYTES), and the ratio to torch's fused AdamW (median over rounds of the ratio within
each round, where the two ran back to back). Three bandwidth probes run in the same
process: ``copy_`` (read + write), in-place ``mul_`` (read-modify-write), and the roofline probe:
the update's exact traffic (read p g m v, write p m v, fp32) with one add per stream instead of
Adam's arithmetic, split over threads as the kernel splits it. "% roofline" is effective GB/s
over the roofline probe's.

    python bench/cpu_adam.py                     # 100M params, 7 rounds
    python bench/cpu_adam.py --params 20e6 --rounds 3 --markdown
    python bench/cpu_adam.py --params 20e6 --no-loop --baseline /tmp/old/_C.so   # A/B: an older build too

fp32: ours vs torch fused / foreach / for-loop (and DeepSpeedCPUAdam when importable).
Low-precision state (issue 33, ``elixir.optim.lowbit``): one row per (master, moments) format,
fp32 gradients in, its ratio to our fp32 kernel in the same rounds, and the int8-moments/fp32
throughput ratio on its own line (the issue's target: >= 0.9x).
bf16 grads in, bf16 params out, loss scale: ours in one pass vs torch fused plus its casts
(grad bf16->fp32 copy, fused AdamW with ``grad_scale``, param fp32->bf16 copy).
``--baseline PATH``: another build of the extension (``elixir/_C*.so`` built from an older
commit); its int8-moment rows run in the same rounds, on their own copies of the state, so a
kernel change is measured before/after in one invocation.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.machinery
import importlib.util
import statistics
import time
from types import ModuleType
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch.optim.adam import adam as torch_adam

from elixir.optim import functional as F
from elixir.optim import lowbit as L

# Bytes per parameter the update has to move (reads + writes, no write-allocate traffic).
BYTES = {
    "fp32": 16 + 12,  # read p g m v, write p m v
    "bf16": 14 + 14,  # read p m v + bf16 g, write p m v + bf16 copy
    "bf16_torch": 6 + 28 + 4 + 6,  # cast g in; fused step (+ grad_scale writes g back); cast p out
    # low-precision state, fp32 gradients: read p g m v (+ comp), write p m v (+ comp); scales aside
    "fp32/int8": 10 + 6,
    "fp32/bf16": 12 + 8,
    "bf16-sr/int8": 8 + 4,
    "bf16-kahan/bf16": 12 + 8,
}
LOWBIT = (("fp32", "int8"), ("fp32", "bf16"), ("bf16-sr", "int8"), ("bf16-kahan", "bf16"))
BASELINE = (("fp32", "int8"), ("bf16-sr", "int8"))  # the rows --baseline times with the other build
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LOSS_SCALE = 1024.0


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def load_baseline(path: str) -> ModuleType:
    """Another build of ``elixir._C`` (its init function is ``PyInit__C``) under its own name."""
    loader = importlib.machinery.ExtensionFileLoader("elixir_baseline._C", path)
    spec = importlib.util.spec_from_file_location("elixir_baseline._C", path, loader=loader)
    if spec is None:
        raise SystemExit(f"--baseline {path}: not a loadable extension; pass an elixir/_C*.so build")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    if not hasattr(module, "adam_update_lowbit"):
        raise SystemExit(f"--baseline {path}: has no adam_update_lowbit; pass a build with the low-bit kernel")
    return module


@contextlib.contextmanager
def native_module(module: Optional[ModuleType]) -> Iterator[None]:
    """Route elixir.optim.functional's native calls to ``module`` (None: the installed build)."""
    if module is None:
        yield
        return
    saved = F.get_native
    F.get_native = lambda: module
    try:
        yield
    finally:
        F.get_native = saved


class Bench:
    def __init__(self, n: int, baseline: Optional[ModuleType] = None):
        gen = torch.Generator().manual_seed(0)
        self.n = n
        self.p = torch.randn(n, generator=gen) * 0.02
        self.g = torch.randn(n, generator=gen) * 1e-3
        self.m = torch.zeros(n)
        self.v = torch.zeros(n)
        self.g_bf16 = (self.g * LOSS_SCALE).bfloat16()
        self.p_bf16 = torch.empty(n, dtype=torch.bfloat16)
        self.g_buf = torch.empty(n)  # torch's fp32 landing buffer for the cast-in
        self.zeros = torch.zeros(n)  # the roofline probe's "gradient"
        self.low = {}  # (master, moments) -> (master tensor, state)
        for master, moments in LOWBIT:
            self.low[(master, moments)] = (self.p.to(L.master_dtype(master)), L.new_state(n, master, moments))
        self.baseline = baseline
        if baseline is not None:  # its own copies: the two builds' steps do not feed each other
            for master, moments in BASELINE:
                self.low[(master, moments, "baseline")] = (self.p.to(L.master_dtype(master)),
                                                           L.new_state(n, master, moments))
        self.step_t = torch.tensor(0.0)
        self.step = 0
        self.scale_t = torch.tensor(LOSS_SCALE)

    def _next(self) -> int:
        self.step += 1
        self.step_t.fill_(self.step)
        return self.step

    # --- fp32 -------------------------------------------------------------------------------
    def ours_fp32(self) -> None:
        F.adam_step(self.p, self.g, self.m, self.v, step=self._next(), **HYPER)

    def torch_fp32(self, fused: bool, foreach: bool) -> None:
        self._next()
        torch_adam([self.p], [self.g], [self.m], [self.v], [], [self.step_t], foreach=foreach,
                   fused=fused, decoupled_weight_decay=True, amsgrad=False, maximize=False,
                   beta1=HYPER["beta1"], beta2=HYPER["beta2"], lr=HYPER["lr"],
                   weight_decay=HYPER["weight_decay"], eps=HYPER["eps"])  # fmt: skip

    def ours_lowbit(self, master: str, moments: str, baseline: bool = False) -> None:
        p, st = self.low[(master, moments, "baseline") if baseline else (master, moments)]
        step = self._next()
        with native_module(self.baseline if baseline else None):
            F.adam_step_lowbit([p], [self.g], [st], master=master, moments=moments, keys=[L.stream_key(0, 0, step)],
                               offsets=[0], step=step, adamw_mode=True, bias_correction=True, div_scale=1.0, **HYPER)

    # --- bf16 grads in, bf16 params out -----------------------------------------------------
    def ours_bf16(self) -> None:
        F.adam_step(self.p, self.g_bf16, self.m, self.v, step=self._next(), div_scale=LOSS_SCALE,
                    out_lowp=self.p_bf16, **HYPER)  # fmt: skip

    def torch_bf16(self) -> None:
        self._next()
        self.g_buf.copy_(self.g_bf16)
        torch._fused_adamw_([self.p], [self.g_buf], [self.m], [self.v], [], [self.step_t], lr=HYPER["lr"],
                            beta1=HYPER["beta1"], beta2=HYPER["beta2"], weight_decay=HYPER["weight_decay"],
                            eps=HYPER["eps"], amsgrad=False, maximize=False, grad_scale=self.scale_t)  # fmt: skip
        self.p_bf16.copy_(self.p)

    # --- bandwidth probes -------------------------------------------------------------------
    def copy_probe(self) -> None:
        self.g_buf.copy_(self.p)

    def rmw_probe(self) -> None:
        self.m.mul_(1.0)

    def roofline_probe(self) -> None:
        """The update's own traffic (read p g m v, write p m v) with one add per stream."""
        F.get_native().adam_bandwidth_probe(
            [(self.p.data_ptr(), self.zeros.data_ptr(), self.m.data_ptr(), self.v.data_ptr(), 0, self.n)],
            torch.get_num_threads(),
        )  # adds zeros: values stay, traffic is real


def deepspeed_variant(b: Bench):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    except Exception:
        return None
    t0 = time.perf_counter()
    param = torch.nn.Parameter(b.p)
    opt = DeepSpeedCPUAdam([param], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], adamw_mode=True)
    print(f"DeepSpeedCPUAdam ready (JIT build/load {time.perf_counter() - t0:.1f} s)")
    param.grad = b.g

    def step() -> None:
        opt.step()

    return step


def make_variants(b: Bench, loop: bool) -> Dict[str, tuple]:
    """name -> (fn, bytes key, group, peer of the group), in timing order."""
    variants: Dict[str, tuple] = {
        "copy_ probe": (b.copy_probe, None, "probe", None),
        "in-place mul_ probe": (b.rmw_probe, None, "probe", None),
        "roofline probe": (b.roofline_probe, "fp32", "probe", None),
        "torch AdamW fused": (lambda: b.torch_fp32(True, False), "fp32", "fp32", None),
        "elixir CPUAdam kernel": (b.ours_fp32, "fp32", "fp32", "torch AdamW fused"),
        "torch fused + casts": (b.torch_bf16, "bf16_torch", "bf16", None),
        "elixir fused bf16": (b.ours_bf16, "bf16", "bf16", "torch fused + casts"),
    }
    for master, moments in LOWBIT:
        variants[f"elixir {master} master, {moments} moments"] = (
            lambda a=master, m=moments: b.ours_lowbit(a, m), f"{master}/{moments}", "lowbit", "elixir CPUAdam kernel")
    if b.baseline is not None:
        for master, moments in BASELINE:
            variants[f"baseline {master} master, {moments} moments"] = (
                lambda a=master, m=moments: b.ours_lowbit(a, m, baseline=True), f"{master}/{moments}", "lowbit",
                "elixir CPUAdam kernel")
    if loop:
        variants["torch AdamW foreach"] = (lambda: b.torch_fp32(False, True), "fp32", "fp32", None)
        variants["torch AdamW for-loop"] = (lambda: b.torch_fp32(False, False), "fp32", "fp32", None)
    ds = deepspeed_variant(b)
    if ds is not None:
        variants["DeepSpeedCPUAdam"] = (ds, "fp32", "fp32", None)
    return variants


def print_int8_ratio(times: Dict[str, List[float]], baseline: bool) -> None:
    """The issue's target line: int8 moments over the fp32 kernel, paired per round (and the
    baseline build's, with --baseline)."""

    def paired(ref: str, name: str) -> float:
        return statistics.median(a / b for a, b in zip(times[ref], times[name]))

    fp32, int8, base8 = "elixir CPUAdam kernel", "elixir fp32 master, int8 moments", "baseline fp32 master, int8 moments"
    print(f"int8 moments / fp32 kernel throughput (params/s, median of paired rounds): {paired(fp32, int8):.2f}x "
          "(target >= 0.9x)")
    if baseline:
        print(f"  the same with --baseline's build: {paired(fp32, base8):.2f}x; this build over the baseline, int8 "
              f"params/s: {paired(base8, int8):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6, help="number of parameters (one flat tensor)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (each variant once per round)")
    ap.add_argument("--slow-rounds", type=int, default=2, help="rounds for the slow peers (foreach, for-loop)")
    ap.add_argument("--loop", action="store_true", help="also time torch's for-loop and foreach (slow)")
    ap.add_argument("--no-loop", dest="loop", action="store_false")
    ap.add_argument("--markdown", action="store_true", help="print rows for docs/benchmarks.md")
    ap.add_argument("--baseline", metavar="SO", help="another build of elixir/_C*.so: its int8 rows in the same rounds")
    ap.set_defaults(loop=True)
    args = ap.parse_args()

    n = int(args.params)
    b = Bench(n, load_baseline(args.baseline) if args.baseline else None)
    variants = make_variants(b, args.loop)

    print(f"{n / 1e6:.0f}M params, {torch.get_num_threads()} threads, kernel {F.kernel_level()}, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")  # fmt: skip
    for fn, *_ in variants.values():  # warm up (page faults, lazy init)
        fn()
    times: Dict[str, List[float]] = {k: [] for k in variants}
    slow = {"torch AdamW foreach", "torch AdamW for-loop", "DeepSpeedCPUAdam"}
    order = list(variants)
    for r in range(args.rounds):
        # Alternate the order so drift in the background load hits every variant alike; the slow
        # peers run in the first rounds only.
        for name in order if r % 2 == 0 else order[::-1]:
            if name in slow and r >= args.slow_rounds:
                continue
            times[name].append(timed(variants[name][0]))

    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    copy_gbs = 2 * 4 * n / med["copy_ probe"] / 1e9
    rmw_gbs = 2 * 4 * n / med["in-place mul_ probe"] / 1e9
    roof_gbs = BYTES["fp32"] * n / med["roofline probe"] / 1e9

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"CPU Adam, {n / 1e6:.0f}M params (median / best of {args.rounds} rounds)")
    for col in ("variant", "ms/step med", "ms/step best", "Mparam/s", "GB/s", "% roofline", "vs torch fused*"):
        table.add_column(col, justify="right" if col != "variant" else "left")
    rows = []
    fused_ref = {"fp32": "torch AdamW fused", "bf16": "torch fused + casts", "lowbit": "elixir CPUAdam kernel"}
    for name, (_, bkey, group, _peer) in variants.items():
        t_med, t_best = med[name], best[name]
        if group == "probe":
            gbs = (BYTES[bkey] if bkey else 2 * 4) * n / t_med / 1e9
            cells = [f"{t_med * 1e3:.1f}", f"{t_best * 1e3:.1f}", "", f"{gbs:.1f}", "", ""]
        else:
            gbs = BYTES[bkey] * n / t_med / 1e9
            ref = times[fused_ref[group]]
            # Paired per round (neighbours in time share the background load), then the median.
            ratio = statistics.median(a / b for a, b in zip(ref, times[name]))
            cells = [f"{t_med * 1e3:.1f}", f"{t_best * 1e3:.1f}", f"{n / t_med / 1e6:.0f}", f"{gbs:.1f}",
                     f"{100 * gbs / roof_gbs:.0f}%", f"{ratio:.2f}x"]  # fmt: skip
        table.add_row(name, *cells)
        rows.append((name, cells))
    Console(width=150).print(table)
    print("* low-precision rows: vs elixir's fp32 kernel (elixir CPUAdam kernel), paired per round")
    print_int8_ratio(times, b.baseline is not None)
    print(f"bandwidth probes (median): copy_ {copy_gbs:.1f} GB/s, in-place mul_ {rmw_gbs:.1f} GB/s, "
          f"roofline (the update's traffic, no math) {roof_gbs:.1f} GB/s; "
          f"effective GB/s counts {BYTES['fp32']} B/param fp32, {BYTES['bf16']} ours bf16, "
          f"{BYTES['bf16_torch']} torch bf16 pipeline")  # fmt: skip
    if args.markdown:
        date = datetime.date.today().isoformat()
        for name, cells in rows:
            print(f"| {date} | 2-core EPYC | {n / 1e6:.0f}M | {name} | {cells[0]} (best {cells[1]}) | {cells[2]} "
                  f"| {cells[3]} | {cells[5]} |")  # fmt: skip


if __name__ == "__main__":
    main()
