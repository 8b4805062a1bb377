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
    python bench/memory_breakdown.py --grad-dtype float32 --fused-step off   # the old behaviour

The same run also prints the plan's predicted peak (device + host; on a CPU box they are one pool)
against the measured peak RSS: the check of issue 21's "predictions hold".
"""

from __future__ import annotations

import argparse
import gc
import json
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
    """Samples RSS on a thread; ``phase(name)`` closes the previous phase with its peak.

    With a ``probe`` set (a function returning a dict of byte counts), each new highest RSS
    since the probe was set calls it on the sampler thread, so ``at_peak`` holds what the runtime
    accounted for at (within a sample of) the moment of the peak."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.peak = rss_bytes()
        self.phases: list[tuple[str, int, int]] = []  # (name, peak, end rss)
        self.overall = self.peak
        self._name = "start"
        self.probe = None
        self.at_peak: dict = {}
        self._top = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            r = rss_bytes()
            if r > self.peak:
                self.peak = r
            probe = self.probe
            if probe is not None and r > self._top:
                self._top = r
                try:
                    snap = probe()
                except RuntimeError:  # a dict changed size while copied: take the next sample
                    snap = None
                if snap is not None:
                    self.at_peak = dict(snap, rss=r, phase=self._name)
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


def build(hidden: int, inter: int, layers: int, vocab: int, seq: int, meta: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      max_position_embeddings=seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    if meta:  # as bench/capacity.py: ElixirModule materialises one chunk at a time
        with torch.device("meta"):
            return LlamaForCausalLM(cfg), cfg
    return LlamaForCausalLM(cfg), cfg


def tightest_budget(model, inp: dict, step_fn, dtype, disk: int, keep_shards: bool) -> int:
    """The least one-pool budget (device = host, as on a CPU box) under which ``optimal_search``
    plans ``model`` (to 0.5%), traced once: with ``keep_shards`` the least under which every
    compute shard stays resident (the optimizer state goes to disk first: ``DK``/``HK``), else the
    least at all (the least-used shards go to disk too: ``KK``)."""
    from elixir import device as dev
    from elixir.hardware import choose_default_profile
    from elixir.search import DoesNotFitError
    from elixir.search.optimal import search_profile
    from elixir.search.step_profile import profile_step

    prof = profile_step(model, inp, step_fn, dtype)
    own = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
              if t.device.type == "cpu")
    on_host = not dev.is_accelerator(dev.default_device())  # as optimal_search measures it
    hw, _ = choose_default_profile()  # as optimal_search prices the step's growth by default
    process = max(0, rss_bytes() - own) + hw.step_extra_bytes(prof.activation_bytes, on_host)

    def fits(budget: int) -> bool:
        try:
            plan = search_profile(prof, 1, device_memory=budget, host_memory=budget, disk=disk,
                                  optimizer_type="HybridAdam", process_bytes=process)
        except DoesNotFitError:
            return False
        return not (keep_shards and any(c.shard_placement.value == "disk" for c in plan.chunks))

    lo, hi = 0, GiB
    while not fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40:
            raise SystemExit("no budget up to 1 TiB plans this model")
    while hi - lo > hi // 200:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def ledger_probe(em, opt):
    """What the runtime accounts for now: the ledger's categories, the optimizer's resident state
    (a disk chunk's while staged), and the staged bytes of the disk stores (masters + moments;
    KK shards), for :class:`RssSampler` at the peak."""
    def probe() -> dict:
        out = {f"{c}@{loc}": n for (c, loc), n in list(em.ledger.current.items()) if n}
        out["optimizer_state"] = opt._memory_report()["optimizer_state_bytes"]
        store = em.disk_store
        out["disk_staged (master+state)"] = store.staged_bytes if store is not None else 0
        out["disk_staged_shards"] = sum(s.staged_bytes for s in (em.shard_store, em.derived_shards) if s is not None)
        if os.environ.get("ELIXIR_BENCH_PEAK_STACK"):  # where the main thread is at the peak
            import sys
            import traceback
            frame = sys._current_frames().get(threading.main_thread().ident)
            out["stack"] = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                            for f in traceback.extract_stack(frame)[-8:]] if frame is not None else []
            out["staged_chunks"] = sorted(i for i, r in store.chunks.items() if r.state.value != "offloaded") if store else []
        return out
    return probe


