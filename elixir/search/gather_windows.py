"""How much compute each prefetched all-gather can hide under.

A prefetched gather runs while the rank computes, but only from when it is issued to when its chunk
is used: the runtime's schedule (``elixir.chunk.schedule``: the traced steps' sharded chunk sets,
empty steps dropped and consecutive equal sets merged) issues a chunk's gather when the cursor
reaches the step ``depth`` steps before the chunk's use, or the first step for the uses less than
``depth`` steps after it (``wrapper/step_hooks.py``: prefetches are issued at each use, none
before the first). The compute between those two points is the gather's *window*; what the
gather can hide is at most its window. Pricing hidden time against the whole step's compute
instead credited a plan whose sharded chunks are used back to back, each holding one layer of a
communication-bound step (GPT-2 medium, batch 1, seq 8: a gather of 0.087 s against 0.011 s of one
layer's forward), with hiding 0.21 s that the measured step never hid.

Compute is spread over the traced steps by the parameter elements each touches (matmul FLOPs are
proportional to them), a backward step counting two passes and a forward or recompute step one, as
:meth:`~elixir.search.step_profile.StepProfile.backward_share` counts them. A chunk with ``g``
gathers in a step is gathered at its first ``g`` uses (each use being a run of consecutive
schedule steps that hold it): exact when it stays cached after one gather or is gathered at every
use, the earliest uses in between.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from elixir.search.step_profile import BACKWARD


def compute_before(profile: Any) -> np.ndarray:
    """``cum[t]``: the share of the step's compute in the traced steps before ``t`` (length
    ``len(profile.steps) + 1``, ``cum[-1] == 1``; all zeros for a step that touches no parameter)."""
    numel = dict(profile.numel)
    numel.update({n: int(np.prod(s)) for n, s in getattr(profile, "frozen_shapes", ())})
    w = np.asarray([sum(numel.get(n, 0) for n in names) * (2.0 if kind == BACKWARD else 1.0)
                    for names, kind in zip(profile.steps, profile.step_kinds)], dtype=np.float64)
    cum = np.zeros(len(w) + 1, dtype=np.float64)
    np.cumsum(w, out=cum[1:])
    return cum / cum[-1] if cum[-1] > 0 else cum


_CUM: dict[int, tuple[Any, np.ndarray]] = {}


def _compute_before(profile: Any) -> np.ndarray:
    """:func:`compute_before`, remembered per profile (every layout of a search shares one)."""
    hit = _CUM.get(id(profile))
    if hit is None or hit[0] is not profile:
        if len(_CUM) > 16:
            _CUM.clear()
        hit = _CUM[id(profile)] = (profile, compute_before(profile))
    return hit[1]


def chunk_uses(trace: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """The schedule of ``trace`` (an :class:`~elixir.search.simulator.AccessTrace`): the traced
    step each schedule step starts at, and per chunk the schedule steps at which a use of it starts."""
    starts: list[int] = []
    sets: list[frozenset] = []
    o, c = trace.offsets, trace.chunks
    for t in range(trace.n_steps):
        if o[t + 1] > o[t]:
            s = frozenset(c[o[t]:o[t + 1]].tolist())
            if not sets or sets[-1] != s:
                starts.append(t)
                sets.append(s)
    uses: list[list[int]] = [[] for _ in range(trace.n_chunks)]
    prev: frozenset = frozenset()
    for j, s in enumerate(sets):
        for k in s - prev:
            uses[k].append(j)
        prev = s
    return np.asarray(starts, dtype=np.int64), [np.asarray(u, dtype=np.int64) for u in uses]


def gather_windows(profile: Any, trace: Any, gathers: np.ndarray, depth: int,
                   memo: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per gather of a step (chunk ``k`` gathered ``gathers[k]`` times, at its first uses): the
    chunk it gathers and its window, as a share of the step's compute, with prefetch ``depth``
    (>= 1). ``memo`` (a dict kept with the trace's layout) remembers the schedule and the answers."""
    key = ("uses", id(profile))
    hit = memo.get(key)
    if hit is None or hit[0] is not profile:
        hit = memo[key] = (profile, _compute_before(profile), *chunk_uses(trace))
    _, cum, starts, uses = hit
    g = np.asarray(gathers, dtype=np.int64)
    wkey = ("windows", id(profile), depth, g.tobytes())
    got = memo.get(wkey)
    if got is None:
        js = [u[:n] for u, n in zip(uses, g) if n > 0]
        ids = np.repeat(np.nonzero(g > 0)[0], [len(j) for j in js]) if js else np.zeros(0, dtype=np.int64)
        j = np.concatenate(js) if js else np.zeros(0, dtype=np.int64)
        # issued when the schedule reaches the step ``depth`` before the use, or its first step
        # (nothing is prefetched before the first use: the first step's gather hides under nothing)
        w = cum[starts[j]] - cum[starts[np.maximum(j - depth, 0)]] if j.size else np.zeros(0)
        got = memo[wkey] = (ids, w)
    return got
