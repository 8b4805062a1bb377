"""Teardown of multi-rank runs: no native abort at exit, and in-flight asynchronous work is drained.

The abort these tests guard against: a gloo worker thread finishes a collective and drops the last
C++ reference to a tensor whose Python object it then has to release, so it asks for the GIL. If
the interpreter starts finalizing while that thread waits, CPython ends the thread with
``pthread_exit``, whose forced unwind crosses a ``noexcept`` destructor (``~TensorImpl``), and the
rank dies with SIGABRT: "terminate called without an active exception", in a thread with no
Python frame. ``destroy_process_group`` does not always join those threads (torch keeps the group
alive once some dispatch modes have run, e.g. the flop counter the prefetch search uses), so a
rank must never finalize its interpreter while such work can still finish.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch

from elixir import distributed as edist
from elixir.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.dist

N_GATHER = 1 << 18  # elements per rank: large enough to be real traffic, small enough to be quick


def _gil_holder():
    """A C callable (no Python frame around it) that keeps the GIL for about two seconds: regex
    backtracking never releases it. Registered as an exit handler it runs as the last step
    before the interpreter finalizes, and no Python code runs in between to hand the GIL over."""
    import re

    return functools.partial(re.compile(r"(x+x+)+y").match, "x" * 26)


def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write("exiting")


def _raise_with_gather_in_flight(marker: str) -> str:
    """Rank 0 raises with an all-gather in flight; rank 1 completes it while rank 0 is exiting.

    Rank 0 drops every Python reference to the gather's tensors and work (as a module freed with
    a prefetch in flight does), makes its exit hold the GIL in C code right up to finalization,
    and raises. Rank 1 joins the gather only once rank 0 is inside that C code, so rank 0's gloo
    thread finishes the gather and waits for the GIL exactly when the interpreter starts to
    finalize: an interpreter shutdown there aborts the rank.
    """
    import atexit

    import torch.distributed as dist

    out = torch.empty(2 * N_GATHER)
    shard = torch.ones(N_GATHER)
    if edist.get_rank() == 0:
        work = dist.all_gather_into_tensor(out, shard, async_op=True)
        del work, out, shard  # the gloo thread now holds the last references
        atexit._clear()  # no other exit handler: nothing hands the GIL over after the holder
        atexit.register(_gil_holder())  # handlers run last-registered first: this one runs last
        atexit.register(_touch, marker)
        raise RuntimeError("rank 0 fails with a gather in flight")
    deadline = time.monotonic() + 30
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # rank 0 is now inside the GIL holder, its last step before finalizing
    dist.all_gather_into_tensor(out, shard)
    time.sleep(30)  # stay alive: the parent reports rank 0's failure and kills this rank
    return "unreachable"


def test_failing_rank_with_work_in_flight_exits_cleanly(tmp_path):
    """The failing rank must report exit code 1 with its traceback, never a native abort."""
    codes = []
    for i in range(2):
        marker = str(tmp_path / f"rank0_exiting_{i}")
        with pytest.raises(DistributedFailure) as err:
            run_distributed(_raise_with_gather_in_flight, 2, marker, timeout=90)
        msg = str(err.value)
        assert "rank 0 fails with a gather in flight" in msg, msg
        codes.append(msg.split("rank 0 (exit code ", 1)[1].split(")", 1)[0])
    assert codes == ["1"] * 2, f"rank 0 exit codes {codes} (-6: native abort at interpreter exit)"


def _drain_cases() -> dict:
    """In-flight asynchronous work is tracked until drained, on its own and inside a module."""
    from elixir.chunk.state import ChunkState
    from elixir.search import minimum_waste_search
    from elixir.testing.reference import default_optimizer, shard_batch
    from elixir.testing.zoo import ZOO
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    rank, world = edist.get_rank(), edist.get_world_size()
    out = {}
    # 1. raw collectives: tracked while running, forgotten once waited or drained
    ts = [torch.full((1 << 16,), float(rank + 1 + i)) for i in range(3)]
    works = [edist.all_reduce(t, async_op=True) for t in ts]
    out["tracked"] = edist.pending_works() >= 1 or all(w.is_completed() for w in works)
    out["drained"] = edist.drain()
    out["after_drain"] = edist.pending_works()
    out["values"] = [t[0].item() for t in ts]
    w = edist.all_gather_into(torch.empty(2 * world), torch.ones(2), async_op=True)
    edist.wait_work(w)
    out["after_wait_work"] = len(edist._pending)

    # 2. a module with a prefetch gather in flight: drain() finishes it (GATHERING -> HOLD)
    zc = ZOO["tied"]
    torch.manual_seed(0)
    model = zc.build()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    sr = minimum_waste_search(model, world, prefetch=True, inp=zc.make_batch(4, 0), step_fn=zc.step_fn)
    em = ElixirModule(model, sr, prefetch=True)
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    released = [c for c in em.chunks if c.spec.sharded and c.state is ChunkState.RELEASED]
    for c in released:
        em.cache.prefetch(c, None, ())
    out["gathering"] = sum(c.state is ChunkState.GATHERING for c in em.chunks)
    out["pending_before"] = edist.pending_works() + sum(
        c.state is ChunkState.GATHERING for c in em.chunks
    )  # > 0: a prefetch is in flight (or finished but not yet waited on)
    em.drain()
    out["gathering_after"] = sum(c.state is ChunkState.GATHERING for c in em.chunks)
    out["pending_after"] = edist.pending_works()
    names = {id(p): n for n, p in model.named_parameters()}
    held = [c for c in released if c.state is ChunkState.HOLD]  # prefetched, not evicted since
    out["held"] = len(held)
    out["payload_ok"] = all(
        torch.equal(p.detach(), full[names[id(p)]])
        for c in held
        for p in em.params
        if em._slot_of[p].chunk == c.index
    )
    # the module still trains after the drain
    opt.zero_grad()
    loss = zc.loss(em, shard_batch(zc.make_batch(4, 0), rank, world))
    loss.backward()
    opt.step()
    out["loss_finite"] = bool(torch.isfinite(loss))
    out["pending_end"] = edist.pending_works()
    return out


def test_drain_finishes_in_flight_work():
    for rank, r in enumerate(run_distributed(_drain_cases, 2, timeout=120)):
        assert r["tracked"] and r["drained"] and r["after_drain"] == 0, (rank, r)
        assert r["values"] == [3.0, 5.0, 7.0], (rank, r)  # (1 + i) + (2 + i)
        assert r["after_wait_work"] == 0, (rank, r)
        assert r["gathering"] >= 1 and r["pending_before"] >= 1, (rank, r)
        assert r["gathering_after"] == 0 and r["pending_after"] == 0, (rank, r)
        assert r["held"] >= 1 and r["payload_ok"] and r["loss_finite"] and r["pending_end"] == 0, (rank, r)
