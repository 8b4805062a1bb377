"""Hardware profiles: what a machine (or a cluster node) can do, as versioned JSON.

A :class:`HardwareProfile` holds every constant the cost model uses: transfer bandwidth curves
(host<->device, pinned and pageable; device copies), collective bus-bandwidth curves against message
size, optimizer throughput per placement, matmul throughput per dtype, disk bandwidth and
capacities. Nothing in the search is fitted by hand: a profile is either **measured** on the machine
by :func:`measure` (``elixir hwprofile``) or a shipped **reference** profile whose ``source`` field
says, per quantity, where each number came from.

Collective curves are stored as *bus bandwidth* (NCCL-tests convention): a ring all-gather or
reduce-scatter of ``S`` bytes over ``W`` ranks takes ``S * (W - 1) / W / busbw(S)``. This lets a
profile measured at one world size predict another (within one node's interconnect).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from elixir.fileio import atomic_write_json, read_json

HARDWARE_SCHEMA_VERSION = 1

GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# schema


@dataclass(frozen=True)
class BandwidthCurve:
    """Measured bandwidth (bytes/s) at message sizes (bytes), in increasing size order.

    See :meth:`time` for how sizes between and beyond the measured points are treated.
    """

    sizes: tuple[int, ...]
    bytes_per_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.bytes_per_s) or not self.sizes:
            raise ValueError("a bandwidth curve needs as many sizes as bandwidths, at least one")
        if any(b <= 0 for b in self.bytes_per_s) or any(s <= 0 for s in self.sizes):
            raise ValueError("bandwidth curve sizes and bandwidths must be positive")
        if list(self.sizes) != sorted(self.sizes):
            raise ValueError("bandwidth curve sizes must be increasing")

    @classmethod
    def flat(cls, bytes_per_s: float) -> BandwidthCurve:
        """A size-independent bandwidth (for reference figures quoted as one number)."""
        return cls((1,), (float(bytes_per_s),))

    def _times(self) -> list[float]:
        """Measured times, made non-decreasing in size (more bytes never take less time)."""
        out, worst = [], 0.0
        for size, bw in zip(self.sizes, self.bytes_per_s):
            worst = max(worst, size / bw)
            out.append(worst)
        return out

    def time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` (0 for 0 bytes).

        Between measured sizes the time is interpolated linearly in log-log space; below the
        smallest size it stays at that size's time (a latency floor); above the largest, the last
        bandwidth holds. Time never decreases with size.
        """
        if nbytes <= 0:
            return 0.0
        s, t = self.sizes, self._times()
        if nbytes <= s[0]:
            return t[0]
        if nbytes >= s[-1]:
            return t[-1] * nbytes / s[-1]
        lx = math.log(nbytes)
        for i in range(1, len(s)):
            if nbytes <= s[i]:
                x0, x1 = math.log(s[i - 1]), math.log(s[i])
                f = (lx - x0) / (x1 - x0) if x1 > x0 else 1.0
                v = math.exp(math.log(t[i - 1]) + f * (math.log(t[i]) - math.log(t[i - 1])))
                return min(max(v, t[i - 1]), t[i])  # no rounding below the previous point
        return t[-1]  # pragma: no cover

    def bandwidth(self, nbytes: float) -> float:
        """Effective bytes/s at a message of ``nbytes``."""
        return nbytes / self.time(nbytes) if nbytes > 0 else self.bytes_per_s[0]

    def scaled(self, factor: float) -> BandwidthCurve:
        """The same curve with every bandwidth multiplied by ``factor``."""
        return BandwidthCurve(self.sizes, tuple(b * factor for b in self.bytes_per_s))

    def to_json(self) -> dict:
        return {"sizes": list(self.sizes), "bytes_per_s": list(self.bytes_per_s)}

    @classmethod
    def from_json(cls, d: Any) -> BandwidthCurve:
        if isinstance(d, (int, float)):
            return cls.flat(float(d))
        return cls(tuple(int(x) for x in d["sizes"]), tuple(float(x) for x in d["bytes_per_s"]))


_CURVES = ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable", "device_copy", "all_gather", "reduce_scatter",
           "elementwise", "all_reduce")


