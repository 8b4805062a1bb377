"""Where the bytes go: the runtime's ledger beside the process RSS over real training steps.

One process (world 1, so device and host are one pool on a CPU box), a LLaMA-style model built from
a config, planned by ``optimal_search`` under device/host/disk budgets (by default small enough
that most optimizer state goes to disk), wrapped, and trained for ``--steps`` steps with HybridAdam.
A sampler thread reads ``/proc/self/statm`` every millisecond or so; each phase (construction,
forward, backward, optimizer step) reports its peak RSS, and the ledger's categories
(``ElixirModule.memory_report()``) are printed beside it, with the process baseline (Python, torch,
the model's non-chunked tensors) and the gap that is left.

    python bench/memory_breakdown.py                                # ~150M params, bf16
    python bench/memory_breakdown.py --hidden 512 --layers 8 --steps 2
    python bench/memory_breakdown.py --grad-dtype bfloat16 --fused-step   # the byte-saving options

The same run also prints the plan's predicted peak (device + host; on a CPU box they are one pool)
against the measured peak RSS: the check of issue 21's "predictions hold".
"""

from __future__ import annotations

import argparse
import gc
import os
import threading
import time
from typing import Optional

import torch

GiB = 2**30
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def meminfo(keys=("Dirty", "Writeback", "Cached")) -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


class RssSampler:
    """Samples RSS on a thread; ``phase(name)`` closes the previous phase with its peak."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.peak = rss_bytes()
        self.phases: list[tuple[str, int, int]] = []  # (name, peak, end rss)
        self.overall = self.peak
        self._name = "start"
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            r = rss_bytes()
            if r > self.peak:
                self.peak = r
            time.sleep(self.period)

    def phase(self, name: str) -> None:
        r = rss_bytes()
        self.peak = max(self.peak, r)
        self.phases.append((self._name, self.peak, r))
        self.overall = max(self.overall, self.peak)
        self._name = name
        self.peak = r

    def stop(self) -> None:
        self.phase("end")
        self._stop.set()
        self._t.join()


def build(hidden: int, inter: int, layers: int, vocab: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      max_position_embeddings=seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg), cfg


def _fmt(n: float) -> str:
    return f"{n / GiB:7.3f}"


def main(argv: Optional[list] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=0, help="MLP width (default 8/3 hidden, rounded)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device-memory", type=float, default=0.0, help="GiB (default: 3.5 bytes per parameter + 256 MiB, the shape of issue 21's 2B run)")
    ap.add_argument("--host-memory", type=float, default=0.0, help="GiB (default: 5.5 bytes per parameter)")
    ap.add_argument("--disk", type=float, default=64.0, help="GiB")
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--grad-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="shard-gradient dtype (auto: the search chooses)")
    ap.add_argument("--fused-step", default="auto", choices=("auto", "on", "off"),
                    help="step each chunk during backward (auto: the search chooses)")
    ap.add_argument("--trim", action="store_true")
    ap.add_argument("--meta", action="store_true", help="build the model on meta (needs meta-init support)")
    args = ap.parse_args(argv)

    from elixir.optim import HybridAdam
    from elixir.search import optimal_search
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    dtype = getattr(torch, args.dtype)
    inter = args.inter or int(round(hidden_mult(args.hidden) / 64)) * 64
    sampler = RssSampler()
    base = rss_bytes()
    model, cfg = build(args.hidden, inter, args.layers, args.vocab, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    sampler.phase("plan")
    dev_b = int(args.device_memory * GiB) or int(n_params * 3.5) + 2**28
    host_b = int(args.host_memory * GiB) or int(n_params * 5.5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    meta_inp = {"input_ids": ids.to("meta"), "labels": ids.to("meta")}

    def step_fn(m, b):
        m(**b).loss.backward()

    with torch.device("meta"):
        meta_model, _ = build(args.hidden, inter, args.layers, args.vocab, args.seq)
    plan = optimal_search(meta_model, 1, unified_dtype=dtype, optimizer_type="HybridAdam", inp=meta_inp,
                          step_fn=step_fn, device_memory=dev_b, host_memory=host_b, disk=int(args.disk * GiB),
                          grad_dtype=None if args.grad_dtype == "auto" else getattr(torch, args.grad_dtype),
                          fused_step=None if args.fused_step == "auto" else args.fused_step == "on")
    del meta_model
    sampler.phase("wrap")
    em = ElixirModule(model, plan, dtype=dtype, offload_dir=args.offload_dir)
    opt = ElixirOptimizer(em, HybridAdam(list(em.parameters()), lr=1e-4))
    gc.collect()
    wrapped = rss_bytes()
    reports, times = [], []
    for s in range(args.steps):
        em.reset_peak_memory()
        t0 = time.perf_counter()
        sampler.phase(f"fwd{s}")
        loss = em(input_ids=ids, labels=ids).loss
        sampler.phase(f"bwd{s}")
        loss.backward()
        sampler.phase(f"opt{s}")
        opt.step()
        opt.zero_grad()
        if args.trim:
            from elixir import device as dev
            dev.release_free_host_memory()
        times.append(time.perf_counter() - t0)
        reports.append(em.memory_report())
    print("step times:", [round(t, 2) for t in times])
    sampler.stop()
    pred = plan.prediction
    kinds = {}
    for c in plan.chunks:
        k = ("S" if c.sharded else "R") + c.shard_placement.value[0] + c.optim_placement.value[0]
        kinds[k] = kinds.get(k, 0) + 1
    print(f"model {n_params / 1e6:.1f}M params, {args.dtype}, batch {args.batch} x seq {args.seq}; "
          f"plan {plan.chunk_size:,} el/chunk, {kinds}, {plan.cache_blocks} blocks, grads {plan.grad_dtype}, "
          f"fused step {plan.fused_step}")
    print(f"budgets device {dev_b / GiB:.2f} GiB host {host_b / GiB:.2f} GiB; baseline RSS {base / GiB:.3f} GiB, "
          f"after wrap {wrapped / GiB:.3f} GiB")
    print(f"{'phase':>8} {'peak GiB':>9} {'end GiB':>9}")
    for name, peak, end in sampler.phases:
        print(f"{name:>8} {_fmt(peak)}   {_fmt(end)}")
    last = reports[-1]
    print("ledger (last step):")
    for k, v in last.items():
        print(f"  {k:>28} {_fmt(v)}")
    measured = sampler.overall
    predicted = pred.peak_device_bytes + pred.peak_host_bytes
    print(f"predicted peak device+host {_fmt(predicted)} GiB ({_fmt(pred.peak_device_bytes)} + "
          f"{_fmt(pred.peak_host_bytes)}); measured peak RSS {_fmt(measured)} GiB; ratio {measured / predicted:.3f}")
    print("predicted memory terms:", {k: round(v / GiB, 3) for k, v in plan.info["predicted_memory"].items()})
    print("meminfo:", {k: round(v / GiB, 3) for k, v in meminfo().items()})
    return {"params": n_params, "predicted": predicted, "measured": measured}


def hidden_mult(h: int) -> float:
    return 8 * h / 3


if __name__ == "__main__":
    main()
