"""optimal_search: the plan with the lowest predicted step time that fits the memory budgets.

It scores candidate chunk sizes (a geometric grid between the largest parameter and the whole
model, plus the least-padding size), numbers of rCache blocks (from the fewest any step can run
with upwards), prefetch depths (when ``overlap``) and, for each, the fastest per-chunk placement of
shards and optimizer state (:func:`~elixir.search.cost_model.place`). Gathers come from the cache
simulator under Belady's rule; costs from the hardware profile (:mod:`elixir.search.cost_model`).

The candidate space is finite and every loop is bounded, so the search always terminates. It
raises :class:`DoesNotFitError` exactly when no candidate fits: the fewest blocks with everything
offloaded is tried for every chunk size, and more blocks only add memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from rich.console import Console
from rich.table import Table

from elixir import device as dev
from elixir import distributed as edist
from elixir.hardware.profile import HardwareProfile
from elixir.hardware.registry import choose_default_profile, load_profile
from elixir.plan import ChunkPlan, MeshLayout, Placement, Prediction, SearchResult, dtype_name
from elixir.plan.budgets import INF, Budgets, DoesNotFitError, budget_head, budgets_for, fmt_bytes
from elixir.plan.footprint import (
    disk_bytes_per_element,
    element_bytes,
    optimizer_state_bytes,
    optimizer_state_nbytes,
)
from elixir.plan.placement import DD, RD
from elixir.plan.state_format import (
    FP32_STATE,
    QUANT_BLOCK,
    check_state_formats,
    is_lossy,
    leaner_formats,
    master_bytes,
)
from elixir.search.bounds import SLACK, StepFloor, fits_floor, layout_fits_floor
from elixir.search.cost_model import (
    ALIGN,
    HOST_TERMS,
    Evaluation,
    Layout,
    MemoryPolicy,
    Setting,
    pack,
    place,
    replicate,
    round_up,
    simulate_layout,
    unified_memory,
)
from elixir.search.minimum_waste import best_chunk_size
from elixir.search.step_profile import RECOMPUTE, StepProfile, profile_from_module, profile_step
from elixir.tables import human_bytes, human_count, longest_word

GRID_POINTS = 48  # geometric chunk-size candidates
REPLICATED_POINTS = 8  # chunk sizes (all-reduce bucket sizes) tried for the fully replicated plan
EXTRA_BLOCKS = 6  # block counts tried above the minimum one by one (then geometrically)
MAX_DEPTH = 2  # deepest prefetch tried when overlap is on
# counts of ZeRO-1/2 body chunks tried per layout beyond which they are spaced out (zero_candidates)
ZERO_POINTS = 12
# optimizers whose state the low-precision formats describe (Adam's moments; plan/footprint.py names)
LOSSY_OPTIMIZERS = ("adam", "adamw", "hybridadam", "cpuadam")

_CHUNK_SIZES: dict[tuple, tuple[StepProfile, Any]] = {}  # chunk-size candidates, least-padding sizes


def chunk_size_candidates(profile: StepProfile, world: int, points: int = GRID_POINTS) -> list[int]:
    """Chunk sizes to score: a geometric grid from the largest sharded parameter to the whole
    (sharded) model, and the size with the least padding. Remembered per profile (the no-fit
    diagnostics ask again for every budget they try): read the list, do not change it."""
    key = (id(profile), world, points)
    hit = _CHUNK_SIZES.get(key)
    if hit is None or hit[0] is not profile:
        if len(_CHUNK_SIZES) > 64:
            _CHUNK_SIZES.clear()
        hit = _CHUNK_SIZES[key] = (profile, _chunk_size_candidates(profile, world, points))
    return hit[1]


def _chunk_size_candidates(profile: StepProfile, world: int, points: int) -> list[int]:
    numel = profile.numel
    sh = [numel[n] for n in profile.use_order() if n not in profile.shared]
    if not sh:
        return [0]
    align = ALIGN * world
    lo = round_up(max(sh), align)
    hi = max(lo, round_up(sum(sh), align))
    sizes = {lo, hi}
    if hi > lo:
        r = (hi / lo) ** (1 / max(1, points - 1))
        for i in range(points):
            sizes.add(min(hi, round_up(int(lo * r**i), align)))
    sizes.add(_least_padding(profile, world, sh, align))
    return sorted(s for s in sizes if s >= lo)


def _least_padding(profile: StepProfile, world: int, numels: list[int], align: int) -> int:
    """``best_chunk_size(numels, align)``, remembered per (profile, world) beside the candidates:
    the grid and the replicated plan's sizes ask for it alike."""
    key = (id(profile), world, "least padding")
    hit = _CHUNK_SIZES.get(key)
    if hit is None or hit[0] is not profile:
        hit = _CHUNK_SIZES[key] = (profile, best_chunk_size(numels, align))
    return hit[1]


BODY_SHARDINGS = ("mixed", "sharded", "zero")


def zero_candidates(layout: Layout, world: int, body_sharding: str = "mixed") -> list[int]:
    """How many of ``layout``'s body chunks to try as ZeRO-1/2 (parameters whole, state split; the
    most used first, :func:`~elixir.search.cost_model.zero_order`) beside the all-sharded layout
    (world size > 1): every count from none to all ``n`` body chunks, or, with more than
    :data:`ZERO_POINTS` of them, that many evenly spaced counts plus one and ``n - 1``.

    Trying only none, one, half and all hid the mixed plans that pay most: a ZeRO-1/2 chunk saves
    a sharded chunk's re-gather in backward for 2 bytes per element more (fp32, Adam), where one
    more rCache block saves one gather for 4, so on a budget just short of the pure ZeRO-1/2 plan
    the fastest plan has most but not all chunks ZeRO-1/2, and half of them was the most tried.

    ``body_sharding`` restricts the counts: ``"sharded"`` only none (pure ZeRO-3), ``"zero"`` only
    all (pure ZeRO-1/2), ``"mixed"`` any of them."""
    if body_sharding not in BODY_SHARDINGS:
        raise ValueError(f"body_sharding must be one of {BODY_SHARDINGS}, got {body_sharding!r}")
    n = layout.n_sharded - layout.own
    if world == 1 or n == 0:
        return [0]
    if body_sharding != "mixed":
        return [0 if body_sharding == "sharded" else n]
    if n <= ZERO_POINTS:
        return list(range(n + 1))
    return sorted({round(i * n / ZERO_POINTS) for i in range(ZERO_POINTS + 1)} | {1, n - 1})


def _block_candidates(layout: Layout, world: int = 2) -> list[int]:
    """Block counts to try, smallest first. At world size 1, 0 blocks (every shard on the device,
    kept whole by the runtime) comes first. Frozen chunks go through the same blocks."""
    n, lo = layout.n_sharded + layout.n_frozen, layout.min_blocks
    if n == 0:
        return [0]
    lo = max(1, lo)
    if world == 1:
        return [0] + _block_candidates(layout, 2)
    out = set(range(lo, min(n, lo + EXTRA_BLOCKS) + 1))
    b = lo + EXTRA_BLOCKS
    while b < n:
        out.add(b)
        b = int(b * 1.5) + 1
    out.add(n)
    return sorted(x for x in out if lo <= x <= max(lo, n))


_LAYOUTS: dict[tuple[int, int], tuple[StepProfile, dict]] = {}


def _layout_cache(profile: StepProfile, world: int) -> dict[tuple[int, bool, int], Layout]:
    """The packed layouts of ``profile`` at ``world`` ranks, shared by every searcher on them (the
    leaner configuration, the unconstrained one of the report, the diagnostics' siblings): packing
    depends on nothing else."""
    hit = _LAYOUTS.get((id(profile), world))
    if hit is None or hit[0] is not profile:
        if len(_LAYOUTS) > 1:  # one profile's at a time: a process that plans again holds no stale layouts
            _LAYOUTS.clear()
        hit = _LAYOUTS[(id(profile), world)] = (profile, {})
    return hit[1]


