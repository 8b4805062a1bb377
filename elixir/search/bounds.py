"""Lower bounds on a candidate's step time and memory, so the search skips what cannot win.

:func:`~elixir.search.cost_model.price` is the one pricing rule; everything here is a floor
under it, computed from the parts of the price that do not depend on the placement the search
would choose (:func:`~elixir.search.cost_model.place`):

- :func:`step_time_floor`: for a layout, a block count and a prefetch depth, at most the
  step time of *any* placement of its chunks. The search skips a candidate whose floor is above
  the best time already found for its chunk size (so each chunk size's best, the runner-ups and
  the winner are exactly those of the full scan).
- :func:`memory_floor`: bytes every candidate of a profile needs on the device and on the host
  (the one pool of a CPU box), whatever its chunks: the search refuses at once when they exceed
  the budgets (issue 35: an impossible budget was refused after 95 s of pricing).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from elixir.plan import Placement
from elixir.plan.footprint import state_floor_bytes
from elixir.plan.placement import SHARDED_PLACEMENTS
from elixir.search.cost_model import (
    Layout,
    Setting,
    _context,
    _memo,
    comm_times,
    per_chunk_fixed_time,
    per_hardware,
    replicated_optimizer_time,
    unified_memory,
    zero_chunk_optimizer_time,
    zero_placements,
)
from elixir.search.step_profile import StepProfile

# a floor within this fraction of the best time is never used to skip (float rounding: the floor
# adds the same terms as the price in another order)
SLACK = 1e-9


class StepFloor:
    """At most the step time :func:`~elixir.search.cost_model.price` gives ``layout`` with
    ``gathers`` (:func:`~elixir.search.cost_model.simulate_layout`), for any placement of its
    sharded chunks, replicated chunks' optimizer state and frozen shards; :meth:`at` a prefetch
    depth. Built once per (layout, blocks): the collectives do not depend on the depth.

    What every placement pays: the compute, the collectives (their count is fixed by the layout
    and the gathers), the ZeRO chunks' publish, and the optimizer phase with every sharded chunk at
    its cheapest placement and the replicated state at its cheaper place; host-to-device copies,
    disk reads and the synchronous gathers of disk shards are at least 0. Hidden time is at most
    what the price can hide: under ``hw.overlap`` the step is at least the larger of compute and
    communication plus the first gather; with a measured ``overlap_fraction`` at most that
    fraction of the smaller of compute and the all-gathers; with the fused step, at most each disk
    chunk's own disk transfers. At world size 1 the price drops device shards' gathers and
    reductions altogether, so the floor is 0 there (nothing skipped)."""

    def __init__(self, profile: StepProfile, layout: Layout, st: Setting, gathers: np.ndarray) -> None:
        self.solo = st.world == 1
        if self.solo:
            return
        hw = st.hardware
        n_sh = layout.n_sharded
        n = n_sh - layout.own
        # the same for every configuration on this machine: remembered on the layout per gathers
        (self.compute, self.comm, self.all_gather, self.publish,
         self.first_gather) = per_hardware(st, layout, "floor", lambda: _comm_floor(profile, layout, st, gathers),
                                           gathers, profile)
        self.gathered = bool(n_sh or layout.n_frozen)
        self.overlap, self.fraction = hw.overlap, hw.overlap_fraction
        self.optimizer = _layout_optimizer_floor(st, layout, n)

    def at(self, depth: int) -> float:
        """The floor with prefetch ``depth``."""
        if self.solo:
            return 0.0
        compute, c, of = self.compute, self.comm, self.fraction
        if self.overlap and depth >= 1 and self.gathered:
            fb = max(compute, c) + self.first_gather
        elif of > 0 and depth >= 1 and self.gathered:
            # hidden <= of * min(compute, all-gathers + host copies); each second of host copies
            # adds at least 1 - of (>= 0) to the step, so none is the floor
            fb = compute + c - of * min(compute, self.all_gather) if of <= 1 else compute * (1 - of) + c
        else:
            fb = compute + c
        return fb + self.publish + self.optimizer


def _comm_floor(profile: StepProfile, layout: Layout, st: Setting,
                gathers: np.ndarray) -> tuple[float, float, float, float, float]:
    """:class:`StepFloor`'s compute, collectives, all-gathers, publish and first gather."""
    n_sh = layout.n_sharded
    n = n_sh - layout.own
    g = np.asarray(gathers, dtype=np.int64)
    comm = comm_times(profile, layout, st, int(g.sum()), g[n:n_sh], int(g[n_sh:].sum()), zero_placements(st, layout))
    return (comm["compute"], comm["all_gather"] + comm["reduce_scatter"] + comm["all_reduce"], comm["all_gather"],
            comm.get("publish", 0.0), st.hardware.all_gather_time(layout.chunk_size * st.elem, st.world))


def step_time_floor(profile: StepProfile, layout: Layout, st: Setting, depth: int, gathers: np.ndarray) -> float:
    """:class:`StepFloor` of ``layout`` with ``gathers`` at prefetch ``depth``."""
    return StepFloor(profile, layout, st, gathers).at(depth)


