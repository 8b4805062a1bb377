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

``--breakdown`` instead times a whole disk-bound training step (forward, backward with the fused
step, ``optimizer.step()``) of the same model with **every** chunk ``KK``: compute shard, fp32
master and Adam state on disk (O_DIRECT), the shard derived from the master at each gather. It
splits the step into forward gathers, backward gathers, the fused step's staging (reads and writes
of masters and moments, the time backward waited on them) and compute, from the stores' own
counters (``bytes_read``/``bytes_written``, ``wait_seconds``, ``converted_wait_seconds``,
``DerivedShards.stage_seconds``), and sets the bytes moved per step against the offload
directory's sequential read and write rates measured in the same run (``elixir hwprofile``'s
:func:`~elixir.profiling.measurement.measure_disk`: O_DIRECT 8 MiB writes with fsync, then reads):
the disk's share is (read bytes / read rate + written bytes / write rate) / step seconds.

``--variants before,after`` times the settings of :data:`VARIANTS` in one run, one step of each in
turn: the fused step's staging depth (``BackwardStager.depth``), the forward gathers' read-ahead
(``DerivedShards.read_ahead``) and in-place gathers and steps (``DerivedShards.in_place``);
``before`` is the runtime before issue 35's changes (depth 2, neither), ``after`` the default. ``--meta`` builds the model on the meta device
(a model larger than host memory).

    python bench/disk_offload.py --breakdown --layers 32 --dim 4096 --variants before,after --json out.json
"""

from __future__ import annotations

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # page-aligned large tensors (O_DIRECT-eligible)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
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


# ---- --breakdown ------------------------------------------------------------------------------


def _kk_module(layers: int, dim: int, offload_dir, meta: bool = False):
    """The model wrapped with every chunk KK (shard, master, Adam state on disk), O_DIRECT;
    ``meta``: built on the meta device and materialised chunk by chunk (a model larger than
    host memory)."""
    from elixir.optim import CPUAdam
    from elixir.plan import Placement
    from elixir.search import minimum_waste_search
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    if meta:
        with torch.device("meta"):
            model = _model(layers, dim)
    else:
        model = _model(layers, dim)
    plan = minimum_waste_search(model, 1)
    chunks = tuple(dataclasses.replace(c, shard_placement=Placement.DISK, optim_placement=Placement.DISK) for c in plan.chunks)
    em = ElixirModule(model, dataclasses.replace(plan, chunks=chunks), offload_dir=offload_dir, offload_direct=True)
    opt = ElixirOptimizer(em, CPUAdam(list(em.parameters()), lr=1e-4), fused_step=True)
    return em, opt


# The settings compared by --breakdown: the fused step's staging depth (BackwardStager.depth; the
# default is elixir.plan.footprint.DISK_STAGING), the forward gathers' read-ahead
# (DerivedShards.read_ahead), and whether gathers fill the payload straight from the master and
# steps leave the derived shard alone (DerivedShards.in_place). "before" is the runtime before
# issue 35's overlap, "after" the default.
VARIANTS = {"before": (2, False, False), "depth3": (3, False, False), "readahead": (2, True, False),
            "inplace": (2, False, True), "after": (None, True, True)}


def _apply(em, opt, variant: str) -> dict:
    from elixir.plan.footprint import DISK_STAGING

    depth, read_ahead, in_place = VARIANTS[variant]
    opt.backward_step.stager.depth = DISK_STAGING if depth is None else depth
    em.derived_shards.read_ahead = read_ahead
    em.derived_shards.in_place = in_place
    em.derived_shards.drop_read_ahead()
    return {"variant": variant, "depth": opt.backward_step.stager.depth, "read_ahead": read_ahead, "in_place": in_place}


def _counters(em) -> dict:
    """The stores' cumulative counters now: gathers (derived shards) and staging (masters store)."""
    masters, derived = em.disk_store, em.derived_shards
    return {
        "gather_read": derived.bytes_read, "gather_s": derived.stage_seconds,
        "gather_wait_s": masters.converted_wait_seconds,
        "stage_read": masters.bytes_read, "stage_written": masters.bytes_written, "stage_wait_s": masters.wait_seconds,
    }


def _timed_step(em, opt, x) -> dict:
    """One step, phase by phase: the counters' deltas and wall seconds of each phase."""
    phases = {}
    before, t0 = _counters(em), time.perf_counter()
    loss = em(x).pow(2).mean()
    marks = [("forward", time.perf_counter(), _counters(em))]
    loss.backward()
    marks.append(("backward", time.perf_counter(), _counters(em)))
    opt.step()
    marks.append(("step", time.perf_counter(), _counters(em)))
    opt.zero_grad()
    for name, t1, after in marks:
        phases[name] = {k: after[k] - before[k] for k in after} | {"s": t1 - t0}
        before, t0 = after, t1
    return phases


