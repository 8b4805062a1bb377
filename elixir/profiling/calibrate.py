"""Calibrate a hardware profile against the runtime itself, on the machine it describes.

:mod:`elixir.profiling.measurement` measures each resource alone: a matmul, a memcpy, one collective, one
optimizer update. A training step uses them together: on a CPU box the ranks of a node share
cores, memory bandwidth and caches, collectives wait for the slowest rank, and the runtime adds
its own bookkeeping. This module runs the real runtime (``ElixirModule`` + ``ElixirOptimizer``)
for a few steps on a small reference model that ships with elixir (a plain-torch transformer, not
one of the models the search is later used on), times each component of the step, and compares
with what the cost model predicts for that same plan from the uncalibrated profile. The ratios
(measured / predicted, per component, per number of ranks per node) are stored in the profile
(:attr:`~elixir.hardware.HardwareProfile.calibration`) and applied by
:meth:`~elixir.hardware.HardwareProfile.per_rank`.

Nothing here is a constant: every factor is a measurement of this machine, and the machine's
profile records where it came from. Run as part of ``elixir hwprofile`` (``--no-calibrate`` skips).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from elixir import device as dev
from elixir import distributed as edist
from elixir.launch import run_distributed
from elixir.optim import HybridAdam
from elixir.plan import MeshLayout, SearchResult
from elixir.profiling.measurement import local_backend
from elixir.search import minimum_waste_search
from elixir.search.cost_model import Setting, evaluate_plan
from elixir.search.optimal import search_profile
from elixir.search.step_profile import profile_step
from elixir.tracer.op_costs import OpCosts
from elixir.wrapper import ElixirModule, ElixirOptimizer

__all__ = ["Calibration", "ReferenceLM", "calibrate", "timed_collectives"]

VOCAB, LAYERS, BATCH = 4096, 3, 2
# (width, heads, seq, layers) of the compute fit: small, overhead-bound sizes to a larger,
# throughput-bound one, and layer counts that change the number of ops at one width (every size
# of one layer count dispatches the same ops), so the fixed cost per op and the throughput factor
# are told apart by more than one pair of runs. The last is the largest: the collectives, the
# overlap and the bf16 factor are measured there.
SIZES = ((96, 2, 32, 3), (96, 2, 32, 9), (192, 3, 96, 3), (320, 5, 160, 3))


class _Block(nn.Module):
    """Pre-norm attention (``scaled_dot_product_attention``, causal) and a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class ReferenceLM(nn.Module):
    """A small pre-norm transformer language model in plain torch (the calibration workload)."""

    def __init__(self, width: int, heads: int, seq: int, vocab: int = VOCAB, layers: int = LAYERS) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def reference_model(size: tuple) -> ReferenceLM:
    """The reference model of one of :data:`SIZES` (width, heads, seq, layers)."""
    width, heads, seq, *layers = size
    return ReferenceLM(width, heads, seq, layers=layers[0] if layers else LAYERS)


