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
from dataclasses import dataclass, field
from typing import Any, Optional

from elixir.fileio import atomic_write_json, read_json, require_version

HARDWARE_SCHEMA_VERSION = 1
"""The version of the hardware profile's JSON schema."""

GiB = 1 << 30
"""Bytes in a gibibyte (2**30)."""
MiB = 1 << 20
"""Bytes in a mebibyte (2**20)."""


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
        # the search asks for the same few sizes hundreds of thousands of times: remember them
        # (not fields: equality, hashing and the JSON stay the curve's sizes and bandwidths)
        object.__setattr__(self, "_memo", {})

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
        hit = self._memo.get(nbytes)
        if hit is None:
            if len(self._memo) > 65536:
                self._memo.clear()
            hit = self._memo[nbytes] = self._time(nbytes)
        return hit

    def _time(self, nbytes: float) -> float:
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


STEP_MEMORY_FIELDS = ("step_untracked_bytes", "step_growth_bytes", "heap_slack_per_activation_byte",
                      "disk_plan_heap_slack_per_activation_byte")
"""The profile's figures for what a training step holds beyond every counted term (see
:class:`HardwareProfile`): defaults measured on the CPU box, not by ``elixir hwprofile``."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the compute dtypes a frozen shard decodes into (by name)."""

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
        optimizer_format_ratio: per place (``"device"``, ``"host"``) and low-precision state format
            (``"master/moments"``, e.g. ``"bf16-sr/int8"``, :mod:`elixir.plan.state_format`), the
            seconds per parameter of the Adam step in that format over the fp32 step's, both timed
            in one invocation of ``elixir hwprofile`` (interleaved rounds, fp32 gradients, the
            implementation of ``optimizer_impl``: the native kernel on a CPU, HybridAdam's torch
            path on an accelerator), so that the step's time in a format is the fp32 rate, shared
            and calibrated as :meth:`per_rank` says, times this ratio. A format or place not
            measured (profiles written before issue 33, reference profiles) is priced at the fp32
            rate (ratio 1): the shipped reference profiles' ``source`` says so, and
            ``elixir hwprofile --show`` says so for any profile without the field.
        frozen_decode_elements_per_s: per quantised frozen format (``"nf4"``, ``"int8"``,
            :mod:`elixir.plan.state_format`) and compute dtype name (``"bfloat16"``, ``"float32"``),
            the elements per second at which the runtime's decode
            (:meth:`elixir.chunk.quant.FrozenCodec.decode`: the native kernel for NF4 on a CPU,
            the torch path elsewhere) dequantises a frozen shard into a reused payload on the
            device, on the threads the runtime uses: what each gather of a quantised frozen chunk
            costs beyond its wire bytes and its payload's first touch. A format or dtype not
            measured (profiles written before it, reference profiles) is priced as a device copy
            of the decoded bytes (the price every frozen gather had before; the native NF4
            kernel measured as fast as that copy on the CPU box).
        matmul_flops: dense matmul throughput per dtype name (``"float32"``, ``"bfloat16"``, ...).
        train_flops: per dtype, the training throughput (FLOP/s) of a reference transformer stack
            against the FLOPs of one step (``6 * matmul weights * tokens``, as the cost model counts
            them): it includes attention, elementwise ops and framework overhead that a bare matmul
            does not. Empty in reference profiles (``matmul_flops`` is used then).
        matmul_curve: per dtype, matmul throughput (FLOP/s) by the FLOPs of one matmul, with the
            fixed cost of an op taken out (that is ``op_overhead_s``); empty: use ``matmul_flops``.
        matmul_bytes_curve: per dtype, the rate (bytes per second) at which a matmul moves its
            operands beyond the time its FLOPs take at ``matmul_curve``, by the bytes of one
            matmul: timed on skinny products (8 rows against a square weight, forward and
            weight-gradient shapes, the weights cycled through more memory than the caches hold),
            whose time the FLOPs alone under-price 2-6x on a CPU (packing a whole weight for a
            few rows of work). A matmul costs its FLOPs' time plus its bytes' time: for a square
            product the bytes add a few percent, for a skinny one they are most of it. Empty
            (profiles written before it, reference profiles): the FLOPs alone.
        elementwise: throughput (bytes read + written per second) of a memory-bound op by its
            bytes, fixed cost taken out; None: twice ``device_copy`` (a copy reads and writes).
        all_reduce: all-reduce bus-bandwidth curve (bus bytes ``2 (w - 1) / w`` of the message);
            None: a reduce-scatter plus an all-gather (the ring algorithm NCCL uses).
        op_overhead_s: fixed seconds per dispatched op in a training step (framework dispatch,
            autograd bookkeeping, kernel launch), timed on a chain of tiny ops with autograd.
        first_touch_bytes_per_s: on a CPU-only machine, how fast fresh memory is faulted in on its
            first write (a new 64 MiB tensor filled, less the same fill of a reused one): what
            each gathered payload costs beyond its all-gather, since it is allocated for the
            gather and freed after use. 0: not measured, or an accelerator (whose caching
            allocator hands blocks back without faults).
        step_untracked_bytes: host bytes a training process holds at the peak of a step beyond
            the process as measured before it trains, the runtime's booked tensors, the optimizer
            state and the traced activations (kernels and thread pools loaded on first use,
            allocator slack, temporaries the tracer does not see). Measured with
            ``bench/memory_breakdown.py`` at each training peak on the 24 GB CPU box (world 1, bf16,
            disk plans at 0.12-0.44B): at most 50 MiB in all (24-26 MiB of growth between the
            search and the first step, up to 25 MiB over the traced activation peak and autograd's
            parameter gradient at the peak of backward); 96 MiB leaves room.
        step_growth_bytes: what the process grows by on its first training step (kernels and
            thread pools loaded on first use): 20-25 MiB measured on the CPU box with the same
            bench; the default (32 MiB) holds that with room. (Measured on the calibration's
            reference model, the growth beyond every accounted byte was 15.4-15.6 MiB over the
            first fp32 step of a fresh process, and 68-70 MiB summed over the first steps of its
            three runs: the larger sizes add workspaces that scale with the model, which is
            :attr:`step_untracked_bytes`'s, so neither is this figure and hwprofile keeps it.)
        heap_slack_per_activation_byte: where activations live in host RAM (a CPU device), the
            resident growth of a step over malloc's in-use peak, per traced activation byte:
            glibc's heap keeps a step's freed temporaries resident between the saved activations
            (elixir stops trimming within a step). Measured with ``bench/memory_breakdown.py``
            after a warm-up step and a trim (bf16 LLaMA, seq 256): 0.32x the activations fully
            trainable (hidden 1024, 8 layers), 0.34x / 0.57x / 0.62x with PEFT LoRA r=8 at hidden
            1024 / 1536 / 2048 (LoRA's transient full-width adapter outputs interleave with the
            saved tensors; issue 19); 0.85 covers the largest with room. Unused on an accelerator.
        disk_plan_heap_slack_per_activation_byte: the same slack for a plan that streams from disk,
            which runs under :func:`elixir.device.return_host_memory` (blocks of 1 MiB and more
            mapped on their own): only activations under 1 MiB churn through the heap. Measured:
            the 6.29B capacity plan (7 HK + 25 KK, 1.6 GiB of activations) peaked 0.64 GiB under
            every other term, and PEFT LoRA at hidden 6144 with frozen shards on disk kept
            0.003-0.004 GiB in the heap over 0.15-0.30 GiB of activations (0.02x); 0.1 has room.
            These four figures describe the runtime's host allocator on a machine, not one
            resource: ``elixir hwprofile`` does not measure them (each needs a training run at a
            known peak) and writes the defaults above, measured as said, naming them in ``source``.
        calibration: per number of ranks per node (a string key), measured / predicted time of the
            step components ``compute``, ``collectives`` (the all-gathers and reduce-scatters),
            ``all_reduce`` (where measured; else ``collectives``) and ``optimizer`` when elixir's runtime
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
    matmul_bytes_curve: dict[str, BandwidthCurve] = field(default_factory=dict)
    elementwise: Optional[BandwidthCurve] = None
    optimizer_format_ratio: dict[str, dict[str, float]] = field(default_factory=dict)
    frozen_decode_elements_per_s: dict[str, dict[str, float]] = field(default_factory=dict)
    op_overhead_s: float = 0.0
    first_touch_bytes_per_s: float = 0.0
    step_untracked_bytes: int = 96 * MiB
    step_growth_bytes: int = 32 * MiB
    heap_slack_per_activation_byte: float = 0.85
    disk_plan_heap_slack_per_activation_byte: float = 0.1
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
            frozen_decode_elements_per_s={k: {d: v * f if cpu else v for d, v in r.items()}
                                          for k, r in self.frozen_decode_elements_per_s.items()},
            matmul_flops={d: v * fc for d, v in self.matmul_flops.items()},
            train_flops={d: c.scaled(fc) for d, c in self.train_flops.items()},
            matmul_curve={d: c.scaled(fc) for d, c in self.matmul_curve.items()},
            matmul_bytes_curve={d: c.scaled(fc) for d, c in self.matmul_bytes_curve.items()},
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
            matmul_bytes_curve={d: v.scaled(1 / float(cal.get(f"compute_{d}", c)))
                                for d, v in self.matmul_bytes_curve.items()},
            elementwise=(self.elementwise or self.device_copy.scaled(2.0)).scaled(1 / c),
            op_overhead_s=float(cal.get("op_overhead_s", self.op_overhead_s * c)),
            all_gather=self.all_gather.scaled(1 / col) if self.all_gather is not None else None,
            reduce_scatter=self.reduce_scatter.scaled(1 / col) if self.reduce_scatter is not None else None,
            all_reduce=(self.all_reduce.scaled(1 / float(cal.get("all_reduce", col)))
                        if self.all_reduce is not None else None),
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

    def first_touch_time(self, nbytes: float) -> float:
        """Seconds to fault in ``nbytes`` of freshly allocated memory on its first write (0 where
        not measured)."""
        return nbytes / self.first_touch_bytes_per_s if self.first_touch_bytes_per_s > 0 and nbytes > 0 else 0.0

    def frozen_decode_time(self, numel: float, fmt: str, dtype: str) -> float:
        """Seconds to dequantise ``numel`` elements of a frozen shard in ``fmt`` into ``dtype``
        (a name, ``"bfloat16"``) at the measured :attr:`frozen_decode_elements_per_s`; where not
        measured, a device copy of the decoded bytes."""
        if numel <= 0:
            return 0.0
        rate = self.frozen_decode_elements_per_s.get(fmt, {}).get(dtype)
        if rate:
            return numel / rate
        return self.device_copy.time(numel * _DTYPE_BYTES.get(dtype, 2))

    def step_extra_bytes(self, activation_bytes: int, activations_on_host: bool, streams_from_disk: bool = False) -> int:
        """Host bytes a training step adds to the measured process beyond every counted term: the
        fixed :attr:`step_untracked_bytes`, or, where the activations are in host RAM and their
        heap slack is larger, :attr:`step_growth_bytes` plus the slack per activation byte
        (:attr:`disk_plan_heap_slack_per_activation_byte` for a plan that ``streams_from_disk``,
        never more than the other)."""
        if not activations_on_host:
            return self.step_untracked_bytes
        act = int(activation_bytes)
        keep = max(self.step_untracked_bytes, self.step_growth_bytes + int(self.heap_slack_per_activation_byte * act))
        if not streams_from_disk:
            return keep
        disk = max(self.step_untracked_bytes, self.step_growth_bytes + int(self.disk_plan_heap_slack_per_activation_byte * act))
        return min(disk, keep)

    def h2d_time(self, nbytes: float, pinned: bool = True) -> float:
        return (self.h2d_pinned if pinned else self.h2d_pageable).time(nbytes)

    def d2h_time(self, nbytes: float, pinned: bool = True) -> float:
        return (self.d2h_pinned if pinned else self.d2h_pageable).time(nbytes)

    def optimizer_time(self, params: float, where: str, formats: tuple[str, str] = ("fp32", "fp32")) -> float:
        """Seconds for one Adam update of ``params`` elements on ``where`` ("device"/"host") with
        the state in ``formats`` (master, moments): the fp32 rate times the format's measured
        :attr:`optimizer_format_ratio` (1 where not measured)."""
        if params <= 0:
            return 0.0
        rate = self.optimizer_params_per_s.get(where)
        if not rate:
            raise ValueError(f"hardware profile {self.name!r} has no optimizer throughput for {where!r}")
        return params / rate * self.optimizer_ratio(where, formats)

    def optimizer_ratio(self, where: str, formats: tuple[str, str]) -> float:
        """The Adam step's seconds per parameter in ``formats`` over fp32's on ``where`` (see
        :attr:`optimizer_format_ratio`; 1.0 for fp32 state, or a format the profile did not time)."""
        if tuple(formats) == ("fp32", "fp32"):
            return 1.0
        return float(self.optimizer_format_ratio.get(where, {}).get("/".join(formats), 1.0))

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
        matmul-like ops add their FLOPs at the matmul throughput for their size and their operand
        bytes at :attr:`matmul_bytes_curve` (where measured); other ops add their bytes at the
        elementwise bandwidth for their size."""
        mm = self.matmul_curve.get(dtype) or self.matmul_curve.get("float32")
        mb = self.matmul_bytes_curve.get(dtype) or self.matmul_bytes_curve.get("float32")
        ew = self.elementwise or self.device_copy.scaled(2.0)
        t = costs.ops * self.op_overhead_s
        for n, flops, *moved in costs.matmul.values():
            t += n * mm.time(flops / n) if mm is not None else self.matmul_time(flops, dtype)
            if mb is not None and moved and moved[0] > 0:
                t += n * mb.time(moved[0] / n)
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
        d["matmul_bytes_curve"] = {k: v.to_json() for k, v in self.matmul_bytes_curve.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> HardwareProfile:
        require_version(d.get("schema_version"), HARDWARE_SCHEMA_VERSION, "hardware profile schema",
                        "re-run `elixir hwprofile`")
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
        kw["matmul_bytes_curve"] = {k: BandwidthCurve.from_json(v) for k, v in kw.get("matmul_bytes_curve", {}).items()}
        return cls(**kw)

    def save(self, path: str | os.PathLike) -> None:
        """Write as JSON, atomically."""
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        return cls.from_json(read_json(path, "hardware profile"))
