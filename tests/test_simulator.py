"""The rCache simulator: native and Python agree, Belady is optimal, counts are sane."""

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elixir._native import get_native
from elixir.search.simulator import AccessTrace, simulate

HAS_NATIVE = get_native() is not None and hasattr(get_native(), "simulate_cache")


@st.composite
def traces(draw, max_chunks=10, max_steps=40, max_width=4):
    n = draw(st.integers(1, max_chunks))
    steps = draw(st.lists(st.lists(st.integers(0, n - 1), max_size=max_width), max_size=max_steps))
    return steps, n


@pytest.mark.skipif(not HAS_NATIVE, reason="native extension not built")
@settings(max_examples=300, deadline=None)
@given(traces(), st.integers(0, 12), st.sampled_from(["belady", "lru"]))
def test_native_and_python_agree(tn, extra, policy):
    steps, n = tn
    tr = AccessTrace.from_steps(steps, n)
    blocks = tr.max_working_set() + extra
    a = simulate(tr, blocks, policy, backend="native")
    b = simulate(tr, blocks, policy, backend="python")
    assert (a.gathers, a.evictions) == (b.gathers, b.evictions)
    assert np.array_equal(a.per_chunk, b.per_chunk)


@settings(max_examples=200, deadline=None)
@given(traces(), st.integers(0, 6), st.sampled_from(["belady", "lru"]))
def test_counts_are_consistent(tn, extra, policy):
    steps, n = tn
    tr = AccessTrace.from_steps(steps, n)
    blocks = max(1, tr.max_working_set() + extra)
    s = simulate(tr, blocks, policy)
    distinct = len({c for st_ in steps for c in st_})
    assert s.gathers == int(s.per_chunk.sum())
    assert s.gathers >= distinct  # compulsory misses
    assert s.gathers - s.evictions <= blocks  # what is left resident fits
    if blocks >= distinct:
        assert s.gathers == distinct and s.evictions == 0


def _optimal_misses(seq: list[int], blocks: int) -> int:
    """Fewest misses over all eviction choices (exhaustive; single-chunk steps)."""

    @functools.cache
    def go(i: int, cache: frozenset) -> int:
        if i == len(seq):
            return 0
        c = seq[i]
        if c in cache:
            return go(i + 1, cache)
        if len(cache) < blocks:
            return 1 + go(i + 1, cache | {c})
        return 1 + min(go(i + 1, (cache - {v}) | {c}) for v in cache)

    return go(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=14), st.integers(1, 4))
def test_belady_is_optimal_and_beats_lru(seq, blocks):
    tr = AccessTrace.from_steps([[c] for c in seq], 6)
    bel = simulate(tr, blocks, "belady").gathers
    assert bel == _optimal_misses(seq, blocks)
    assert bel <= simulate(tr, blocks, "lru").gathers


def test_too_few_blocks_is_an_error():
    tr = AccessTrace.from_steps([[0, 1, 2]], 3)
    for backend in ("python",) + (("native",) if HAS_NATIVE else ()):
        with pytest.raises(ValueError, match="needs 3 chunks"):
            simulate(tr, 2, backend=backend)


def test_known_trace():
    # forward 0,1,2 then backward 2,1,0 through 2 blocks: gathering 2 evicts 0 (used last), so
    # only 0 is gathered twice (4 gathers); with 1 block, every change of chunk gathers (5).
    tr = AccessTrace.from_steps([[0], [1], [2], [2], [1], [0]], 3)
    assert simulate(tr, 2, "belady").gathers == 4
    assert simulate(tr, 1, "belady").gathers == 5
    assert simulate(tr, 3, "belady").gathers == 3
    assert simulate(tr, 1, "lru").gathers == 5