def _batch(step: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def _step_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    loss = model(**batch)
    loss.backward()
    return loss


@dataclass
class _Clock:
    """Time spent in collectives. On CPU the host clock around each call (and the ``wait`` of an
    asynchronous one): the host blocks there. On an accelerator the host only queues a
    collective (NCCL returns at once, and ``wait`` orders a stream, not the host), so host time
    comes out near zero: there each collective is bracketed by timing events on the device
    (:func:`elixir.device.timing_event`) and :attr:`seconds` sums their elapsed device time once
    the device is synchronised."""

    host_seconds: float = 0.0
    calls: int = 0
    device: Optional[torch.device] = None
    pairs: list = dataclasses.field(default_factory=list)  # (start, end) device timing events
    # host seconds from each call to the end of its wait (a blocking call: its duration), summed
    # per collective. Without prefetch a gather is waited on at once, so its span is its whole
    # time; the other totals show an asynchronous collective's wait only
    span_seconds: dict = dataclasses.field(default_factory=dict)

    def add_span(self, name: str, started: tuple[float, Any]) -> None:
        if started[1] is None:
            self.span_seconds[name] = self.span_seconds.get(name, 0.0) + time.perf_counter() - started[0]

    @property
    def seconds(self) -> float:
        if not self.pairs:
            return self.host_seconds
        dev.synchronize(self.device)
        return self.host_seconds + sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3

    def start(self) -> tuple[float, Any]:
        if self.device is None:
            return time.perf_counter(), None
        ev = dev.timing_event(self.device)
        ev.record(dev.current_stream(self.device))
        return 0.0, ev

    def stop(self, started: tuple[float, Any]) -> None:
        t0, ev = started
        if ev is None:
            self.host_seconds += time.perf_counter() - t0
            return
        end = dev.timing_event(self.device)
        end.record(dev.current_stream(self.device))  # after the collective, on the stream that waits for it
        self.pairs.append((ev, end))


class _TimedWork:
    """A collective's work handle whose ``wait`` is timed (on an accelerator: from the issue to
    the stream that waits for it being ordered after it)."""

    def __init__(self, work: Any, clock: _Clock, started: tuple[float, Any], name: str) -> None:
        self._work, self._clock, self._started, self._name = work, clock, started, name

    def wait(self, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait(*a, **k)
        finally:
            if self._started[1] is None:
                self._clock.host_seconds += time.perf_counter() - t0
                self._clock.add_span(self._name, self._started)
            else:
                self._clock.stop(self._started)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def timed_collectives(device: Optional[torch.device] = None) -> Iterator[_Clock]:
    """Time every all-gather, reduce-scatter and all-reduce elixir issues inside the block (the
    call, plus ``wait`` on an asynchronous one): by the host clock on CPU, by device timing
    events on an accelerator (``device``, default the process's device)."""
    device = dev.as_device(device)
    clock = _Clock(device=device if dev.is_accelerator(device) else None)
    names = ("all_gather_into", "reduce_scatter_into", "all_reduce")
    saved = {n: getattr(edist, n) for n in names}

    def wrap(fn: Any, name: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            started = clock.start()
            out = fn(*a, **k)
            clock.calls += 1
            if out is not None and hasattr(out, "wait"):
                if started[1] is None:
                    clock.host_seconds += time.perf_counter() - started[0]
                return _TimedWork(out, clock, started, name)
            clock.add_span(name, started)
            clock.stop(started)
            return out
        return timed

    try:
        for n in names:
            setattr(edist, n, wrap(saved[n], n))
        yield clock
    finally:
        for n, fn in saved.items():
            setattr(edist, n, fn)


def _train(size: tuple, plan_json: dict, dtype: str, prefetch: bool) -> tuple:
    torch.manual_seed(0)
    model = reference_model(size)
    em = ElixirModule(model, SearchResult.from_json(plan_json), prefetch=prefetch, dtype=getattr(torch, dtype))
    return em, ElixirOptimizer(em, HybridAdam(model.parameters(), lr=1e-4))  # CPUAdam's kernel on CPU


def _timed_step(em: Any, opt: Any, batch: dict) -> tuple[float, float, float, float]:
    """Seconds of forward+backward, of its collectives (calls and waits), of the optimizer step,
    and of the all-gathers from call to the end of their wait (on an accelerator: 0, not seen)."""
    batch = {k: v.to(em.device) for k, v in batch.items()}
    with timed_collectives(em.device) as clock:
        dev.synchronize(em.device)  # on an accelerator the host only queues work: time the device
        t0 = time.perf_counter()
        em(**batch).backward()
        dev.synchronize(em.device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        dev.synchronize(em.device)
        t2 = time.perf_counter()
    return t1 - t0, clock.seconds, t2 - t1, clock.span_seconds.get("all_gather_into", 0.0)


def _worker(runs: list, steps: int) -> list:
    """Per run, per step: forward+backward, collective and optimizer seconds. A run marked
    ``"pair"`` trains the same plan without and with prefetch, alternating step by step, so the
    difference is not swamped by drift in the machine's load, and in turns (AB, BA, ...), so
    neither always runs second, on caches the other warmed."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    out = []
    for size, plan_json, dtype, mode in runs:
        pairs = [_train(size, plan_json, dtype, False)] + ([_train(size, plan_json, dtype, True)] if mode == "pair" else [])
        rows: list = [[] for _ in pairs]
        for s in range(steps):
            batch = _batch(1000 * rank + s, size[2])
            for i in (range(len(pairs)) if s % 2 == 0 else reversed(range(len(pairs)))):
                rows[i].append(_timed_step(*pairs[i], batch))
        res = {"fwd_bwd": [r[0] for r in rows[0]], "collectives": [r[1] for r in rows[0]],
               "optimizer": [r[2] for r in rows[0]], "gather_spans": [r[3] for r in rows[0]]}
        if mode == "pair":
            res["fwd_bwd_prefetch"] = [r[0] for r in rows[1]]
        out.append(res)
        del pairs
    return out


@dataclass(frozen=True)
class Calibration:
    """How elixir's runtime performs on this machine at one number of ranks per node, against the
    uncalibrated cost model.

    Attributes:
        ranks: ranks per node.
        compute: measured / predicted time of matmul and memory traffic (throughput factor), fp32.
        compute_bfloat16: the same for bf16 matmuls (bf16 kernels differ from fp32 ones; the
            memory-traffic and per-op terms keep the fp32 fit).
        op_overhead_s: measured fixed seconds per dispatched op in the runtime's training step.
        collectives: measured / predicted time of the all-gathers, each from its call to the end of
            its wait (the larger size, without prefetch, so each is waited on at once); the step's
            other collectives are asynchronous and show the host their wait only.
        all_reduce: measured / predicted time of the gradients' all-reduce, on the largest size's
            replicated plan (whose only collective it is). Its own factor: the all-gather factor
            follows the all-gather curve's noise (0.88-2.02 over three profiles of one 2-core box,
            while this one held at 1.27-1.29), and scaling the all-reduce by it priced the
            replicated plans of issue 35's communication-bound workloads 20-24% fast.
        optimizer: measured / predicted optimizer-step time.
        overlap: the fraction of the hideable gather time (all gathers but the first, up to the
            compute time) that prefetching hid, from the larger size with and without prefetch.
        runs: per reference size, the measured and predicted components (seconds).
    """

    ranks: int
    compute: float
    compute_bfloat16: float
    op_overhead_s: float
    collectives: float
    optimizer: float
    overlap: float
    runs: tuple
    all_reduce: float = 1.0

    def factors(self) -> dict[str, float]:
        return {"compute": self.compute, "compute_bfloat16": self.compute_bfloat16, "op_overhead_s": self.op_overhead_s,
                "collectives": self.collectives, "all_reduce": self.all_reduce, "optimizer": self.optimizer,
                "overlap": self.overlap}


def _clamp(x: float, lo: float = 0.05, hi: float = 20.0) -> float:
    return float(min(hi, max(lo, x)))


def _collectives_ratio(meas: dict, pred: dict) -> float:
    """Measured over predicted collective time, over the gathers from call to end of wait: without
    prefetch each is waited on at once, so its span is its whole time. (An asynchronous
    reduce-scatter shows the host only its wait: the step's whole collective time set against the
    whole predicted time came out at 0.6-0.8 on a 2-core box, and plans bound by communication then
    ran 13-51% over their predictions in issue 35's regret grid.)"""
    m, p = meas["gather_spans"], pred["all_gather"]
    if m > 0 and p > 0:
        return _clamp(m / p)
    return _clamp(meas["collectives"] / pred["collectives"]) if pred["collectives"] > 0 else 1.0


def _all_reduce_ratio(meas: dict, pred: dict, fallback: float) -> float:
    """Measured over predicted collective time of a replicated run (fp32, the largest size), whose
    only collective is the gradients' all-reduce; ``fallback`` (the all-gathers' factor) where the
    run predicted none."""
    return _clamp(meas["collectives"] / pred["collectives"]) if pred["collectives"] > 0 else fallback


def _prefetch_overlap(res: list, big: int, steps: int, meas: dict, pred: dict, first_gather: float) -> float:
    """The fraction of the hideable gather time (all gathers but the first, up to the compute time)
    that prefetching hid, from run ``big`` timed with and without prefetch in alternating turns."""
    diffs = [max(r[big]["fwd_bwd"][j] for r in res) - max(r[big]["fwd_bwd_prefetch"][j] for r in res)
             for j in range(1, steps)]
    # what prefetching hid counts only where it stands out of the steps' own noise (twice the
    # standard error of the paired differences): a tiny reference model's few milliseconds
    # of gathers otherwise let noise claim full overlap, and plans that shard for it ran
    # 1.5x slower than replicated ones on a 2-core box where the gathers hid nothing
    hidden = statistics.median(diffs)
    if len(diffs) > 1 and hidden <= 2 * statistics.stdev(diffs) / len(diffs) ** 0.5:
        hidden = 0.0
    gathers = meas["gather_spans"] or meas["collectives"] * (pred["all_gather"] / pred["collectives"] if pred["collectives"] else 0.0)
    hideable = min(meas["compute"], max(0.0, gathers - first_gather))
    return _clamp(hidden / hideable, 0.0, 1.0) if hideable > 0 else 0.0


def _replicated(plan: SearchResult, ranks: int) -> SearchResult:
    """``plan`` with every chunk replicated: whole on every rank, no gathers, no rCache."""
    return dataclasses.replace(plan, chunks=tuple(c.with_sharding("replicated", ranks) for c in plan.chunks),
                               cache_blocks=0, prefetch_depth=0, prediction=None)


def _fit_compute(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(a, b) >= 0`` minimising the relative residuals of ``m = a * t + b * o`` over the rows
    ``(t, o, m)`` (throughput seconds, ops, measured seconds): a non-negative least-squares fit, so
    that one noisy run cannot trade the throughput factor for a per-op cost (two runs, two unknowns,
    gave either at will). Where both terms cannot be positive, the better one-term fit."""
    w = [(t / m, o / m) for t, o, m in rows if m > 0]
    stt, soo, sto = sum(t * t for t, _ in w), sum(o * o for _, o in w), sum(t * o for t, o in w)
    st, so = sum(t for t, _ in w), sum(o for _, o in w)
    det = stt * soo - sto * sto
    if det > 1e-12 * max(1e-30, stt * soo):
        a, b = (st * soo - so * sto) / det, (so * stt - st * sto) / det
        if a > 0 and b > 0:
            return a, b

    def loss(a: float, b: float) -> float:
        return sum((a * t + b * o - 1.0) ** 2 for t, o in w)

    one = [(st / stt if stt else 0.0, 0.0), (0.0, so / soo if soo else 0.0)]
    return min(one, key=lambda ab: loss(*ab))


def _reference_runs(base: Any, ranks: int) -> tuple[list, list, int]:
    """The runs of :func:`calibrate` and what the cost model predicts for each (from ``base``, the
    uncalibrated profile): every size of :data:`SIZES` under the search's own plan with every chunk
    replicated (the compute fit), the largest also in bf16, and the largest under the
    minimum-waste plan (sharded: the collectives, the overlap and the optimizer).

    The search's chunks, not the minimum-waste ones, for the compute: with a few large chunks the
    gradients' all-reduce runs after the backward, as the cost model adds it; with many small ones
    it runs during the backward, on the same cores, and about 6% of the step moved from the
    collectives' wait into the compute measured (2 ranks, 2 cores, the largest size: 145-150 ms
    against 138-143 ms, at the same forward+backward time). Returns (runs, predictions, the
    sharded plan's chunk size)."""
    per_rank = base.per_rank(base.ranks_per_node(ranks))
    st = Setting(layout=MeshLayout.data_parallel(ranks), elem=4, reduce_elem=4, opt_bytes=8, hardware=per_rank, dtype="float32")
    runs, preds = [], []
    chunk = 0
    todo = [(s, "float32", "replicated") for s in SIZES] + [(SIZES[-1], "bfloat16", "replicated"),
                                                           (SIZES[-1], "float32", "sharded")]
    for size, dtype, kind in todo:
        torch.manual_seed(0)
        model = reference_model(size)
        tdtype = getattr(torch, dtype)
        prof = profile_step(model, _batch(0, size[2]), _step_fn, tdtype)
        if kind == "replicated":
            plan = _replicated(search_profile(prof, ranks, hardware=base, overlap=True), ranks)
        else:
            plan = minimum_waste_search(model, ranks, tdtype, prefetch=True, inp=_batch(0, size[2]), step_fn=_step_fn)
            chunk = plan.chunk_size
        b = evaluate_plan(prof, plan, dataclasses.replace(st, elem=tdtype.itemsize, dtype=dtype)).breakdown
        costs = prof.op_costs
        mm = per_rank.op_compute_time(OpCosts(costs.matmul, {}, 0), dtype)
        mem = per_rank.op_compute_time(OpCosts({}, costs.memory, 0), dtype)
        preds.append({"matmul": mm, "memory": mem, "throughput": mm + mem, "ops": costs.ops, "compute": b["compute"],
                      "collectives": b["all_gather"] + b["reduce_scatter"] + b["all_reduce"],
                      "all_gather": b["all_gather"], "optimizer": b["optimizer"], "dtype": dtype})
        runs.append((size, plan.to_json(), dtype, "pair" if kind == "sharded" and ranks > 1 else kind))
    return runs, preds, chunk


def calibrate(hw: Any, ranks: int, steps: int = 10, timeout: float = 600.0) -> Calibration:
    """Train the reference sizes on ``ranks`` local ranks (one thread each, as elixir's multi-rank
    CPU runs do) with every chunk on the device.

    Compute is fitted as ``a * (matmul + memory time) + b * ops`` (non-negative least squares over
    every size, :func:`_fit_compute`) on the search's plans with every chunk replicated: the
    step's own compute, as a plan pays it whose parameters are whole (the sharded plan's extra work per chunk, gathers, copies and the
    reduce-scatters' thread, is not compute: fitted into ``a`` and ``b`` it priced GPT-2 steps 20-30%
    over their measured time in issue 35's regret grid). bf16 matmuls are refitted on a bf16 run of
    the largest size; collectives, overlap and the optimizer are measured / predicted from ``hw``
    (uncalibrated) on the largest size's minimum-waste (sharded) plan."""
    base = dataclasses.replace(hw, calibration={})
    if base.device_type == "cpu":
        base = dataclasses.replace(base, cores=ranks)  # one thread per rank, as run below
    per_rank = base.per_rank(base.ranks_per_node(ranks))
    runs, preds, chunk = _reference_runs(base, ranks)
    backend = local_backend(ranks)
    if backend is None:
        raise ValueError(f"calibrating {ranks} ranks needs {ranks} GPUs (one per rank for NCCL)")
    res = run_distributed(_worker, ranks, runs, steps, timeout=timeout, threads_per_rank=1, backend=backend)

    def slowest(i: int, key: str) -> float:  # per step, the slowest rank; median over steps after the first
        per_step = [max(r[i][key][j] for r in res) for j in range(steps)]
        return statistics.median(per_step[1:]) if steps > 1 else per_step[0]

    meas = []
    for i in range(len(runs)):
        coll = slowest(i, "collectives")
        meas.append({"compute": max(1e-6, slowest(i, "fwd_bwd") - coll), "collectives": coll,
                     "optimizer": slowest(i, "optimizer"), "gather_spans": slowest(i, "gather_spans")})
    n = len(SIZES)
    a, b = _fit_compute([(p["throughput"], p["ops"], m["compute"]) for p, m in zip(preds[:n], meas[:n])])
    if a <= 0:  # no throughput term left: one factor for both, from the largest size
        a = meas[n - 1]["compute"] / max(1e-9, preds[n - 1]["compute"])
        b = per_rank.op_overhead_s * a
    # bf16 matmul factor: the bf16 run's compute less the fp32-fitted memory and per-op terms
    pb, mb = preds[n], meas[n]
    a_bf16 = (mb["compute"] - a * pb["memory"] - b * pb["ops"]) / pb["matmul"] if pb["matmul"] > 0 else a
    if a_bf16 <= 0:
        a_bf16 = mb["compute"] / max(1e-9, pb["compute"])
    big = n + 1  # the sharded run

    def ratio(key: str) -> float:
        return _clamp(meas[big][key] / preds[big][key]) if preds[big][key] > 0 else 1.0

    coll = _collectives_ratio(meas[big], preds[big]) if ranks > 1 else 1.0
    all_reduce = _all_reduce_ratio(meas[n - 1], preds[n - 1], coll) if ranks > 1 else 1.0
    first_gather = per_rank.all_gather_time(chunk * 4, ranks) if ranks > 1 else 0.0
    overlap = _prefetch_overlap(res, big, steps, meas[big], preds[big], first_gather * coll) if ranks > 1 else 0.0

    return Calibration(
        ranks=ranks, compute=_clamp(a), compute_bfloat16=_clamp(a_bf16), op_overhead_s=_clamp(b, 0.0, 1e-3),
        collectives=coll, all_reduce=all_reduce, optimizer=ratio("optimizer"), overlap=overlap,
        runs=tuple({"size": runs[i][0], "dtype": runs[i][2], "mode": runs[i][3], "measured": meas[i],
                    "predicted": preds[i]} for i in range(len(runs))),
    )


def calibrate_profile(hw: Any, ranks: tuple[int, ...], steps: int = 10, say: Optional[Any] = None) -> Any:
    """``hw`` with :attr:`calibration` measured at each number of ranks per node in ``ranks``."""
    cal: dict[str, dict[str, float]] = {}
    notes = []
    for k in ranks:
        if say:
            say(f"calibrating on {k} rank(s)")
        c = calibrate(hw, k, steps)
        cal[str(k)] = c.factors()
        for r in c.runs:
            m, p = r["measured"], r["predicted"]
            notes.append(f"{k} rank(s), width {r['size'][0]} seq {r['size'][2]} layers {r['size'][3]} {r['dtype']} "
                         f"{'sharded (minimum waste, also with prefetch, alternating)' if r['mode'] == 'pair' else r['mode']}"
                         ": measured " + ", ".join(f"{n} {m[n] * 1e3:.1f} ms" for n in ("compute", "collectives", "optimizer",
                                                                                      "gather_spans"))
                         + "; predicted " + ", ".join(f"{n} {p[n] * 1e3:.1f} ms" for n in ("compute", "collectives", "optimizer",
                                                                                           "all_gather"))
                         + f", {p['ops']} ops")
    src = dict(hw.source)
    src["calibration"] = ("measured: elixir's runtime training the plain-torch reference model "
                          f"(elixir.calibrate.ReferenceLM, batch {BATCH}, (width, heads, seq, layers) in {list(SIZES)}); "
                          "compute fitted as a * (matmul + memory time) + b * ops, non-negative least squares of the relative "
                          "residuals over every size, on the search's plans with every chunk replicated (no sharded "
                          "chunk's work), bf16 matmuls refitted on a bf16 run of the largest; the all-reduce as measured / predicted "
                          "collective time on the largest size's replicated plan (fp32); collectives as the all-gathers' spans, call to end of wait (no "
                          "prefetch: waited at once), measured / predicted, and the optimizer as measured / predicted, on "
                          "the largest size's minimum-waste (sharded) plan (fp32); " + " | ".join(notes))
    return dataclasses.replace(hw, calibration=cal, source=src)