_RANK_SHARES: dict[tuple[int, int], tuple[HardwareProfile, HardwareProfile]] = {}


def _rank_share(hw: HardwareProfile, ranks_per_node: int) -> HardwareProfile:
    """``hw.per_rank(ranks_per_node)``, one object per (profile, ranks): what the cost model
    remembers per hardware (:func:`~elixir.search.cost_model.per_hardware`) is then shared by
    the sibling searches (the lean configuration, the report's unconstrained one)."""
    key = (id(hw), ranks_per_node)
    hit = _RANK_SHARES.get(key)
    if hit is None or hit[0] is not hw:
        if len(_RANK_SHARES) > 16:
            _RANK_SHARES.clear()
        hit = _RANK_SHARES[key] = (hw, hw.per_rank(ranks_per_node))
    return hit[1]


@dataclass(frozen=True)
class SearchRequest:
    """Everything one search is asked, in one object: the step, the ranks, the machine, the
    budgets (bytes per rank) and the policies. :func:`search_profile` builds it from its keywords;
    the stages after it (candidates, pricing, the choice, the report) each take it whole."""

    profile: StepProfile
    world: int
    hardware: HardwareProfile
    budgets: Budgets
    optimizer_type: str = "Adam"
    overlap: bool = False
    policy: MemoryPolicy = dataclasses.field(default_factory=MemoryPolicy)
    reduce_dtype: Optional[str] = None  # dtype name; None: the compute dtype
    grad_dtype: str = "float32"
    fused_step: bool = False
    process_bytes: int = 0
    body_sharding: str = "mixed"
    heap_slack_bytes: int = 0
    frozen_format: Optional[str] = None  # frozen chunks quantised: "nf4", "int8" (plan/state_format.py)
    formats: tuple[str, str] = FP32_STATE  # the optimizer state's (master, moments), plan/state_format.py

    def __post_init__(self) -> None:
        optimizer_state_bytes(self.optimizer_type)  # raises naming the known optimizers
        if self.world < 1:
            raise ValueError(f"group_size must be >= 1, got {self.world}")
        check_state_formats(*self.formats, where="optimal_search")
        if is_lossy(*self.formats) and self.optimizer_type.lower() not in LOSSY_OPTIMIZERS:
            raise ValueError(f"master={self.formats[0]!r}, moments={self.formats[1]!r} are Adam state formats (CPUAdam/"
                             f"HybridAdam); optimizer_type {self.optimizer_type!r} keeps its own: plan it with "
                             "optimizer_type='Adam' or leave the formats at 'fp32'")

    def setting(self) -> Setting:
        """The cost model's :class:`Setting` for this request."""
        hw, prof = self.hardware, self.profile
        return Setting(
            layout=MeshLayout.data_parallel(self.world), elem=element_bytes(prof.dtype),
            reduce_elem=element_bytes(self.reduce_dtype or prof.dtype), opt_bytes=optimizer_state_bytes(self.optimizer_type),
            hardware=_rank_share(hw, hw.ranks_per_node(self.world)), dtype=prof.dtype, grad_elem=element_bytes(self.grad_dtype),
            fused_step=self.fused_step, process_bytes=int(self.process_bytes),
            heap_slack_bytes=min(int(self.heap_slack_bytes), int(self.process_bytes)),
            frozen_format=self.frozen_format, master_format=self.formats[0], moments_format=self.formats[1],
        )