def optimizer_floor(st: Setting, layout: Layout, n: int) -> float:
    """The least optimizer-phase seconds of ``layout``'s chunks (``n`` sharded body chunks),
    whatever their placement. The fused step hides at most each disk chunk's own disk transfers
    (``price``'s ``fused_step_hidden``), so a disk placement counts without them."""
    shard = layout.chunk_size // st.world if n else 0
    repl = sum(layout.replicated_capacities)
    t = min(replicated_optimizer_time(st, repl, w) for w in (Placement.DEVICE, Placement.HOST)) if repl else 0.0
    t += sum(st.optimizer_time(c // st.world, "device") for c in layout.own_capacities)
    zt: dict[int, float] = {}  # by capacity: the ZeRO chunks of a layout share one
    t += sum(zt[c] if c in zt else zt.setdefault(c, zero_chunk_optimizer_time(st, c, Placement.DEVICE))
             for c in layout.zero_capacities)
    if n:
        ct = per_chunk_fixed_time(st, shard)
        nbytes = shard * st.disk_elem
        credit = st.hardware.disk_time(nbytes, nbytes) if st.fused_step else 0.0
        t += n * min(ct[k] - (credit if k.on_disk else 0.0) for k in SHARDED_PLACEMENTS)
    return t


def _layout_optimizer_floor(st: Setting, layout: Layout, n: int) -> float:
    """:func:`optimizer_floor`, remembered per Setting and layout (it does not depend on the
    blocks or the depth the search tries it with)."""
    memo = _memo(st)
    key = ("optimizer_floor", id(layout))
    hit = memo.get(key)
    if hit is None or hit[0] is not layout:
        hit = memo[key] = (layout, optimizer_floor(st, layout, n))
    return hit[1]


def memory_floor(profile: StepProfile, st: Setting, disk: int = 0) -> tuple[int, int]:
    """Bytes any plan for ``profile`` needs: (on the device, on the host; in one pool of device
    and host on a CPU box, the second is the pool's), with ``disk`` bytes of disk to offload to.

    Every candidate's device bytes hold the traced activation peak and the buffers
    (:func:`~elixir.search.cost_model.fixed_device_bytes`), and :func:`~elixir.search.cost_model.place`
    keeps no candidate whose host bytes (the pool's: the device bytes too) leave no room for
    ``process_bytes`` beside them, nor one whose chunks' state (summed over device and host,
    before the timeline's overlap is taken off) does not fit: at least
    :func:`~elixir.plan.footprint.state_floor_bytes` of the parameters. Returned for separate memories: the device floor,
    and the host floor with the state counted where it can least be (the device budget is
    checked against it in :func:`fits_floor`)."""
    dev = int(profile.activation_bytes) + int(profile.buffer_bytes)
    ctx = _context(profile)  # the parameters the search packs into chunks
    numel = sum(ctx.sh_numel) + sum(k for _, k in ctx.shared)
    frozen = sum(k for _, k in ctx.frozen)
    state = state_floor_bytes(numel, frozen, st.dtype, st.world, st.kept_grad, st.opt_bytes, disk, st.frozen_elem,
                              st.formats)
    return dev, int(st.process_bytes) + dev + state


def fits_floor(profile: StepProfile, st: Setting, usable: Sequence[int]) -> bool:
    """Whether the budgets ``usable`` (device, host, disk, after margins) leave room for
    :func:`memory_floor`; False means no candidate can fit. On a CPU box (one pool) the host
    budget holds everything; with separate memories device and host together do."""
    dev, total = memory_floor(profile, st, usable[2])
    pool = usable[1] if unified_memory(st.hardware) else usable[0] + usable[1]
    return dev <= usable[0] and int(st.process_bytes) <= usable[1] and total <= pool


def layout_fits_floor(profile: StepProfile, st: Setting, usable: Sequence[int], chunk_size: int, zero: int,
                      n_body: int) -> bool:
    """:func:`fits_floor` for the layout of ``chunk_size`` with ``zero`` of its ``n_body`` body
    chunks ZeRO-1/2, before it is packed (world size > 1): each ZeRO chunk holds its whole
    compute-dtype payload on the device, ``(1 - 1 / world)`` of it beyond the per-element floor,
    and with any body chunk sharded the rCache holds at least one block of ``chunk_size``."""
    if st.world == 1:
        return fits_floor(profile, st, usable)
    extra = zero * chunk_size * st.elem * (st.world - 1) // st.world + (chunk_size * st.elem if zero < n_body else 0)
    dev, total = memory_floor(profile, st, usable[2])
    pool = usable[1] if unified_memory(st.hardware) else usable[0] + usable[1]
    return dev + extra <= usable[0] and int(st.process_bytes) <= usable[1] and total + extra <= pool


__all__ = ["StepFloor", "layout_fits_floor", "step_time_floor", "optimizer_floor", "memory_floor", "fits_floor", "SLACK"]