def print_at_peak(at_peak: dict, base: int, predicted: dict) -> None:
    """The moment of the training peak: RSS, what the ledger and stores held, the process before
    the model, and what is left (activations, autograd's parameter gradients, transient copies,
    allocator slack), beside the prediction's terms."""
    if not at_peak:
        return
    rss = at_peak["rss"]
    ledger = {k: v for k, v in at_peak.items() if "@" in k}
    staged = at_peak.get("disk_staged (master+state)", 0)
    state = at_peak.get("optimizer_state", 0)  # resident, staged disk state included
    held = sum(v for v in ledger.values()) + state
    print(f"at the training peak ({at_peak['phase']}): RSS {_fmt(rss)} GiB")
    for k, v in sorted(ledger.items()):
        print(f"  {'ledger ' + k:>34} {_fmt(v)}")
    print(f"  {'optimizer state (staged included)':>34} {_fmt(state)}")
    print(f"  {'disk staged: master+state':>34} {_fmt(staged)}  (master in the ledger, state above)")
    print(f"  {'disk staged: shards (KK)':>34} {_fmt(at_peak.get('disk_staged_shards', 0))}  (in ledger shard@host)")
    print(f"  {'process before the model':>34} {_fmt(base)}")
    print(f"  {'rest: activations, transients':>34} {_fmt(rss - held - base)}")
    if at_peak.get("stack"):
        print("  main thread at the peak:", " <- ".join(reversed(at_peak["stack"])), "staged", at_peak["staged_chunks"])
    print("predicted terms (GiB):")
    for k, v in predicted.items():
        print(f"  {k:>34} {_fmt(v)}")
    print(f"  {'sum':>34} {_fmt(sum(v for k, v in predicted.items() if k != 'frozen_shards'))}")


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
    ap.add_argument("--disk-plan", default="none", choices=("none", "state", "shards"),
                    help="plan under the tightest one-pool budget (device = host) that still plans, instead of "
                         "--device-memory/--host-memory: 'state' the least that keeps every compute shard "
                         "resident (optimizer state on disk: DK/HK), 'shards' the least at all (shards on "
                         "disk too: KK)")
    ap.add_argument("--plan", default=None, help="run this saved plan instead of searching")
    ap.add_argument("--save-plan", default=None, help="save the plan the search made here")
    ap.add_argument("--separate-step", action="store_true",
                    help="step after backward even if the plan fuses it (the speed comparison)")
    ap.add_argument("--meta", action="store_true",
                    help="build the model on the meta device (as bench/capacity.py): no eager fp32 copy")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args(argv)

    from elixir.optim import HybridAdam
    from elixir.search import SearchResult, optimal_search
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    dtype = getattr(torch, args.dtype)
    inter = args.inter or int(round(hidden_mult(args.hidden) / 64)) * 64
    sampler = RssSampler()
    base = rss_bytes()
    model, cfg = build(args.hidden, inter, args.layers, args.vocab, args.seq, meta=args.meta)
    n_params = sum(p.numel() for p in model.parameters())
    sampler.phase("plan")
    dev_b = int(args.device_memory * GiB) or int(n_params * 3.5) + 2**28
    host_b = int(args.host_memory * GiB) or int(n_params * 5.5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    def step_fn(m, b):
        m(**b).loss.backward()

    inp = {"input_ids": ids.to("meta"), "labels": ids.to("meta")}
    if args.disk_plan != "none" and not args.plan:
        # 3% above the least: optimal_search measures the process again, some MiB apart
        dev_b = host_b = int(tightest_budget(model, inp, step_fn, dtype, int(args.disk * GiB),
                                             keep_shards=args.disk_plan == "state") * 1.03)
    if args.plan:
        plan = SearchResult.load(args.plan)
    else:  # the eager model: the search counts this process's RSS less the model as its baseline
        plan = optimal_search(model, 1, unified_dtype=dtype, optimizer_type="HybridAdam",
                              inp=inp, step_fn=step_fn,
                              device_memory=dev_b, host_memory=host_b, disk=int(args.disk * GiB),
                              grad_dtype=None if args.grad_dtype == "auto" else getattr(torch, args.grad_dtype),
                              fused_step=None if args.fused_step == "auto" else args.fused_step == "on")
        if args.save_plan:
            plan.save(args.save_plan)
    sampler.phase("wrap")
    em = ElixirModule(model, plan, dtype=dtype, offload_dir=args.offload_dir)
    opt = ElixirOptimizer(em, HybridAdam(list(em.parameters()), lr=1e-4),
                          fused_step=False if args.separate_step else None)
    gc.collect()
    wrapped = rss_bytes()
    sampler.probe = ledger_probe(em, opt)
    after_bwd, after_step, times, losses = [], [], [], []
    for s in range(args.steps):
        em.reset_peak_memory()
        t0 = time.perf_counter()
        sampler.phase(f"fwd{s}")
        loss = em(input_ids=ids, labels=ids).loss
        sampler.phase(f"bwd{s}")
        loss.backward()
        after_bwd.append(em.memory_report())
        sampler.phase(f"opt{s}")
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        after_step.append(em.memory_report())
    sampler.stop()
    pred = plan.prediction
    kinds: dict[str, int] = {}
    for c in plan.chunks:
        k = ("" if c.sharded else "R") + "".join({"device": "D", "host": "H", "disk": "K"}[p.value]
                                                   for p in (c.shard_placement, c.optim_placement))
        kinds[k] = kinds.get(k, 0) + 1
    fused = opt.backward_step is not None
    print(f"model {n_params / 1e6:.1f}M params, {args.dtype}, batch {args.batch} x seq {args.seq}; "
          f"plan {plan.chunk_size:,} el/chunk, {kinds}, {plan.cache_blocks} blocks, grads {plan.grad_dtype}, "
          f"fused step {fused}")
    print(f"budgets device {dev_b / GiB:.2f} GiB host {host_b / GiB:.2f} GiB; RSS at start {base / GiB:.3f} GiB, "
          f"after wrap {wrapped / GiB:.3f} GiB")
    print("losses:", [round(x, 4) for x in losses])
    print("step times (s):", [round(t, 2) for t in times], f"predicted {pred.step_time_s:.2f}")
    print(f"{'phase':>8} {'peak GiB':>9} {'end GiB':>9}")
    for name, peak, end in sampler.phases:
        print(f"{name:>8} {_fmt(peak)}   {_fmt(end)}")
    print(f"{'memory_report() GiB':>28} {'after bwd':>9} {'after step':>10}")
    for k in after_step[-1]:
        if k.endswith("element_bytes"):
            print(f"{k:>28} {after_bwd[-1][k]:9d} {after_step[-1][k]:10d}")
        else:
            print(f"{k:>28} {_fmt(after_bwd[-1][k])}   {_fmt(after_step[-1][k])}")
    # training peak: from the first forward on. Building the model eagerly in fp32 and wrapping
    # it peaks separately (the model plus the chunks being filled); meta-device construction
    # removes that peak, and the search does not predict it.
    measured = max(peak for name, peak, _ in sampler.phases if name[:3] in ("fwd", "bwd", "opt"))
    build_peak = max(peak for name, peak, _ in sampler.phases if name[:3] not in ("fwd", "bwd", "opt"))
    predicted = pred.peak_device_bytes + pred.peak_host_bytes
    print(f"predicted peak device+host {_fmt(predicted)} GiB ({_fmt(pred.peak_device_bytes)} + "
          f"{_fmt(pred.peak_host_bytes)}); measured training peak RSS {_fmt(measured)} GiB; ratio "
          f"{measured / predicted:.3f} (construction peak {_fmt(build_peak)} GiB)")
    print_at_peak(sampler.at_peak, base, plan.info["predicted_memory"])
    print("meminfo (GiB):", {k: round(v / GiB, 3) for k, v in meminfo().items()})
    steady = after_step[-1]["rss_bytes"]
    out = {"params": n_params, "predicted": predicted, "measured": measured, "build_peak": build_peak, "steady_rss": steady,
           "bytes_per_param": steady / n_params, "step_s": times, "predicted_step_s": pred.step_time_s,
           "losses": losses, "plan": kinds, "grad_dtype": plan.grad_dtype, "fused": fused,
           "at_peak": sampler.at_peak, "base_rss": base, "predicted_terms": plan.info["predicted_memory"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    if em.disk_store is not None:
        em.disk_store.close()
    return out


def hidden_mult(h: int) -> float:
    return 8 * h / 3


if __name__ == "__main__":
    main()