class _Searcher:
    """One search over a :class:`SearchRequest`: its candidates, their prices, the choice and the
    no-fit diagnostics. Siblings (:meth:`sibling`) share the packed layouts."""

    def __init__(self, request: SearchRequest) -> None:
        self.request = request
        self.profile = request.profile
        self.world = request.world
        self.hw = request.hardware
        self.budgets = request.budgets
        self.policy = request.policy
        self.overlap = request.overlap
        self.setting = request.setting()
        self.optimizer_type = request.optimizer_type
        self.reduce_dtype = request.reduce_dtype
        self.grad_dtype = request.grad_dtype
        self.fused_step = request.fused_step
        self.body_sharding = request.body_sharding
        self.usable = self.policy.usable(self.budgets.device, self.budgets.host, self.budgets.disk)
        self._layouts = _layout_cache(self.profile, self.world)
        self.rejected = 0  # candidates the budgets ruled out in the last run

    @property
    def tied_modes(self) -> tuple[bool, ...]:
        """How tied parameters may be chunked: replicated (False), or also sharded (True) when
        there are any and more than one rank (the cost model prices both)."""
        return (False, True) if self.profile.shared and self.world > 1 else (False,)

    def sibling(self, **changes: Any) -> _Searcher:
        """A searcher with this request's model, optimizer, dtypes and hardware, and ``changes``
        (:class:`SearchRequest` fields) to the world size, budgets, overlap or policy (the no-fit
        diagnostics and the report ask them)."""
        return _Searcher(dataclasses.replace(self.request, **changes))

    def layout(self, c: int, shard_shared: bool = False, zero: int = 0) -> Layout:
        key = (c, shard_shared, zero)
        if key not in self._layouts:
            self._layouts[key] = pack(self.profile, c, self.world, shard_shared, zero)
        return self._layouts[key]

    def layouts(self, c: int, shard_shared: bool = False) -> list[Layout]:
        """The layouts tried for chunk size ``c``: all sharded, and with :func:`zero_candidates`
        of the body chunks ZeRO-1/2."""
        lay = self.layout(c, shard_shared)
        return [self.layout(c, shard_shared, z) for z in zero_candidates(lay, self.world, self.body_sharding)]

    def layout_of(self, ev: Evaluation) -> Layout:
        """The layout an evaluation was made on (the packed one, or its fully replicated twin)."""
        lay = self.layout(ev.chunk_size, ev.shard_shared, ev.zero)
        if lay.n_sharded and all(p.replicated for p in ev.placements):
            return replicate(self.profile, lay)
        return lay

    def evaluate(self, layout: Layout, blocks: int, depth: int, usable=None,
                 profile: Optional[StepProfile] = None, gathers=None) -> Optional[Evaluation]:
        """``profile`` (default: the searcher's) may differ from it in activation bytes only: the
        layouts are the searcher's. ``gathers``: ``simulate_layout(layout, blocks)``, if known."""
        g = simulate_layout(layout, blocks) if gathers is None else gathers
        usable = usable or self.usable
        return place(profile or self.profile, layout, self.setting, blocks, depth, usable, usable[2] > 0, g)

    def fits(self, usable=None, profile: Optional[StepProfile] = None) -> bool:
        """Whether any candidate fits: the fewest blocks, no prefetch, for every chunk size (none
        when the budgets are below :func:`~elixir.search.bounds.memory_floor`)."""
        if not fits_floor(profile or self.profile, self.setting, usable or self.usable):
            return False
        groups = [(c, tied) for c in chunk_size_candidates(self.profile, self.world) for tied in self.tied_modes]
        # each chunk size's first layout (all sharded, where ZeRO-1/2 chunks may mix in: the leanest
        # as a rule) first, then the other ZeRO-1/2 counts, packed only where the answer is still no
        for rest in (False, True):
            for c, tied in groups:
                base = self.layout(c, tied)
                n_body = base.n_sharded - base.own
                zs = zero_candidates(base, self.world, self.body_sharding)
                zs = [z for z in (zs[1:] if rest else zs[:1])  # packed only if their floor fits
                      if layout_fits_floor(profile or self.profile, self.setting, usable or self.usable, c, z, n_body)]
                for lay in (self.layout(c, tied, z) for z in zs):
                    for b in _block_candidates(lay, self.world)[: 2 if self.world == 1 else 1]:
                        if self.evaluate(lay, b, 0, usable, profile) is not None:
                            return True
        return False

    def _depths(self, lay: Layout, b: int) -> range:
        """Prefetch depths tried with ``b`` blocks: up to :data:`MAX_DEPTH` blocks beyond the
        fewest a step needs, when overlapping and anything is gathered."""
        if self.overlap and lay.n_sharded + lay.n_frozen and b:
            return range(0, min(MAX_DEPTH, b - max(1, lay.min_blocks)) + 1)
        return range(1)

    def run(self, prune: bool = True, diagnose: bool = True,
            fastest_below: float = math.inf) -> tuple[Evaluation, list[Evaluation], int]:
        """Score every candidate; return the fastest that fits, all that fit, and how many were
        considered. ``self.rejected`` is nonzero exactly when the budgets ruled out a candidate.

        Budgets below :func:`~elixir.search.bounds.memory_floor` are refused before anything is
        priced. With ``prune``, a candidate whose :func:`~elixir.search.bounds.step_time_floor`
        is above the best time found so far for its chunk size (and way of chunking tied
        parameters) is not priced; each layout's most blocks and deepest prefetch are priced first
        (memoised), so that the best is known early. The best of each chunk size, hence the winner,
        the runner-ups and the tied alternative, are exactly those of the full scan (``prune=False``):
        ``results`` holds fewer of the losers, in the full scan's order among equals. Without
        ``diagnose``, the :class:`DoesNotFitError` raised names no changes that would fit.

        ``fastest_below`` (a step time some plan is known to reach): only the winner is wanted,
        and only if it is faster; the best time found so far in any group then prunes every later
        group too, seeded with this bound (the report's unconstrained search). Raises
        :class:`DoesNotFitError` when nothing priced beats the bound."""
        self.rejected = 0
        self.priced = 0
        if not fits_floor(self.profile, self.setting, self.usable):
            raise self.no_fit_error() if diagnose else DoesNotFitError("no plan fits", [], {})
        keyed: list[tuple[tuple, Evaluation]] = []  # (position in the full scan, evaluation)
        scored = 0
        bound, hopeful = fastest_below, None
        if fastest_below < math.inf and prune and self.world > 1:
            bound, hopeful = self._likely_fastest(bound)
        for ci, c in enumerate(chunk_size_candidates(self.profile, self.world)):
            for ti, tied in enumerate(self.tied_modes):
                lays = self.layouts(c, tied)
                if hopeful is not None:  # only the winner is wanted: layouts that cannot beat the bound go
                    lays = [lay for lay in lays if hopeful.get(id(lay), math.inf) <= bound * (1 + SLACK)]
                n, found = self._run_group((ci, ti), lays, prune and self.world > 1, bound)
                scored += n
                keyed += found
                if fastest_below < math.inf and found:
                    bound = min(bound, min(e.step_time for _, e in found))
        # every chunk replicated (data parallel), where the memory allows it; not when the caller
        # asked for pure plans (body_sharding "sharded" / "zero"): that twin is neither
        if self.world > 1 and self.body_sharding == "mixed":
            for ri, c in enumerate(chunk_size_candidates(self.profile, self.world, points=REPLICATED_POINTS)):
                scored += 1
                self.priced += 1
                twin = replicate(self.profile, self.layout(c))
                ev = self.evaluate(twin, twin.min_blocks if twin.n_frozen else 0, 0)  # frozen chunks stay sharded
                if ev is not None:
                    keyed.append(((1 << 30, ri), ev))
                else:
                    self.rejected += 1
        if fastest_below < math.inf:
            keyed = [(k, e) for k, e in keyed if e.step_time <= fastest_below]
        if not keyed:
            if fastest_below < math.inf:
                raise DoesNotFitError(f"no plan is faster than {fastest_below:.6g} s", [], {})
            raise self.no_fit_error() if diagnose else DoesNotFitError("no plan fits", [], {})
        keyed.sort(key=lambda x: (x[1].step_time, x[1].device_bytes, x[0]))
        results = [e for _, e in keyed]
        return results[0], results, scored

    def _likely_fastest(self, bound: float) -> tuple[float, dict[int, float]]:
        """A tighter ``bound`` for :meth:`run`'s ``fastest_below``: every layout at its most
        blocks and deepest prefetch (the likely best of each), priced in the order of their
        :class:`~elixir.search.bounds.StepFloor` until the next floor is above the best time
        found. Also each layout's floor there (by ``id``), a floor for all its candidates: more
        blocks never gather more (the cache simulator's eviction is Belady's, which has no
        anomaly) and the floor does not grow with the prefetch depth."""
        tops = []
        for c in chunk_size_candidates(self.profile, self.world):
            for tied in self.tied_modes:
                for lay in self.layouts(c, tied):
                    b = _block_candidates(lay, self.world)[-1]
                    g = simulate_layout(lay, b)
                    d = self._depths(lay, b)[-1]
                    tops.append((StepFloor(self.profile, lay, self.setting, g).at(d), len(tops), lay, b, d, g))
        tops.sort(key=lambda t: t[:2])
        for floor, _, lay, b, d, g in tops:
            if floor > bound * (1 + SLACK):
                break
            ev = self.evaluate(lay, b, d, gathers=g)
            self.priced += 1
            if ev is not None:
                bound = min(bound, ev.step_time)
        return bound, {id(t[2]): t[0] for t in tops}

    def _run_group(self, pos: tuple[int, int], lays: list[Layout], prune: bool,
                   bound: float = math.inf) -> tuple[int, list[tuple[tuple, Evaluation]]]:
        """Every candidate of one chunk size and way of chunking tied parameters (``lays``: the
        ZeRO-1/2 counts), ascending blocks per layout until one does not fit (more blocks only
        need more memory), less those pruned (see :meth:`run`). Returns how many were considered
        and the (position in the full scan, evaluation) of those priced that fit; ``pos`` is the
        group's (chunk size, tied mode) position; ``bound``, a time the caller needs beaten (see
        :meth:`run`'s ``fastest_below``): candidates whose floor is above it are not priced."""
        memo: dict[tuple[int, int, int], tuple[Optional[Evaluation], Any]] = {}
        best = bound
        blocks = [_block_candidates(lay, self.world) for lay in lays]
        if prune:  # each layout at its most blocks and deepest prefetch first: the likely best,
            # priced in the order of their floors until the next floor is above the best found (the
            # rest could not lower it: the best, hence the scan below, is the same as pricing all)
            tops = []
            for zi, lay in enumerate(lays):
                b = blocks[zi][-1]
                g = simulate_layout(lay, b)
                d = self._depths(lay, b)[-1]
                tops.append((StepFloor(self.profile, lay, self.setting, g).at(d), zi, b, d, g))
            for floor, zi, b, d, g in sorted(tops, key=lambda t: t[:2]):
                if floor > best * (1 + SLACK):
                    break
                ev = self.evaluate(lays[zi], b, d, gathers=g)
                self.priced += 1
                memo[(zi, b, d)] = (ev, g)
                if ev is not None:
                    best = min(best, ev.step_time)
        scored, out = 0, []
        for zi, lay in enumerate(lays):
            pruned_b, fit_b, failed = None, -1, False
            for b in blocks[zi]:
                g = floor = None
                for d in self._depths(lay, b):
                    scored += 1
                    hit = memo.get((zi, b, d))
                    if hit is not None:
                        ev = hit[0]
                    else:
                        g = simulate_layout(lay, b) if g is None else g
                        if prune and best < math.inf:
                            floor = floor or StepFloor(self.profile, lay, self.setting, g)
                            if floor.at(d) > best * (1 + SLACK):
                                pruned_b = b
                                continue
                        ev = self.evaluate(lay, b, d, gathers=g)
                        self.priced += 1
                    if ev is None:
                        self.rejected += 1
                        failed = True
                    else:
                        out.append(((*pos, zi, b, d), ev))
                        best = min(best, ev.step_time)
                        fit_b = b
                if failed and b > 0:
                    break  # more blocks only need more memory (memory does not depend on the depth)
            if pruned_b is not None and pruned_b > fit_b and not failed and not self.rejected:
                # whether the full scan would have met a candidate that does not fit: by the rule
                # above, exactly when the most blocks pruned do not fit (search_profile's `binds`)
                if self.evaluate(lay, pruned_b, 0) is None:
                    self.rejected += 1
        return scored, out

    # ---- diagnostics ----

    def no_fit_error(self) -> DoesNotFitError:
        dev, host, disk = self.usable
        needs: dict[str, Any] = {}
        options: list[tuple[float, str]] = []

        # each suggestion changes one thing only, and is checked to fit
        min_dev = self._min_needed(lambda v: (v, host, disk), dev)
        if min_dev is not None and min_dev > dev:
            need = math.ceil(min_dev / (1 - self.policy.device_margin)) + 1
            needs["device_memory"] = need
            options.append((need / max(1, self.budgets.device) - 1, f"device memory >= {fmt_bytes(need)} per rank (budget {fmt_bytes(self.budgets.device)})"))
        min_host = self._min_needed(lambda v: (dev, v, disk), host)
        if min_host is not None and min_host > host:
            need = math.ceil(min_host / (1 - self.policy.host_margin)) + 1
            needs["host_memory"] = need
            options.append((need / max(1, self.budgets.host) - 1, f"host memory >= {fmt_bytes(need)} per rank (budget {fmt_bytes(self.budgets.host)})"))
        if unified_memory(self.hw) and "device_memory" not in needs and "host_memory" not in needs:
            # device = host RAM: the pool grows as one (device cap and host budget together)
            min_pool = self._min_needed(lambda v: (v, v, disk), max(dev, host))
            if min_pool is not None and min_pool > min(dev, host):
                margin = max(self.policy.device_margin, self.policy.host_margin)
                need = math.ceil(min_pool / (1 - margin)) + 1
                needs["memory"] = need
                options.append((need / max(1, self.budgets.host) - 1, f"memory >= {fmt_bytes(need)} per rank (device and "
                                f"host are one pool of host RAM on this CPU profile; budget {fmt_bytes(self.budgets.host)})"))
        if self.budgets.disk == 0 and self.fits((dev, host, INF)):
            d_need = self._min_needed(lambda v: (dev, host, v), 1 << 20)
            if d_need is not None:
                d_need = math.ceil(d_need / (1 - self.policy.disk_margin)) + 1
                needs["disk"] = d_need
                options.append((0.5, f"allow disk offload of optimizer state (disk >= {fmt_bytes(d_need)} per rank)"))
        w = self.world
        # more ranks can be priced only on a profile that measured collectives (a one-GPU profile has none)
        priced_collectives = None not in (self.hw.all_gather, self.hw.reduce_scatter)
        for _ in range(16 if priced_collectives else 0):
            w *= 2
            ok = self.sibling(world=w, overlap=False).fits()
            if ok:
                needs["world_size"] = w
                options.append((w / self.world - 1, f"world size >= {w} (from {self.world})"))
                break
        act = self.profile.activation_bytes
        if act > 0:
            lo, hi = 0.0, 1.0
            if self._fits_with_activation(0):
                for _ in range(20):
                    mid = (lo + hi) / 2
                    if self._fits_with_activation(int(act * mid)):
                        lo = mid
                    else:
                        hi = mid
                needs["activation_fraction"] = lo
                tok = self.profile.tokens
                txt = f"activations <= {fmt_bytes(int(act * lo))} (now {fmt_bytes(act)}): a batch about {lo:.0%} of the current one"
                if tok:
                    txt += f" (~{max(1, int(tok * lo))} tokens per rank instead of {tok})"
                options.append((1 - lo, txt))
                if RECOMPUTE not in self.profile.step_kinds:
                    options.append((1 - lo + 0.01, "gradient checkpointing (--checkpointing), which cuts activations to about one layer's worth plus layer inputs"))
        options.sort()
        suggestions = [t for _, t in options]
        head = (budget_head(self.budgets, self.usable, unified_memory(self.hw), self.world)
                + f"; activations alone need {fmt_bytes(act)}")
        if suggestions:
            head += ". Smallest changes that would fit:\n  - " + "\n  - ".join(suggestions)
        else:
            head += ". No single change within reach fits; plan a smaller model or a larger cluster."
        return DoesNotFitError(head, suggestions, needs)

    def _min_needed(self, budgets_of: Callable[[int], tuple[int, int, int]], start: int) -> Optional[int]:
        """Smallest value ``v`` (bytes, to 0.4%) for which ``budgets_of(v)`` fits; None if even INF fails."""
        if not self.fits(budgets_of(INF)):
            return None
        lo, hi = 0, max(1, start)
        while not self.fits(budgets_of(hi)):
            lo, hi = hi, hi * 2
            if hi >= INF:
                hi = INF
                break
        while hi - lo > max(1, hi // 256):
            mid = (lo + hi) // 2
            if self.fits(budgets_of(mid)):
                hi = mid
            else:
                lo = mid
        return hi

    def _fits_with_activation(self, act: int) -> bool:
        """Whether a plan fits were the activations ``act`` bytes (the caller's profile is left as it is)."""
        return self.fits(profile=dataclasses.replace(self.profile, activation_bytes=act))


# ---------------------------------------------------------------------------------------------
# results


def _summary(ev: Evaluation) -> str:
    c = Counter(p.code for p in ev.placements)
    return " ".join(f"{k}x{v}" for k, v in sorted(c.items()))


def to_search_result(profile: StepProfile, world: int, ev: Evaluation, layout: Layout, info: dict,
                     grad_dtype: str = "float32", fused_step: bool = False,
                     frozen_format: Optional[str] = None,
                     formats: Optional[tuple[str, str]] = None) -> SearchResult:
    shapes = dict(profile.params)
    chunks = []
    for names, cap, pl in zip(layout.chunks, layout.capacities, ev.placements):
        chunks.append(ChunkPlan(tuple(names), tuple(shapes[n] for n in names), cap, profile.dtype, pl.sharding,
                                pl.shard, pl.optim))
    fshapes = dict(profile.frozen_shapes)
    frozen = tuple(ChunkPlan(tuple(names), tuple(fshapes[n] for n in names), layout.frozen_chunk_size, profile.dtype,
                             True, ev.frozen_placement,
                             # nothing lives there; a disk shard's chunk plan names disk for both
                             Placement.DISK if ev.frozen_placement is Placement.DISK else Placement.DEVICE)
                   for names in layout.frozen)
    in_frozen = {n for c in frozen for n in c.params}
    traced = profile.info.get("source", "").startswith("tracer")
    pred = Prediction(
        peak_device_bytes=int(ev.device_bytes), peak_host_bytes=int(ev.host_bytes), peak_disk_bytes=int(ev.disk_bytes),
        step_time_s=float(ev.step_time), breakdown={k: float(v) for k, v in ev.breakdown.items()},
    )
    info = dict(info, cache_blocks_used=ev.blocks)
    # The runtime wants >= 1 block whenever a chunk is sharded, even at world size 1 where it keeps
    # device-placed chunks whole and never uses the block (the prediction counts 0 then).
    blocks = max(ev.blocks, 1) if any(c.sharded for c in chunks) or frozen else ev.blocks
    return SearchResult(
        chunks=tuple(chunks), world_size=world, cache_blocks=blocks, prefetch_depth=ev.prefetch_depth,
        frozen_params=tuple(n for n in profile.frozen if n not in in_frozen), frozen_chunks=frozen, param_order=tuple(tuple(sorted(s)) for s in profile.steps) if traced else None,
        search="optimal", prediction=pred, info=info, grad_dtype=grad_dtype, fused_step=fused_step,
        frozen_format=frozen_format if frozen else None,
        master_format=None if formats is None else formats[0], moments_format=None if formats is None else formats[1],
    )


def search_profile(
    profile: StepProfile,
    world: Union[int, MeshLayout],
    *,
    hardware: Union[HardwareProfile, str, os.PathLike, None] = None,
    device_memory: Optional[int] = None,
    host_memory: Optional[int] = None,
    disk: Optional[int] = None,
    optimizer_type: str = "Adam",
    overlap: bool = False,
    policy: Optional[MemoryPolicy] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    verbose: bool = False,
    console=None,
    grad_dtype: Optional[torch.dtype] = None,
    fused_step: Optional[bool] = None,
    ranks_per_node: Optional[int] = None,
    hardware_choice: Optional[str] = None,
    process_bytes: int = 0,
    body_sharding: str = "mixed",
    heap_slack_bytes: int = 0,
    frozen: Optional[str] = None,
    master: str = "fp32",
    moments: str = "fp32",
    allow_lossy_state: bool = False,
) -> SearchResult:
    """The search proper, on a ready :class:`StepProfile` (``optimal_search`` traces, then calls this).

    Budgets are bytes per rank; ``None`` takes the hardware profile's device memory and its host
    memory shared by the ranks of one node; ``disk`` None or 0 forbids disk offload. On a CPU-only
    profile the device is the host: ``host_memory`` then budgets device and host bytes together
    (one pool per node, shared by its ranks), and ``device_memory`` (default: that same share)
    only caps the device part. ``ranks_per_node`` (default: the profile's for this world size)
    says how many ranks share one node's host memory. ``hardware_choice`` says, for the report, why
    ``hardware`` was the profile used.

    ``grad_dtype`` and ``fused_step`` fix the plan's shard-gradient dtype and fused
    backward-and-step; ``None`` lets the search choose: fp32 gradients and a separate step, unless
    memory binds (no plan fits, or the best one offloads optimizer state or shards), in which case
    it also scores gradients in the compute dtype (bf16/fp16) with the fused step (not for fp16,
    whose loss scaling needs every gradient first) and keeps the faster plan that fits. A plan
    with ``fused_step`` assumes no ``max_norm`` clipping: pass ``fused_step=False`` if you clip.

    ``process_bytes``: host bytes the training process holds outside elixir and the model (counted
    in the host prediction and against the host budget). ``heap_slack_bytes``: the part of it that
    is the activations' heap slack of a step under :func:`elixir.device.keep_host_memory`, which a
    plan with disk chunks (run under :func:`elixir.device.return_host_memory`) does not hold.

    ``body_sharding``: ``"mixed"`` (default) lets each body chunk be sharded (ZeRO-3) or ZeRO-1/2;
    ``"sharded"`` or ``"zero"`` keep them all one way (to compare a mixed plan with the pure ones
    on the same budget).

    ``frozen``: the frozen chunks' format (``MixedPrecisionPolicy.frozen``: ``"nf4"``, ``"int8"``;
    None: the compute dtype), priced at its bytes (:func:`~elixir.plan.state_format.frozen_shard_bytes`)
    and dequantised into an rCache block at each use; the plan records it.

    ``master``, ``moments``: the optimizer state's formats (``MixedPrecisionPolicy.master`` /
    ``.moments``: :mod:`elixir.plan.state_format`), each priced at its bytes per element on the
    device, the host and the disk (:func:`~elixir.plan.footprint.held_bytes`) and at its Adam
    kernel's measured rate (:meth:`~elixir.hardware.HardwareProfile.optimizer_time`); a plan
    searched with lossy formats records them. ``allow_lossy_state`` (the policy's field): when the
    plan in these formats does not fit, or fits only with optimizer state on disk, the search
    may turn to leaner formats (:func:`~elixir.plan.state_format.leaner_formats`: int8 moments,
    then a bf16-sr master too) and keeps the least lossy one that fits without disk, else the
    fastest that fits; the plan records the formats (also when it kept these) and
    ``info["state_formats"]`` says why. One format for the whole model: the runtime applies a
    plan's formats to every chunk. Without it the search never changes the formats.
    """
    t0 = time.perf_counter()
    mesh = MeshLayout.of(world)
    mesh.require_data_parallel("The search", "Plan the dp_shard axis alone: optimal_search(model, dp_shard_size, ...)")
    world = mesh.dp_shard
    policy = policy or MemoryPolicy()
    hw, hw_why, rpn, budgets = _resolve_hardware(world, hardware, hardware_choice, ranks_per_node, device_memory,
                                                 host_memory, disk)
    rd = None if reduce_dtype is None else dtype_name(reduce_dtype)
    g0 = "float32" if grad_dtype is None else dtype_name(grad_dtype)
    s = _Searcher(SearchRequest(profile, world, hw, budgets, optimizer_type, overlap, policy, rd, g0, bool(fused_step),
                                process_bytes, body_sharding, heap_slack_bytes, frozen, (master, moments)))
    s, found, why_formats = _search_formats(s, grad_dtype, fused_step, allow_lossy_state)
    best = found[0]
    layout = s.layout_of(best)
    runners = _runner_ups(found[1], 5)
    info = _search_info(s, found, layout, runners, t0, hw_why, rpn)
    recorded = s.request.formats if allow_lossy_state or is_lossy(*s.request.formats) else None
    if recorded is not None:  # a default search's plan stays as it was (no formats, no key)
        info["state_formats"] = {"master": recorded[0], "moments": recorded[1], "why": why_formats}
    result = to_search_result(profile, world, best, layout, info, grad_dtype=s.grad_dtype, fused_step=s.fused_step,
                              frozen_format=frozen, formats=recorded)
    if verbose:
        why = _explain(s, best)
        print_report(result, runners, console, why)
    return result


def _resolve_hardware(world: int, hardware: Union[HardwareProfile, str, os.PathLike, None],
                      hardware_choice: Optional[str], ranks_per_node: Optional[int], device_memory: Optional[int],
                      host_memory: Optional[int], disk: Optional[int]) -> tuple[HardwareProfile, str, int, Budgets]:
    """:func:`search_profile`'s hardware profile, why it is the one, the ranks per node and the
    budgets, its defaults filled in."""
    hw, hw_why = _chosen_profile(hardware, hardware_choice)
    rpn = ranks_per_node or hw.ranks_per_node(world)
    return hw, hw_why, rpn, budgets_for(hw, rpn, device_memory, host_memory, disk)

def _chosen_profile(hardware: Union[HardwareProfile, str, os.PathLike, None],
                    hardware_choice: Optional[str]) -> tuple[HardwareProfile, str]:
    """The hardware profile ``hardware`` names (a profile, a JSON path or a shipped profile's
    name; None: the default rule) and why it is the one."""
    if isinstance(hardware, (str, os.PathLike)):  # a JSON path or a shipped profile's name
        hardware_choice = hardware_choice or f"hardware={os.fspath(hardware)!r}"
        hardware = load_profile(hardware)
    return (hardware, hardware_choice or "given") if hardware is not None else choose_default_profile()


def _search_leanest(s: _Searcher, grad_dtype: Optional[torch.dtype],
                    fused_step: Optional[bool]) -> tuple[_Searcher, tuple[Evaluation, list[Evaluation], int]]:
    """Run ``s``; where memory binds and :func:`search_profile` may choose the gradient dtype or
    the fused step, also the leanest configuration, and keep the faster plan. The searcher that
    found it and its result; DoesNotFitError (the leanest configuration's) if neither fits."""
    profile, g0 = s.profile, s.grad_dtype
    found, error = None, None
    try:
        found = s.run(diagnose=False)  # the suggestions are worked out once, for the searcher that refuses
    except DoesNotFitError:
        pass
    lean_grad = profile.dtype if grad_dtype is None and profile.dtype in ("bfloat16", "float16") else g0
    lean_fused = profile.dtype != "float16" if fused_step is None else fused_step
    # Memory binds when the budgets ruled out any candidate: the plan found may then shard or
    # offload what a larger budget would not, and the leaner configuration may be faster. (Only
    # offloading placements in the plan found used to count: a budget that made the search shard
    # chunks it would have replicated, all still on the device, never tried the fused step, and
    # the mixed search came out slower than the pure ZeRO-1/2 one on the same budget, which did.)
    binds = found is None or s.rejected > 0 or any(p not in (DD, RD) and not (p.zero and p.optim is Placement.DEVICE)
                                                   for p in found[0].placements)
    if binds and (lean_grad, lean_fused) != (g0, bool(fused_step)):
        lean = s.sibling(grad_dtype=lean_grad, fused_step=lean_fused)
        try:
            other = lean.run()
        except DoesNotFitError as e:  # the leanest configuration's suggestions are the useful ones
            other, error = None, e
        if other is not None and (found is None or other[0].step_time < found[0].step_time):
            s, found = lean, other
    if found is None:
        raise error or s.no_fit_error()
    return s, found


def _state_on_disk(ev: Evaluation) -> bool:
    """Whether a plan keeps any chunk's optimizer state on disk."""
    return any(p.optim is Placement.DISK for p in ev.placements)


def _search_formats(s: _Searcher, grad_dtype: Optional[torch.dtype], fused_step: Optional[bool],
                    allow_lossy: bool) -> tuple[_Searcher, tuple[Evaluation, list[Evaluation], int], str]:
    """:func:`_search_leanest` in the request's state formats; with ``allow_lossy``, where their
    plan does not fit or keeps optimizer state on disk, also in each of
    :func:`~elixir.plan.state_format.leaner_formats`: the first (least lossy) whose plan keeps no
    state on disk wins, else the fastest plan found. The searcher, its result and why those formats."""
    asked = s.request.formats
    label = "/".join(asked)
    # only Adam's state has the formats (another optimizer's plan keeps its own, as asked)
    ladder = leaner_formats(*asked) if s.request.optimizer_type.lower() in LOSSY_OPTIMIZERS else []
    try:
        s0, f0 = _search_leanest(s, grad_dtype, fused_step)
    except DoesNotFitError as e:
        if not allow_lossy or not ladder:
            raise
        tried, error, short = [], e, "does not fit"
    else:
        if not allow_lossy or not _state_on_disk(f0[0]):
            return s0, f0, f"as asked ({label})" + ("" if not allow_lossy else ": fits without optimizer state on disk")
        tried, error, short = [(s0, f0)], None, "keeps optimizer state on disk"
    for fmt in ladder:
        try:
            sx, fx = _search_leanest(s.sibling(formats=fmt), grad_dtype, fused_step)
        except DoesNotFitError as e:
            error = e
            continue
        if not _state_on_disk(fx[0]):
            return sx, fx, f"allow_lossy_state: {label} {short}; {'/'.join(fmt)} fits without optimizer state on disk"
        tried.append((sx, fx))
    if not tried:
        raise error
    sb, fb = min(tried, key=lambda t: t[1][0].step_time)
    return sb, fb, (f"allow_lossy_state: every format tried keeps optimizer state on disk; "
                    f"{'/'.join(sb.request.formats)} is the fastest")


def _search_info(s: _Searcher, found: tuple[Evaluation, list[Evaluation], int], layout: Layout,
                 runners: list[Evaluation], t0: float, hw_why: str, rpn: int) -> dict:
    """The plan's ``info``: how the search went, on what, and its runner-ups."""
    best, results, scored = found
    hw, budgets, policy, profile = s.hw, s.budgets, s.policy, s.profile
    return {
        "search_time_s": time.perf_counter() - t0,
        "candidates_scored": scored,
        "hardware": hw.name,
        "hardware_choice": hw_why,
        "hardware_source": hw.host if hw.measured else "reference figures, not measured",
        "memory_pool": "unified (device = host RAM)" if unified_memory(hw) else "separate",
        "ranks_per_node": rpn,
        "node_memory": hw.host_memory_bytes,
        "budgets": {"device": budgets.device, "host": budgets.host, "disk": budgets.disk},
        "usable_after_margins": dict(zip(("device", "host", "disk"), s.usable)),
        "margins": {"device": policy.device_margin, "host": policy.host_margin, "disk": policy.disk_margin},
        "predicted_memory": {k: int(v) for k, v in best.memory.items()},
        "process_bytes": int(s.setting.process_bytes),
        "gathers_per_step": best.gathers,
        "waste": (1 - layout.used / (layout.chunk_size * (layout.n_sharded - layout.own + layout.zero))
                  if layout.n_sharded - layout.own + layout.zero else 0.0),
        "chunk_shardings": dict(Counter(p.sharding.value for p in best.placements)),
        "chunk_size": layout.chunk_size,
        "tied": None if not profile.shared else ("sharded" if best.shard_shared else "replicated"),
        "tied_alternative": _tied_alternative(s, best, results),
        "profile": {k: v for k, v in profile.info.items() if isinstance(v, (str, int, float, list, tuple, dict))},
        "activation_bytes": profile.activation_bytes,
        "runner_ups": [
            {"chunk_size": e.chunk_size, "blocks": e.blocks, "prefetch_depth": e.prefetch_depth,
             "placements": _summary(e), "step_time_s": e.step_time, "device_bytes": e.device_bytes,
             "host_bytes": e.host_bytes, "tied_sharded": e.shard_shared}
            for e in runners
        ],
    }


def _explain(s: _Searcher, best: Evaluation) -> str:
    """Why this plan: is memory binding, and what would the fastest unconstrained plan need?"""
    free = s.sibling(budgets=Budgets(INF, INF, INF if s.budgets.disk else 0), policy=MemoryPolicy(0.0, 0.0, 0.0))
    try:  # only a faster plan matters: the chosen one's time prunes the scan
        fbest, _, _ = free.run(fastest_below=best.step_time)
    except DoesNotFitError:
        fbest = best
    if fbest.step_time >= best.step_time * (1 - 1e-9):
        return "memory does not bind: this is the fastest configuration considered."
    return (
        f"memory binds: the fastest configuration considered (chunk {fbest.chunk_size:,}, {fbest.blocks} blocks, "
        f"{_summary(fbest)}) would take {fbest.step_time:.4f} s but needs {fmt_bytes(fbest.device_bytes)} device and "
        f"{fmt_bytes(fbest.host_bytes)} host per rank; this plan is {best.step_time / fbest.step_time:.2f}x its time."
    )


def _tied_alternative(s: _Searcher, best: Evaluation, results: list[Evaluation]) -> Optional[dict]:
    """The best plan that chunks the tied parameters the other way (replicated vs sharded), or
    why there is none: the reason for the choice."""
    if len(s.tied_modes) < 2:
        return None
    other = not best.shard_shared
    alt = next((e for e in results if e.shard_shared == other and not all(p.replicated for p in e.placements)), None)
    mode = "sharded" if other else "replicated"
    if alt is None:
        return {"tied": mode, "fits": False}
    return {"tied": mode, "fits": True, "step_time_s": alt.step_time, "device_bytes": alt.device_bytes,
            "host_bytes": alt.host_bytes, "chunk_size": alt.chunk_size}


def tied_reason(info: dict) -> str:
    """One line: how the plan chunks the tied parameters, and why (from ``info['tied_alternative']``)."""
    tied, alt = info.get("tied"), info.get("tied_alternative")
    if tied is None:
        return "no tied parameters"
    if alt is None:
        return f"{tied} (one rank: nothing to shard)"
    if not alt["fits"]:
        return f"{tied}: no plan with them {alt['tied']} fits the budgets"
    return (f"{tied}: with them {alt['tied']} the best plan would take {alt['step_time_s']:.4f} s and "
            f"{fmt_bytes(alt['device_bytes'])} device per rank")


def _runner_ups(results: list[Evaluation], k: int) -> list[Evaluation]:
    """The best evaluation per chunk size and way of chunking tied parameters, best first (the
    first is the winner)."""
    seen, out = set(), []
    for e in results:
        if (e.chunk_size, e.shard_shared) in seen:
            continue
        seen.add((e.chunk_size, e.shard_shared))
        out.append(e)
        if len(out) == k:
            break
    return out


def print_report(result: SearchResult, runners: list[Evaluation], console=None, why: str = "") -> None:
    """Rich report: the chosen plan, its predicted memory and time, and the runner-ups."""
    console = console or Console()
    p = result.prediction
    info = result.info
    sharded = [c for c in result.chunks if c.state_sharded]
    t = Table(title=f"elixir optimal plan: world {result.world_size}, hardware {info.get('hardware')}")
    t.add_column("what")
    t.add_column("value")  # left-aligned: long values wrap into a readable paragraph at 80 columns
    t.add_row("hardware profile", f"{info.get('hardware')} ({info.get('hardware_choice', 'given')}; "
                                  f"{info.get('hardware_source', '')})")
    if sharded:
        kinds = ", ".join(f"{v} {k}" for k, v in result.sharding_counts.items())
        t.add_row("chunk size", f"{info.get('chunk_size', result.chunk_size):,} elements ({kinds})")
        t.add_row("padding waste", f"{100 * info.get('waste', 0):.2f}% of the sharded chunks")
    else:
        t.add_row("chunks", f"all {len(result.chunks)} replicated (data parallel: nothing sharded, nothing gathered)")
        t.add_row("padding waste", f"{100 * result.waste():.2f}%")
    t.add_row("tied parameters", tied_reason(info))
    t.add_row("rCache blocks / prefetch depth", f"{result.cache_blocks} / {result.prefetch_depth}")
    t.add_row("gathers per step", str(info.get("gathers_per_step")))
    t.add_row("placements (shard, optimizer)", runners[0] and _summary(runners[0]) if runners else "")
    t.add_row("trainable chunks: optimizer state", _formats_row(result))
    if result.frozen_chunks:
        fc = result.frozen_chunks
        t.add_row("frozen chunks (weights only)", f"{len(fc)} x {fc[0].chunk_size:,} elements, shards on "
                                                  f"{fc[0].shard_placement.value}, stored {result.frozen_format or fc[0].dtype}")
    t.add_row("shard gradients / fused backward-and-step", f"{result.grad_dtype} / {'yes' if result.fused_step else 'no'}")
    b = info["budgets"]
    u = info["usable_after_margins"]
    t.add_row("peak device / usable / budget", f"{fmt_bytes(p.peak_device_bytes)} / {fmt_bytes(u['device'])} / {fmt_bytes(b['device'])}")
    t.add_row("peak host / usable / budget", f"{fmt_bytes(p.peak_host_bytes)} / {fmt_bytes(u['host'])} / {fmt_bytes(b['host'])}")
    if str(info.get("memory_pool", "")).startswith("unified"):
        k = int(info.get("ranks_per_node", 1))
        t.add_row(f"peak node RAM (device + host, {k} rank{'s' if k > 1 else ''}) / node",
                  f"{fmt_bytes(k * (p.peak_device_bytes + p.peak_host_bytes))} / {fmt_bytes(int(info.get('node_memory', 0)))}")
    if p.peak_disk_bytes:
        t.add_row("disk", fmt_bytes(p.peak_disk_bytes))
    for k, v in info.get("predicted_memory", {}).items():
        t.add_row(f"  {'host' if k in HOST_TERMS else 'device'}: {k}", fmt_bytes(v))
    t.add_row("predicted step time", f"{p.step_time_s:.4f} s")
    for k, v in p.breakdown.items():
        t.add_row(f"  {k}", f"{v:.4f} s")
    t.add_row("search time", f"{info.get('search_time_s', 0):.2f} s ({info.get('candidates_scored')} candidates)")
    console.print(t)
    _print_runner_ups(console, runners, bool(info.get("tied")))
    console.print("placements: DD shard+optimizer on device, DH shard on device / optimizer on host, HH both on host, "
                  "DK/HK optimizer on disk, R* replicated chunk (optimizer on D/H), 1*/2* ZeRO-1/2 chunk: parameters "
                  "whole, optimizer state split (on D/H/K)")
    if why:
        console.print(f"why: {why}")


def _formats_row(result: SearchResult) -> str:
    """The report's words for the trainable chunks' state formats: master / moments, their bytes
    per parameter in memory and on disk, and why the search kept them (``info["state_formats"]``)."""
    fmt = (result.master_format or "fp32", result.moments_format or "fp32")
    n = QUANT_BLOCK  # whole int8 blocks: the per-element rate exactly
    per = (master_bytes(fmt[0]) * n + optimizer_state_nbytes(n, 8, fmt)) / n
    on_disk = sum(c.optim_placement is Placement.DISK for c in result.chunks)
    text = (f"master {fmt[0]}, moments {fmt[1]} ({per:.2f} B/param"
            + (f"; {disk_bytes_per_element(formats=fmt)} B/param on disk for {on_disk} chunk(s)" if on_disk else "") + ")")
    why = result.info.get("state_formats", {}).get("why")
    return text + (f": {why}" if why else "" if result.master_format else ", the policy's (the plan records none)")


def _print_runner_ups(console, runners: list[Evaluation], tied: bool) -> None:
    """The runner-ups, in columns that fit 80: the tied column only when the model ties weights,
    the cache as ``blocks/depth``, the step time relative to the best (whose own is in the report
    above), and the placements column wrapping at spaces."""
    r = Table(title="runner-ups (best per chunk size and tied chunking)", expand=False,
              caption="cache: rCache blocks / prefetch depth", caption_justify="left")
    cols = ["chunk", *(["tied"] if tied else []), "cache", "placements", "device", "host", "step vs best"]
    placements = [_summary(e) for e in runners]
    for col in cols:
        if col == "placements":
            r.add_column(col, overflow="fold", min_width=longest_word([col, *placements]))
        elif col == "step vs best":
            r.add_column("step\nvs best", justify="right", no_wrap=True)
        else:
            r.add_column(col, justify="right", no_wrap=True)
    best = runners[0].step_time if runners else 0
    for e, placed in zip(runners, placements):
        row = [human_count(e.chunk_size), *(["sharded" if e.shard_shared else "repl."] if tied else []),
               f"{e.blocks}/{e.prefetch_depth}", placed, human_bytes(e.device_bytes), human_bytes(e.host_bytes),
               f"{e.step_time / best:.3f}x" if best else ""]
        r.add_row(*row)
    console.print(r)


def optimal_search(
    model: nn.Module,
    group_size: Union[int, MeshLayout],
    unified_dtype: torch.dtype = torch.float,
    optimizer_type: str = "Adam",
    overlap: bool = False,
    verbose: bool = False,
    inp: Optional[dict] = None,
    step_fn: Optional[Callable] = None,
    *,
    device_memory: Optional[int] = None,
    host_memory: Optional[int] = None,
    disk: Optional[int] = None,
    hardware: Union[HardwareProfile, str, os.PathLike, None] = None,
    policy: Optional[MemoryPolicy] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    grad_dtype: Optional[torch.dtype] = None,
    fused_step: Optional[bool] = None,
    process_bytes: Optional[int] = None,
    body_sharding: str = "mixed",
    frozen: Optional[str] = None,
    master: str = "fp32",
    moments: str = "fp32",
    allow_lossy_state: bool = False,
    mp_policy: Optional[Any] = None,
) -> SearchResult:
    """Plan ``model`` for ``group_size`` ranks: the lowest predicted step time that fits.

    Args:
        model: the model (any device; meta included: nothing is allocated).
        group_size: data-parallel world size (the ranks chunks shard over), or the
            :class:`~elixir.plan.mesh.MeshLayout` of the run (one ``dp_shard`` axis for now).
        unified_dtype: compute dtype of the chunks.
        optimizer_type: ``"Adam"``/``"AdamW"`` (8 B/element of state) or ``"SGD"`` (4).
        overlap: allow prefetching (depth 1-2) so gathers overlap compute where the hardware can.
        verbose: print a rich report with the runner-ups.
        inp, step_fn: one training step ``step_fn(model, inp)`` to trace (activations, buffers and
            parameter order); without them, definition order and zero activation bytes are used.
        device_memory, host_memory, disk: per-rank budgets in bytes (see :func:`search_profile`).
        hardware: the hardware profile. Default, one rule (``elixir.hardware.DEFAULT_RULE``): the local
            measured profile (``$ELIXIR_HARDWARE``, else ``~/.cache/elixir/hardware.json``, written by
            ``elixir hwprofile``) if there is one, else the shipped reference ``cpu-box`` (``8xA100-40GB``
            where CUDA is available). ``result.info['hardware_choice']`` and the verbose report say which.
        policy: the safety margins.
        reduce_dtype: gradient reduction dtype (default: the compute dtype).
        grad_dtype, fused_step: the plan's shard-gradient dtype and fused backward-and-step; None
            lets the search choose them when memory binds (see :func:`search_profile`). Pass
            ``fused_step=False`` when training clips gradients (``max_norm``).
        process_bytes: host bytes the training process holds besides elixir's tensors and the
            model (interpreter, torch, libraries); counted in the host prediction and budget.
            Default: this process's RSS now, less the bytes of ``model``'s materialised parameters
            and buffers (they move into chunks, or are counted as buffers) — right when planning
            in the process that will train, after its imports. With a process group initialised,
            the most over its ranks (one collective: call ``optimal_search`` on every rank), so
            every rank plans on the same figure. Pass 0 to plan for another machine.
        body_sharding: ``"mixed"`` (default): each body chunk may be sharded (ZeRO-3) or
            ZeRO-1/2 (parameters whole, optimizer state split), chunk by chunk; ``"sharded"`` /
            ``"zero"``: all of them one way (the pure plans, to compare on the same budget).
        frozen: the format the frozen chunks will be stored in (``MixedPrecisionPolicy.frozen``:
            ``"nf4"``, ``"int8"``, None); priced at its bytes and recorded in the plan.
        master, moments, allow_lossy_state: the optimizer state's formats and whether the search
            may choose leaner ones (``MixedPrecisionPolicy``'s fields; see :func:`search_profile`).
        mp_policy: the ``MixedPrecisionPolicy`` the run will use, instead of ``frozen``, ``master``,
            ``moments`` and ``allow_lossy_state``: its fields of those names are taken (its
            ``param_dtype`` must be ``unified_dtype``).

    Raises:
        DoesNotFitError: nothing fits; the message names the smallest changes that would.
    """
    if (inp is None) != (step_fn is None):
        raise ValueError("give both inp and step_fn (to trace the step), or neither")
    if mp_policy is not None:
        frozen, master, moments, allow_lossy_state = _policy_formats(mp_policy, unified_dtype, frozen, master, moments,
                                                                     allow_lossy_state)
    if inp is not None:
        profile = profile_step(model, inp, step_fn, unified_dtype)
    else:
        profile = profile_from_module(model, dtype=unified_dtype)
    hw, why = _chosen_profile(hardware, None)  # its step figures price this process's growth
    return search_profile(
        profile, group_size, hardware=hw, hardware_choice=why, device_memory=device_memory, host_memory=host_memory,
        disk=disk, optimizer_type=optimizer_type, overlap=overlap, policy=policy, reduce_dtype=reduce_dtype,
        verbose=verbose, grad_dtype=grad_dtype, fused_step=fused_step,
        process_bytes=_process_bytes(model, hw, profile.activation_bytes) if process_bytes is None else int(process_bytes),
        body_sharding=body_sharding, frozen=frozen, master=master, moments=moments, allow_lossy_state=allow_lossy_state,
        heap_slack_bytes=activation_heap_slack(hw, profile.activation_bytes) if process_bytes is None else 0,
    )


def _policy_formats(mp_policy: Any, dtype: torch.dtype, *loose: Any) -> tuple[Optional[str], str, str, bool]:
    """(frozen, master, moments, allow_lossy_state) of ``mp_policy``; ``loose`` (those arguments
    as given to :func:`optimal_search`) must be at their defaults, and the policy's compute dtype
    the search's."""
    if tuple(loose) != (None, "fp32", "fp32", False):
        raise ValueError("pass mp_policy or frozen/master/moments/allow_lossy_state, not both: put them in "
                         "MixedPrecisionPolicy(...)")
    pdt = getattr(mp_policy, "param_dtype", dtype)
    if pdt != dtype:
        raise ValueError(f"mp_policy.param_dtype is {pdt} but unified_dtype is {dtype}: pass unified_dtype={pdt}")
    return (mp_policy.frozen, mp_policy.master, mp_policy.moments, bool(getattr(mp_policy, "allow_lossy_state", False)))


def activation_heap_slack(hw: HardwareProfile, activation_bytes: int) -> int:
    """The part of :func:`_process_bytes`'s step term that is the activations' heap slack under
    :func:`elixir.device.keep_host_memory` (where activations are in host RAM), beyond ``hw``'s
    :attr:`~elixir.hardware.HardwareProfile.step_untracked_bytes`: a plan that streams from disk
    runs under :func:`elixir.device.return_host_memory` instead and the cost model counts its own
    (:meth:`~elixir.hardware.HardwareProfile.step_extra_bytes` with ``streams_from_disk``)."""
    on_host = not dev.is_accelerator(dev.default_device())
    return hw.step_extra_bytes(activation_bytes, on_host) - hw.step_untracked_bytes


def _process_bytes(model: nn.Module, hw: HardwareProfile, activation_bytes: int = 0) -> int:
    """This process's RSS less the bytes of ``model``'s materialised tensors (see optimal_search),
    plus ``hw``'s :meth:`~elixir.hardware.HardwareProfile.step_extra_bytes` (what the process adds
    once it trains, which no other term sees: on a machine without an accelerator it grows with the
    traced ``activation_bytes``, whose heap slack is host RAM), the most over the ranks when a process group is
    initialised: each rank measures its own RSS, which differs by tens of MiB, and ranks that
    searched on different figures could pick different plans (and then hang in each other's
    collectives)."""
    seen, own = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):  # host tensors only: RSS holds nothing else
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            own += t.untyped_storage().nbytes()
    on_host = not dev.is_accelerator(dev.default_device())
    mine = max(0, dev.rss_bytes() - own) + hw.step_extra_bytes(activation_bytes, on_host)
    if edist.is_initialized() and edist.get_world_size() > 1:
        return max(int(b) for b in edist.all_gather_object(mine))
    return mine


__all__ = ["Budgets", "SearchRequest", "DoesNotFitError", "optimal_search", "search_profile", "chunk_size_candidates", "zero_candidates"]