@dataclass(frozen=True)
class HardwareProfile:
    """Everything the cost model needs to know about one kind of node.

    Attributes:
        name: short id (``"8xA100-40GB"``, ``"this-cpu-box"``).
        measured: True when :func:`measure` produced it on the machine named in ``host``.
        source: per-quantity provenance (field name -> text), plus ``"*"`` for the whole profile.
        device_type: ``"cuda"`` or ``"cpu"`` (on ``"cpu"`` "device" and "host" are the same RAM).
        device_name: the accelerator (or CPU) model.
        devices_per_node: ranks that share one node's host memory and intra-node links.
        device_memory_bytes: memory of one device.
        host_memory_bytes: host RAM of one node.
        disk_bytes: free space in the offload directory of one node.
        h2d_pinned, h2d_pageable, d2h_pinned, d2h_pageable: host<->device copy bandwidth curves
            (memcpy on a CPU-only machine).
        device_copy: device-to-device copy within one device.
        all_gather, reduce_scatter: bus-bandwidth curves (see module doc) or None when unmeasured.
        collective_world: world size the collective curves were measured at (0 if none).
        collective_backend: ``"nccl"``, ``"gloo"``, ...
        optimizer_params_per_s: fp32 Adam update throughput, keyed by where it runs
            (``"device"``, ``"host"``), in parameters per second for one rank.
        optimizer_impl: which implementation was timed, per key.
        matmul_flops: dense matmul throughput per dtype name (``"float32"``, ``"bfloat16"``, ...).
        train_flops: per dtype, the training throughput (FLOP/s) of a reference transformer stack
            against the FLOPs of one step (``6 * matmul weights * tokens``, as the cost model counts
            them): it includes attention, elementwise ops and framework overhead that a bare matmul
            does not. Empty in reference profiles (``matmul_flops`` is used then).
        matmul_curve: per dtype, matmul throughput (FLOP/s) by the FLOPs of one matmul, with the
            fixed cost of an op taken out (that is ``op_overhead_s``); empty: use ``matmul_flops``.
        elementwise: throughput (bytes read + written per second) of a memory-bound op by its
            bytes, fixed cost taken out; None: twice ``device_copy`` (a copy reads and writes).
        all_reduce: all-reduce bus-bandwidth curve (bus bytes ``2 (w - 1) / w`` of the message);
            None: a reduce-scatter plus an all-gather (the ring algorithm NCCL uses).
        op_overhead_s: fixed seconds per dispatched op in a training step (framework dispatch,
            autograd bookkeeping, kernel launch), timed on a chain of tiny ops with autograd.
        calibration: per number of ranks per node (a string key), measured / predicted time of the
            step components ``compute``, ``collectives`` and ``optimizer`` when elixir's runtime
            trains a reference model on this machine (:mod:`elixir.calibrate`), and the measured
            ``op_overhead_s`` that replaces the profile's own there (``compute_<dtype>``, where
            present, replaces ``compute`` for that dtype's matmuls); applied by
            :meth:`per_rank`. Empty: uncalibrated.
        overlap_fraction: where ``overlap`` is False, the measured fraction of prefetchable gather
            time that still hides under compute (gloo's threads move data while a rank computes);
            set from the calibration's ``overlap`` by :meth:`per_rank`.
        compute_threads: CPU threads the compute figures were timed on (0: the whole device);
            a CPU-only profile is timed on 1 thread and scaled by the cores each rank gets.
        cores: CPU cores of the node.
        disk_read_bytes_per_s, disk_write_bytes_per_s: sequential bandwidth of the offload dir.
        overlap: whether transfers and collectives run concurrently with compute (separate copy
            engines / NIC); False on a CPU-only machine, where they share the cores.
        host: the machine the profile was measured on (or "reference").
        created: ISO date.
        notes: free text.
    """

    name: str
    device_type: str
    device_name: str
    devices_per_node: int
    device_memory_bytes: int
    host_memory_bytes: int
    disk_bytes: int
    h2d_pinned: BandwidthCurve
    h2d_pageable: BandwidthCurve
    d2h_pinned: BandwidthCurve
    d2h_pageable: BandwidthCurve
    device_copy: BandwidthCurve
    all_gather: Optional[BandwidthCurve]
    reduce_scatter: Optional[BandwidthCurve]
    collective_world: int
    collective_backend: str
    optimizer_params_per_s: dict[str, float]
    optimizer_impl: dict[str, str]
    matmul_flops: dict[str, float]
    disk_read_bytes_per_s: float
    disk_write_bytes_per_s: float
    overlap: bool
    train_flops: dict[str, BandwidthCurve] = field(default_factory=dict)
    matmul_curve: dict[str, BandwidthCurve] = field(default_factory=dict)
    elementwise: Optional[BandwidthCurve] = None
    op_overhead_s: float = 0.0
    all_reduce: Optional[BandwidthCurve] = None
    calibration: dict[str, dict[str, float]] = field(default_factory=dict)
    overlap_fraction: float = 0.0
    compute_threads: int = 0
    cores: int = 0
    measured: bool = False
    source: dict[str, str] = field(default_factory=dict)
    host: str = "reference"
    created: str = ""
    notes: str = ""
    schema_version: int = HARDWARE_SCHEMA_VERSION

    def ranks_per_node(self, world: int) -> int:
        """Ranks sharing one node: all of them on a CPU-only box (local emulation), else up to
        ``devices_per_node``."""
        return max(1, world if self.device_type == "cpu" else min(world, self.devices_per_node))

    def per_rank(self, ranks_per_node: int) -> HardwareProfile:
        """The share of one rank when ``ranks_per_node`` ranks run on a node.

        Host-side quantities (host optimizer throughput, disk, pageable copies through host RAM)
        are per node and are divided among the ranks; so are all quantities of a CPU-only profile,
        whose "device" is the node's own cores and RAM. Accelerator quantities are per device.
        Collective curves are measured across ranks already and are kept. Then the profile's
        :attr:`calibration` for this many ranks per node, if measured, scales each component.
        """
        k = max(1, int(ranks_per_node))
        out = self._share(k)
        cal = self.calibration.get(str(k))
        return out._calibrated(cal) if cal else out

    def _share(self, k: int) -> HardwareProfile:
        cpu = self.device_type == "cpu"
        # compute figures timed on `compute_threads` threads: scale to the cores of one rank
        fc = (max(1, self.cores // k) / self.compute_threads) if (cpu and self.compute_threads) else (1.0 / k if cpu else 1.0)
        if k == 1 and fc == 1.0:
            return self
        f = 1.0 / k
        rates = dict(self.optimizer_params_per_s)
        rates["host"] = rates.get("host", 0.0) * f
        if cpu:
            rates["device"] = rates.get("device", 0.0) * f
        return dataclasses.replace(
            self,
            h2d_pinned=self.h2d_pinned.scaled(f) if cpu else self.h2d_pinned,
            d2h_pinned=self.d2h_pinned.scaled(f) if cpu else self.d2h_pinned,
            h2d_pageable=self.h2d_pageable.scaled(f),
            d2h_pageable=self.d2h_pageable.scaled(f),
            device_copy=self.device_copy.scaled(f) if cpu else self.device_copy,
            optimizer_params_per_s=rates,
            matmul_flops={d: v * fc for d, v in self.matmul_flops.items()},
            train_flops={d: c.scaled(fc) for d, c in self.train_flops.items()},
            matmul_curve={d: c.scaled(fc) for d, c in self.matmul_curve.items()},
            elementwise=self.elementwise.scaled(fc) if (cpu and self.elementwise is not None) else self.elementwise,
            disk_read_bytes_per_s=self.disk_read_bytes_per_s * f,
            disk_write_bytes_per_s=self.disk_write_bytes_per_s * f,
            notes=(self.notes + f" [per-rank share of {k} ranks per node]").strip(),
        )

    def _calibrated(self, cal: dict[str, float]) -> HardwareProfile:
        """This profile with each component's time multiplied by its calibration factor."""
        c, col, o = (float(cal.get(k, 1.0)) for k in ("compute", "collectives", "optimizer"))
        return dataclasses.replace(
            self,
            matmul_flops={d: v / c for d, v in self.matmul_flops.items()},
            train_flops={d: v.scaled(1 / c) for d, v in self.train_flops.items()},
            matmul_curve={d: v.scaled(1 / float(cal.get(f"compute_{d}", c))) for d, v in self.matmul_curve.items()},
            elementwise=(self.elementwise or self.device_copy.scaled(2.0)).scaled(1 / c),
            op_overhead_s=float(cal.get("op_overhead_s", self.op_overhead_s * c)),
            all_gather=self.all_gather.scaled(1 / col) if self.all_gather is not None else None,
            reduce_scatter=self.reduce_scatter.scaled(1 / col) if self.reduce_scatter is not None else None,
            all_reduce=self.all_reduce.scaled(1 / col) if self.all_reduce is not None else None,
            optimizer_params_per_s={w: v / o for w, v in self.optimizer_params_per_s.items()},
            overlap_fraction=float(cal.get("overlap", self.overlap_fraction)),
            calibration={},
        )

    # ---- derived costs (seconds) ----

    def _collective_time(self, curve: Optional[BandwidthCurve], nbytes: float, world: int, what: str) -> float:
        if world <= 1:
            return self.device_copy.time(nbytes)
        if curve is None:
            raise ValueError(
                f"hardware profile {self.name!r} has no {what} measurement; run `elixir hwprofile "
                f"--world-size 2` (or more) on the target, or use a reference profile"
            )
        return curve.time(nbytes * (world - 1) / world) if nbytes > 0 else 0.0

    def all_gather_time(self, full_bytes: float, world: int) -> float:
        """Seconds to all-gather a chunk of ``full_bytes`` (all shards together) over ``world`` ranks."""
        return self._collective_time(self.all_gather, full_bytes, world, "all-gather")

    def reduce_scatter_time(self, full_bytes: float, world: int) -> float:
        """Seconds to reduce-scatter ``full_bytes`` of gradients over ``world`` ranks."""
        return self._collective_time(self.reduce_scatter, full_bytes, world, "reduce-scatter")

    def all_reduce_time(self, nbytes: float, world: int) -> float:
        """Seconds to all-reduce ``nbytes`` over ``world`` ranks."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        if self.all_reduce is None:
            return self.reduce_scatter_time(nbytes, world) + self.all_gather_time(nbytes, world)
        return self.all_reduce.time(2 * nbytes * (world - 1) / world)

    def h2d_time(self, nbytes: float, pinned: bool = True) -> float:
        return (self.h2d_pinned if pinned else self.h2d_pageable).time(nbytes)

    def d2h_time(self, nbytes: float, pinned: bool = True) -> float:
        return (self.d2h_pinned if pinned else self.d2h_pageable).time(nbytes)

    def optimizer_time(self, params: float, where: str) -> float:
        """Seconds for one fp32 Adam update of ``params`` elements on ``where`` ("device"/"host")."""
        if params <= 0:
            return 0.0
        rate = self.optimizer_params_per_s.get(where)
        if not rate:
            raise ValueError(f"hardware profile {self.name!r} has no optimizer throughput for {where!r}")
        return params / rate

    def compute_time(self, flops: float, dtype: str) -> float:
        """Seconds of forward/backward compute for a step of ``flops`` matmul FLOPs: from the
        measured training-throughput curve when the profile has one, else from matmul throughput."""
        curve = self.train_flops.get(dtype) or self.train_flops.get("float32")
        if curve is not None:
            return curve.time(flops)
        return self.matmul_time(flops, dtype)

    def op_compute_time(self, costs: Any, dtype: str) -> float:
        """Seconds of forward/backward compute for a step with the traced
        :class:`~elixir.tracer.op_costs.OpCosts` ``costs``: every op pays ``op_overhead_s``;
        matmul-like ops add their FLOPs at the matmul throughput for their size; other ops add
        their bytes at the elementwise bandwidth for their size."""
        mm = self.matmul_curve.get(dtype) or self.matmul_curve.get("float32")
        ew = self.elementwise or self.device_copy.scaled(2.0)
        t = costs.ops * self.op_overhead_s
        for n, flops in costs.matmul.values():
            t += n * mm.time(flops / n) if mm is not None else self.matmul_time(flops, dtype)
        for n, nbytes in costs.memory.values():
            t += n * ew.time(nbytes / n)
        return t

    def matmul_time(self, flops: float, dtype: str) -> float:
        rate = self.matmul_flops.get(dtype) or self.matmul_flops.get("float32")
        if not rate:
            raise ValueError(f"hardware profile {self.name!r} has no matmul throughput for {dtype}")
        return flops / rate

    def disk_time(self, read_bytes: float, write_bytes: float) -> float:
        return read_bytes / self.disk_read_bytes_per_s + write_bytes / self.disk_write_bytes_per_s

    # ---- JSON ----

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for k in _CURVES:
            v = getattr(self, k)
            d[k] = None if v is None else v.to_json()
        d["train_flops"] = {k: v.to_json() for k, v in self.train_flops.items()}
        d["matmul_curve"] = {k: v.to_json() for k, v in self.matmul_curve.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> HardwareProfile:
        version = d.get("schema_version")
        if version != HARDWARE_SCHEMA_VERSION:
            raise ValueError(
                f"hardware profile schema version {version} is not supported (this elixir reads "
                f"version {HARDWARE_SCHEMA_VERSION}); re-run `elixir hwprofile`"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"hardware profile has unknown fields {unknown}")
        kw = dict(d)
        for k in _CURVES:
            if kw.get(k) is not None:
                kw[k] = BandwidthCurve.from_json(kw[k])
        kw["train_flops"] = {k: BandwidthCurve.from_json(v) for k, v in kw.get("train_flops", {}).items()}
        kw["matmul_curve"] = {k: BandwidthCurve.from_json(v) for k, v in kw.get("matmul_curve", {}).items()}
        return cls(**kw)

    def save(self, path: str | os.PathLike) -> None:
        """Write as JSON, atomically."""
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        return cls.from_json(read_json(path, "hardware profile"))


# ---------------------------------------------------------------------------------------------
# shipped reference profiles

_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hardware")


def reference_profiles() -> list[str]:
    """Names of the shipped reference profiles (``elixir/data/hardware/*.json``)."""
    if not os.path.isdir(_DATA_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(_DATA_DIR) if f.endswith(".json"))


def load_profile(name_or_path: str | os.PathLike) -> HardwareProfile:
    """A profile from a JSON path, or a shipped reference profile by name."""
    p = os.fspath(name_or_path)
    if os.path.exists(p):
        return HardwareProfile.load(p)
    ref = os.path.join(_DATA_DIR, p if p.endswith(".json") else p + ".json")
    if os.path.exists(ref):
        return HardwareProfile.load(ref)
    raise FileNotFoundError(
        f"no hardware profile {p!r}: give a JSON path (from `elixir hwprofile --out`) or one of "
        f"{reference_profiles()}"
    )


def default_profile() -> HardwareProfile:
    """The shipped profile of this project's CPU box (measured there); used when none is given."""
    return load_profile("cpu-box")


# ---------------------------------------------------------------------------------------------
# measurement


@dataclass(frozen=True)
class MeasureOptions:
    """What :func:`measure` times and how long it may take.

    Attributes:
        sizes: message sizes (bytes) for copy and collective curves.
        repeats: timed repetitions per point (the median is kept).
        optimizer_params: parameters in the timed optimizer update.
        disk_bytes: file size for the disk test (0 skips it).
        matmul_n: side of the square matmul timed per dtype.
        matmul_sides, elementwise_sizes: points of the per-op matmul and elementwise curves.
        train_widths: widths of the reference transformer stacks timed for ``train_flops``.
        offload_dir: where the disk test writes (a temporary file, removed after).
    """

    sizes: tuple[int, ...] = (256 * 1024, 1 * MiB, 8 * MiB, 64 * MiB, 256 * MiB)
    repeats: int = 3
    optimizer_params: int = 32 * 1024 * 1024
    disk_bytes: int = 512 * MiB
    matmul_n: int = 2048
    train_widths: tuple[int, ...] = (128, 256, 512)
    matmul_sides: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    elementwise_sizes: tuple[int, ...] = (4 * 1024, 64 * 1024, 1 * MiB, 16 * MiB, 64 * MiB)
    offload_dir: str = tempfile.gettempdir()

    @classmethod
    def quick(cls, offload_dir: Optional[str] = None) -> MeasureOptions:
        return cls(
            sizes=(256 * 1024, 1 * MiB, 16 * MiB, 64 * MiB), repeats=2, optimizer_params=8 * 1024 * 1024,
            disk_bytes=128 * MiB, matmul_n=1024, train_widths=(128, 256),
            offload_dir=offload_dir or tempfile.gettempdir(),
        )

    @classmethod
    def tiny(cls, offload_dir: Optional[str] = None) -> MeasureOptions:
        """For tests: seconds, not minutes."""
        return cls(
            sizes=(64 * 1024, 1 * MiB), repeats=1, optimizer_params=64 * 1024, disk_bytes=4 * MiB,
            matmul_n=128, train_widths=(64,), matmul_sides=(32, 64), elementwise_sizes=(4096, 65536),
            offload_dir=offload_dir or tempfile.gettempdir(),
        )


def _median_time(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return max(times[(len(times) - 1) // 2], 1e-9)  # lower median


def _sync(device: torch.device) -> Callable[[], None]:
    from elixir import device as dev

    return lambda: dev.synchronize(device)


def measure_copy_curve(
    sizes: tuple[int, ...], src: str, dst: str, pinned: bool, device: torch.device, repeats: int
) -> BandwidthCurve:
    """Copy bandwidth from ``src`` to ``dst`` ("host" or "device"); on CPU-only both are RAM (memcpy)."""
    from elixir import device as dev

    def alloc(where: str, n: int) -> torch.Tensor:
        if where == "host" or device.type == "cpu":
            return dev.empty_host((n // 4,), torch.float32, pin=pinned)
        return torch.empty(n // 4, dtype=torch.float32, device=device)

    bws = []
    for n in sizes:
        a, b = alloc(src, n), alloc(dst, n)
        a.fill_(1)
        nb = dev.non_blocking_ok(a, b.device)
        t = _median_time(lambda a=a, b=b, nb=nb: b.copy_(a, non_blocking=nb), repeats, _sync(device))
        bws.append(a.numel() * 4 / t)
        del a, b
    return BandwidthCurve(tuple(sizes), tuple(bws))


def measure_collectives(sizes: tuple[int, ...], repeats: int, group=None) -> dict:
    """All-gather and reduce-scatter bus bandwidth at each full-message size, across the current
    world (call on every rank; needs an initialised process group of 2+ ranks)."""
    from elixir import device as dev
    from elixir import distributed as edist

    world = edist.get_world_size(group)
    if world < 2:
        raise ValueError("collective bandwidth needs 2+ ranks (run under torchrun or run_distributed)")
    d = dev.default_device()
    ag, rs, ar = [], [], []
    for n in sizes:
        n = max(world * 4, n // (world * 4) * world * 4)  # whole fp32 elements, divisible by world
        full = torch.ones(n // 4, dtype=torch.float32, device=d)
        shard = torch.ones(n // 4 // world, dtype=torch.float32, device=d)

        def timed(fn: Callable[[], Any]) -> float:
            """Median seconds of ``fn`` alone: the ranks line up at a barrier before each run, and
            the barrier is not timed (at small sizes it would cost as much as the collective)."""
            fn()  # warm-up
            times = []
            for _ in range(max(3, repeats + 2)):
                dev.synchronize(d)
                edist.barrier(group)
                t0 = time.perf_counter()
                fn()
                dev.synchronize(d)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        t_ag = timed(lambda f=full, s=shard: edist.all_gather_into(f, s, group))
        t_rs = timed(lambda f=full, s=shard: edist.reduce_scatter_into(s, f, group))
        t_ar = timed(lambda f=full: edist.all_reduce(f, group))
        # The slowest rank sets the pace.
        t_ag = max(edist.all_gather_object(t_ag, group))
        t_rs = max(edist.all_gather_object(t_rs, group))
        t_ar = max(edist.all_gather_object(t_ar, group))
        busbytes = n * (world - 1) / world
        ag.append(busbytes / t_ag)
        rs.append(busbytes / t_rs)
        ar.append(2 * busbytes / t_ar)
    return {
        "sizes": tuple(sizes),
        "all_gather": tuple(ag),
        "reduce_scatter": tuple(rs),
        "all_reduce": tuple(ar),
        "world": world,
        "backend": torch.distributed.get_backend(group),
    }


def _collectives_worker(sizes: tuple[int, ...], repeats: int) -> dict:
    return measure_collectives(sizes, repeats)


def measure_optimizer(n_params: int, device: torch.device, repeats: int) -> tuple[float, str]:
    """fp32 Adam update throughput (params/s) on ``device``: elixir's native CPU Adam on CPU when
    present, otherwise torch's fused AdamW (or foreach where fused is unavailable)."""
    p = torch.zeros(n_params, dtype=torch.float32, device=device, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    opt = None
    impl = ""
    if device.type == "cpu":
        try:  # the native kernel, when the optimizer package provides it
            from elixir.optim import CPUAdam  # type: ignore[attr-defined]

            opt = CPUAdam([p], lr=1e-3)
            impl = "elixir.optim.CPUAdam"
        except Exception:
            opt = None
    if opt is None:
        try:
            opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
            impl = "torch.optim.AdamW(fused=True)"
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
            impl = "torch.optim.AdamW(foreach=True)"
    t = _median_time(opt.step, repeats, _sync(device))
    return n_params / t, impl


def measure_matmul(n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = _median_time(lambda: torch.mm(a, b), repeats, _sync(device))
    return 2.0 * n**3 / t


def measure_train_flops(widths: tuple[int, ...], dtype: torch.dtype, device: torch.device, repeats: int,
                        layers: int = 2, batch: int = 2, seq: int = 128) -> BandwidthCurve:
    """Training throughput of a reference pre-norm transformer stack (GELU MLP, 64-wide heads) at
    each width: FLOPs counted as ``6 * 12 d^2 * layers * tokens`` (the cost model's rule), divided
    by the measured forward+backward time."""
    import torch.nn as nn

    flops, rates = [], []
    for d in sorted(widths):
        torch.manual_seed(0)
        stack = nn.Sequential(*[
            nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers)
        ]).to(device=device, dtype=dtype)
        x = torch.randn(batch, seq, d, device=device, dtype=dtype)

        def step(stack=stack, x=x) -> None:
            stack(x).float().pow(2).mean().backward()

        t = _median_time(step, repeats, _sync(device))
        f = 6.0 * 12 * d * d * layers * batch * seq
        flops.append(int(f))
        rates.append(f / t)
    return BandwidthCurve(tuple(flops), tuple(rates))


def _per_call(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, min_s: float = 2e-3) -> float:
    """Median seconds per call of ``fn``, looping enough calls per sample that each takes ``min_s``."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    calls = max(1, min(10_000, int(min_s / max(time.perf_counter() - t0, 1e-7))))

    def many() -> None:
        for _ in range(calls):
            fn()

    return _median_time(many, max(3, repeats), sync) / calls


def measure_matmul_curve(dtype: torch.dtype, device: torch.device, repeats: int,
                         sides: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)) -> BandwidthCurve:
    """Matmul throughput (FLOP/s) by FLOPs per matmul, on square ``n x n`` products, with the
    fixed cost of one op (a 1x1 product) taken out."""
    sync = _sync(device)
    one = torch.ones(1, 1, device=device, dtype=dtype)
    floor = _per_call(lambda: torch.mm(one, one), sync, repeats)
    flops, rates = [], []
    for n in sides:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t = _per_call(lambda a=a, b=b: torch.mm(a, b), sync, repeats)
        f = 2.0 * n**3
        flops.append(int(f))
        rates.append(f / max(t - floor, t * 0.05))
    return BandwidthCurve(tuple(flops), tuple(rates))


def measure_elementwise_curve(device: torch.device, repeats: int,
                              sizes: tuple[int, ...] = (4 * 1024, 64 * 1024, 1 * MiB, 16 * MiB, 64 * MiB)) -> BandwidthCurve:
    """Bandwidth of a memory-bound op (``a + b`` into a new tensor: reads two, writes one) by the
    bytes it moves, with the fixed cost of one op (on one element) taken out."""
    sync = _sync(device)
    one = torch.ones(1, device=device)
    floor = _per_call(lambda: one + one, sync, repeats)
    moved, rates = [], []
    for n in sizes:
        a = torch.ones(n // 4, device=device)
        b = torch.ones(n // 4, device=device)
        t = _per_call(lambda a=a, b=b: a + b, sync, repeats)
        moved.append(3 * n)
        rates.append(3 * n / max(t - floor, t * 0.05))
    return BandwidthCurve(tuple(moved), tuple(rates))


def measure_op_overhead(device: torch.device, repeats: int, length: int = 200) -> float:
    """Seconds per dispatched op (forward and backward ops alike) in a training step, from a chain
    of ``length`` multiplications of a one-element tensor, forward and backward. Ops are counted at
    the dispatcher, as the tracer counts them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.ones(1, device=device, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(length):
            y = y * 1.0001
        y.sum().backward()
        x.grad = None

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        step()
    t = _median_time(step, max(3, repeats), _sync(device))
    return t / max(1, _Count.n)


def measure_disk(path: str, nbytes: int, block: int = 8 * MiB) -> tuple[float, float]:
    """Sequential write (with fsync) and read bandwidth of a file in ``path``.

    Uses O_DIRECT where the file system allows it, so the page cache does not flatter the read;
    otherwise drops the file's cached pages with posix_fadvise before reading.
    """
    import mmap

    os.makedirs(path, exist_ok=True)
    fname = os.path.join(path, f".elixir-hwprofile-{os.getpid()}.bin")
    nbytes = max(block, nbytes // block * block)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (block // 4096))
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        except OSError:
            direct = 0
            fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        try:
            for _ in range(nbytes // block):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        t_write = time.perf_counter() - t0
        flags = os.O_RDONLY | direct
        fd = os.open(fname, flags)
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        try:
            while os.readv(fd, [buf]) > 0:
                pass
        finally:
            os.close(fd)
        t_read = time.perf_counter() - t0
    finally:
        buf.close()
        if os.path.exists(fname):
            os.unlink(fname)
    return nbytes / max(t_read, 1e-9), nbytes / max(t_write, 1e-9)


def measure(
    options: Optional[MeasureOptions] = None,
    *,
    collective_world: int = 1,
    name: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> HardwareProfile:
    """Measure this machine into a :class:`HardwareProfile`.

    Collectives are measured across the current process group when one of 2+ ranks is initialised
    (under torchrun: every rank calls this; rank 0 then measures the rest alone while the others
    wait, and every rank gets the profile); otherwise, when ``collective_world >= 2``, over
    ``collective_world`` local ranks spawned for the purpose; otherwise they are left unmeasured
    (a world-1 plan needs none).
    """
    from elixir import distributed as edist

    o = options or MeasureOptions()
    say = progress or (lambda s: None)
    say("collectives")
    col = None
    if edist.get_world_size() >= 2:
        col = measure_collectives(o.sizes, o.repeats)
        prof = _measure_local(o, col, name, say) if edist.get_rank() == 0 else None
        return edist.broadcast_object(prof, 0)
    if collective_world >= 2:
        from elixir.testing.dist import run_distributed

        col = run_distributed(_collectives_worker, collective_world, o.sizes, o.repeats, timeout=600)[0]
    return _measure_local(o, col, name, say)


def _measure_local(o: MeasureOptions, col: Optional[dict], name: Optional[str],
                   say: Callable[[str], None]) -> HardwareProfile:
    from elixir import device as dev

    d = dev.default_device()
    dev.keep_host_memory()  # measure host memory as elixir's runtime uses it (freed blocks reused)
    cpu_only = d.type == "cpu"
    label = "memcpy in host RAM (no accelerator: host and device are the same memory)" if cpu_only else "measured"
    host = platform.node() or "unknown"
    src: dict[str, str] = {"*": f"measured by `elixir hwprofile` on {host} ({dev.describe(d)})"}

    say("host<->device copies")
    curves = {}
    for key, s, t, pinned in (
        ("h2d_pinned", "host", "device", True),
        ("h2d_pageable", "host", "device", False),
        ("d2h_pinned", "device", "host", True),
        ("d2h_pageable", "device", "host", False),
        ("device_copy", "device", "device", False),
    ):
        if cpu_only and key in ("h2d_pageable", "d2h_pinned", "d2h_pageable"):
            curves[key] = curves["h2d_pinned"]  # one memcpy curve stands for all directions
        else:
            curves[key] = measure_copy_curve(o.sizes, s, t, pinned, d, o.repeats)
        src[key] = label if key != "device_copy" else ("memcpy in RAM" if cpu_only else "measured")

    ag = rs = arc = None
    world, backend = 0, ""
    if col is not None:
        ag = BandwidthCurve(col["sizes"], col["all_gather"])
        rs = BandwidthCurve(col["sizes"], col["reduce_scatter"])
        arc = BandwidthCurve(col["sizes"], col["all_reduce"]) if "all_reduce" in col else None
        world, backend = col["world"], col["backend"]
        src["all_gather"] = src["reduce_scatter"] = src["all_reduce"] = (
            f"measured: {backend}, {world} ranks on {host}, bus bandwidth")

    say("optimizer")
    opt_rate, opt_impl = {}, {}
    opt_rate["host"], opt_impl["host"] = measure_optimizer(o.optimizer_params, torch.device("cpu"), o.repeats)
    if cpu_only:
        opt_rate["device"], opt_impl["device"] = opt_rate["host"], opt_impl["host"]
    else:
        opt_rate["device"], opt_impl["device"] = measure_optimizer(o.optimizer_params, d, o.repeats)
    src["optimizer_params_per_s"] = f"measured: fp32 Adam over {o.optimizer_params} params ({opt_impl})"

    say("matmul")
    # On a CPU-only machine compute is timed on one thread and scaled by the cores each rank gets
    # (see per_rank): one-thread figures do not depend on how busy the other cores are.
    saved_threads = torch.get_num_threads()
    if cpu_only:
        torch.set_num_threads(1)
    try:
        flops = {}
        for dt in (torch.float32, torch.bfloat16) + (() if cpu_only else (torch.float16,)):
            flops[str(dt).split(".")[-1]] = measure_matmul(o.matmul_n, dt, d, o.repeats)
        say("training throughput")
        train = {name: measure_train_flops(o.train_widths, getattr(torch, name), d, o.repeats)
                 for name in ("float32", "bfloat16")}
        say("per-op costs")
        mm_curve = {name: measure_matmul_curve(getattr(torch, name), d, o.repeats, o.matmul_sides)
                    for name in ("float32", "bfloat16") + (() if cpu_only else ("float16",))}
        ew_curve = measure_elementwise_curve(d, o.repeats, o.elementwise_sizes)
        op_overhead = measure_op_overhead(d, o.repeats)
    finally:
        torch.set_num_threads(saved_threads)
    one = " on 1 thread (scaled by the cores per rank)" if cpu_only else ""
    src["matmul_flops"] = f"measured: {o.matmul_n}x{o.matmul_n} torch.mm{one}"
    src["train_flops"] = (f"measured: 2-layer pre-norm transformer stacks of widths {list(o.train_widths)}, "
                          f"batch 2, seq 128, forward+backward{one}")
    src["matmul_curve"] = (f"measured: square torch.mm {min(o.matmul_sides)} to {max(o.matmul_sides)} wide, "
                           f"less a 1x1 product's time{one}")
    src["elementwise"] = (f"measured: a + b into a new tensor, {min(o.elementwise_sizes)} to {max(o.elementwise_sizes)} "
                          f"bytes each, less a 1-element op's time{one}")
    src["op_overhead_s"] = "measured: a chain of 200 one-element multiplications, forward and backward, per dispatched op"

    say("disk")
    if o.disk_bytes > 0:
        rd, wr = measure_disk(o.offload_dir, o.disk_bytes)
        src["disk_read_bytes_per_s"] = src["disk_write_bytes_per_s"] = (
            f"measured: {o.disk_bytes >> 20} MiB sequential in {o.offload_dir} (fsync; O_DIRECT where allowed)"
        )
    else:
        rd = wr = 1.0
        src["disk_read_bytes_per_s"] = src["disk_write_bytes_per_s"] = "not measured (placeholder 1 B/s)"
    free_disk = shutil.disk_usage(o.offload_dir).free if os.path.isdir(o.offload_dir) else 0

    return HardwareProfile(
        name=name or ("cpu-" + host if cpu_only else host),
        device_type=d.type,
        device_name=dev.describe(d),
        devices_per_node=max(1, torch.cuda.device_count()) if not cpu_only else 1,
        device_memory_bytes=dev.device_capacity(d),
        host_memory_bytes=dev.host_capacity(),
        disk_bytes=free_disk,
        all_gather=ag,
        reduce_scatter=rs,
        all_reduce=arc if col is not None else None,
        collective_world=world,
        collective_backend=backend,
        optimizer_params_per_s=opt_rate,
        optimizer_impl=opt_impl,
        matmul_flops=flops,
        train_flops=train,
        matmul_curve=mm_curve,
        elementwise=ew_curve,
        op_overhead_s=op_overhead,
        compute_threads=1 if cpu_only else 0,
        cores=os.cpu_count() or 1,
        disk_read_bytes_per_s=rd,
        disk_write_bytes_per_s=wr,
        overlap=not cpu_only,
        measured=True,
        source=src,
        host=host,
        created=time.strftime("%Y-%m-%d"),
        notes="",
        **curves,
    )