def _rows(ph: dict) -> list[tuple]:
    """(phase, read, written, seconds, of which waiting) rows of one step's phases."""
    rows = []
    for name in ("forward", "backward"):
        p = ph[name]
        rows.append((f"{name} gathers (read+cast)", p["gather_read"], 0, p["gather_s"], p["gather_wait_s"]))
    b, s = ph["backward"], ph["step"]
    rows.append(("fused step staging (backward)", b["stage_read"], b["stage_written"], b["stage_wait_s"], b["stage_wait_s"]))
    rows.append(("optimizer.step() staging", s["stage_read"], s["stage_written"], s["stage_wait_s"], s["stage_wait_s"]))
    io = sum(r[3] for r in rows)
    total = sum(p["s"] for p in ph.values())
    rows.append(("compute and other (no disk wait)", 0, 0, total - io, 0.0))
    return rows


def _engine_rates(where: str, nbytes: int, transfer: int = 64 << 20, depth: int = 2) -> tuple[float, float]:
    """Sequential read and write rates (bytes/s) of a file in ``where`` driven as the store drives
    it: the offload engine (:func:`~elixir.offload.aio.make_io`, O_DIRECT, its threads splitting
    transfers into 8 MiB pieces), ``depth`` transfers of ``transfer`` bytes in flight; writes
    then fsync, then reads. More queue depth than ``measure_disk``'s one 8 MiB block at a time,
    so a ceiling the store could reach that the QD1 probe would understate."""
    from elixir.offload.aio import OffloadFile, make_io

    path = os.path.join(where, f".disk-offload-probe-{os.getpid()}.bin")
    f, io = OffloadFile(path, direct=True), make_io()
    bufs = [torch.full((transfer,), 7, dtype=torch.uint8) for _ in range(depth)]
    if f.direct_fd is None or any(b.data_ptr() % 4096 for b in bufs):
        print("engine probe: O_DIRECT unavailable or buffers unaligned; its rates include the page cache")
    n = max(1, nbytes // transfer)

    def run(write: bool) -> float:
        t0, pending = time.perf_counter(), []
        for k in range(n):
            if len(pending) == depth:
                pending.pop(0).wait()
            pending.append((io.write if write else io.read)(f, k * transfer, bufs[k % depth]))
        for h in pending:
            h.wait()
        if write:
            os.fsync(f.fd)
        return n * transfer / (time.perf_counter() - t0)

    try:
        write_bps = run(True)
        read_bps = run(False)
    finally:
        io.close()
        f.close()
        os.unlink(path)
    return read_bps, write_bps


def breakdown(layers: int, dim: int, reps: int, offload_dir, probe_bytes: int, variants=("after",),
              meta: bool = False) -> list[dict]:
    """Measure the disk's sequential rates, then time every variant (:data:`VARIANTS`): one
    warm-up step each, then ``reps`` rounds of one step per variant in turn (so that the box's
    drift falls on every variant alike); per variant, the median step's phases."""
    import tempfile

    from elixir.profiling.measurement import measure_disk

    where = offload_dir or tempfile.gettempdir()
    qd1 = measure_disk(where, probe_bytes)  # elixir hwprofile's probe
    engine = _engine_rates(where, probe_bytes)
    read_bps, write_bps = max(qd1[0], engine[0]), max(qd1[1], engine[1])  # the stricter ceiling
    t0 = time.perf_counter()
    em, opt = _kk_module(layers, dim, offload_dir, meta)
    build_s = time.perf_counter() - t0
    x = torch.randn(4, dim)
    steps: dict[str, list] = {v: [] for v in variants}
    peaks: dict[str, tuple[int, int]] = {}
    settings = {}
    for v in variants:
        settings[v] = _apply(em, opt, v)
        _timed_step(em, opt, x)  # warm-up (the first creates the moments on disk)
    for _ in range(reps):
        for v in variants:
            _apply(em, opt, v)
            em.disk_store.reset_peak()
            em.derived_shards.reset_peak()
            steps[v].append(_timed_step(em, opt, x))
            peaks[v] = (max(peaks.get(v, (0, 0))[0], em.disk_store.peak_staged_bytes),
                        max(peaks.get(v, (0, 0))[1], em.derived_shards.peak_staged_bytes))
    out = []
    for v in variants:
        totals = [sum(p["s"] for p in ph.values()) for ph in steps[v]]
        ph = steps[v][sorted(range(reps), key=lambda i: totals[i])[reps // 2]]  # the median step
        rows = _rows(ph)
        step_s = sum(p["s"] for p in ph.values())
        read, written = sum(r[1] for r in rows), sum(r[2] for r in rows)
        out.append(settings[v] | {
            "params": layers * dim * dim, "chunks": len(em.chunks), "dir": where, "build_s": build_s,
            "seq_read_Bps": read_bps, "seq_write_Bps": write_bps, "qd1_probe_Bps": qd1, "engine_probe_Bps": engine,
            "step_s": step_s, "steps_s": totals, "peak_staged": peaks[v][0], "peak_shard_staged": peaks[v][1],
            "read": read, "written": written, "disk_share": (read / read_bps + written / write_bps) / step_s,
            "phases": ph, "rows": [dict(zip(("phase", "read", "written", "s", "wait_s"), r)) for r in rows],
        })
    em.derived_shards.close()
    em.disk_store.close()
    return out


def _rate(row: dict) -> str:
    """GB/s of a row's bytes over its seconds; a staging row's seconds are only what backward
    waited (the rest overlapped compute), so no rate is made of them."""
    moved = row["read"] + row["written"]
    if "staging" in row["phase"]:
        return "overlapped" if moved else ""
    return f"{moved / row['s'] / 1e9:.2f}" if moved and row["s"] > 0 else ""


def _print_breakdown(r: dict) -> None:
    title = (f"disk-bound step, {r['variant']} (staging depth {r['depth']}, forward read-ahead "
             f"{'on' if r['read_ahead'] else 'off'}, in place {'on' if r['in_place'] else 'off'}), "
             f"{r['params'] / 1e6:.0f}M fp32 params, "
             f"{r['chunks']} KK chunks (O_DIRECT), CPUAdam fused; "
             f"{r['dir']}: sequential read {r['seq_read_Bps'] / 1e9:.2f} GB/s, write {r['seq_write_Bps'] / 1e9:.2f} GB/s")
    table = Table(title=title)
    for col in ("phase", "read", "written", "s", "waiting s", "GB/s", "share of step"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in r["rows"]:
        table.add_row(row["phase"], f"{row['read'] / 1e9:.2f} GB", f"{row['written'] / 1e9:.2f} GB", f"{row['s']:.2f}",
                      f"{row['wait_s']:.2f}", _rate(row),
                      f"{row['s'] / r['step_s']:.0%}")
    table.add_row("step", f"{r['read'] / 1e9:.2f} GB", f"{r['written'] / 1e9:.2f} GB", f"{r['step_s']:.2f}", "",
                  f"{(r['read'] + r['written']) / r['step_s'] / 1e9:.2f}", "100%")
    Console(width=160).print(table)
    (q_r, q_w), (e_r, e_w) = r["qd1_probe_Bps"], r["engine_probe_Bps"]
    print(f"sequential probes (GB/s read, write): hwprofile QD1 {q_r / 1e9:.2f}, {q_w / 1e9:.2f}; "
          f"offload engine 2 x 64 MiB in flight {e_r / 1e9:.2f}, {e_w / 1e9:.2f}; the faster of each is the rate above")
    print(f"disk share: (read/seq read + written/seq write) / step = {r['disk_share']:.0%} "
          f"(steps: {', '.join(f'{t:.2f}' for t in r['steps_s'])} s); peak staged {r['peak_staged'] / 1e6:.0f} MB "
          f"(masters and state), {r['peak_shard_staged'] / 1e6:.0f} MB (shards)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--disk", default="", help="comma-separated chunk counts on disk (default: half and all)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--breakdown", action="store_true", help="profile a whole disk-bound training step (see above)")
    ap.add_argument("--probe-gib", type=float, default=1.0, help="--breakdown: size of the sequential-rate probe file")
    ap.add_argument("--json", default=None, help="--breakdown: write the numbers here")
    ap.add_argument("--variants", default="after",
                    help=f"--breakdown: comma-separated overlap settings to time, alternating step by step "
                         f"({', '.join(VARIANTS)}; 'after' is the default runtime)")
    ap.add_argument("--meta", action="store_true", help="--breakdown: build the model on the meta device")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.breakdown:
        variants = tuple(args.variants.split(","))
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            ap.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
        r = breakdown(args.layers, args.dim, args.reps, args.offload_dir, int(args.probe_gib * 2**30), variants, args.meta)
        for one in r:
            _print_breakdown(one)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1)
        return
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
