"""The stream, event and pinned-pool logic of ``elixir.device``, exercised on CPU through its
stand-ins: the runtime issues gathers, reductions and refreshes on side streams and waits on
events exactly as on CUDA, so the ordering code runs (and is checked) in the CPU suite."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from elixir import device as dev
from elixir import distributed as edist
from elixir.chunk import Chunk, ChunkSpec, MemoryLedger
from elixir.optim import CPUAdam, functional
from elixir.plan import Placement
from elixir.search import minimum_waste_search
from elixir.testing.reference import default_optimizer, train_reference, train_wrapped
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer

CPU = torch.device("cpu")


def test_null_event_refuses_a_wait_before_it_was_recorded():
    ev = dev.new_event(CPU)
    with pytest.raises(dev.UnrecordedEventError):
        ev.wait()
    with pytest.raises(dev.UnrecordedEventError):
        dev.current_stream(CPU).wait_event(ev)
    ev.record()
    dev.current_stream(CPU).wait_event(ev)
    assert ev.waits == 1 and ev.query()


def test_side_stream_issue_runs_the_body_on_that_stream_after_compute():
    s = dev.SideStreams(CPU)
    compute = dev.current_stream(CPU)
    before = s.gather.waited_streams
    with s.issue(s.gather) as ev:
        assert dev.current_stream(CPU) is s.gather  # work in the body goes on the gather stream
        assert not ev.recorded  # recorded when the body's work is queued, not before
    assert ev.recorded and dev.current_stream(CPU) is compute
    assert s.gather.waited_streams == before + 1  # ordered after the compute stream's work
    s.wait(ev)
    assert ev.waits == 1 and compute.waited_events >= 1
    s.join()
    s.synchronize()
    assert s.reduce.synchronized == 1 and s.copy.synchronized == 1


def test_use_stream_restores_the_previous_stream_on_error():
    s = dev.new_stream(CPU, "x")
    compute = dev.current_stream(CPU)
    with pytest.raises(ValueError):
        with dev.use_stream(s):
            raise ValueError
    assert dev.current_stream(CPU) is compute


def test_host_pool_reuses_buffers_only_after_their_event():
    pool = dev.HostBufferPool()
    a = pool.take(16, torch.float32)
    pool.give(a)
    b = pool.take(16, torch.float32)
    assert b is a and pool.reused == 1 and pool.allocated == 1

    class Pending:  # a copy still in flight
        def query(self) -> bool:
            return False

    pool.give(b, Pending())
    c = pool.take(16, torch.float32)
    assert c is not b and pool.allocated == 2  # the busy buffer is not handed out
    assert pool.take(8, torch.bfloat16).dtype == torch.bfloat16
    assert pool.bytes == 16 * 4 * 2 + 8 * 2
    pool.clear()
    assert pool.bytes == 16 * 4 + 8 * 2  # the busy buffer was dropped from the pool


def _record_streams(monkeypatch) -> list:
    """Patch the collectives the chunk uses to note the stream they were issued on."""
    seen = []
    for name in ("all_gather_into", "reduce_scatter_into", "all_reduce"):
        real = getattr(edist, name)

        def spy(*a, _real=real, _name=name, **k):
            seen.append((_name, dev.current_stream(CPU).name))
            return _real(*a, **k)

        monkeypatch.setattr(edist, name, spy)
    return seen


def test_chunk_gathers_and_reduces_on_side_streams_and_compute_waits_per_chunk(monkeypatch):
    seen = _record_streams(monkeypatch)
    ledger = MemoryLedger()
    spec = ChunkSpec(0, 8, True, 1, 0, dtype=torch.bfloat16, shard_placement=Placement.HOST, optim_placement=Placement.HOST)
    c = Chunk(spec, ledger)
    c.init_from(torch.arange(8, dtype=torch.float32))
    c.release()
    c.gather(async_op=True)  # a prefetch: issued, not yet waited for
    ready = c._ready
    assert ready.recorded and ready.waits == 0
    c.pin()  # first use: the compute stream waits for this chunk's event
    assert ready.waits == 1 and c._ready is None
    assert c.payload.tolist() == list(range(8))
    c.unpin()
    c.add_grad(0, torch.ones(8))
    c.reduce()
    c.master.add_(1.0)
    c.refresh_from_master()  # bf16 shard beside the fp32 master: a copy on the copy stream
    assert c.shard.tolist() == list(range(1, 9))
    assert ("all_gather_into", "gather") in seen
    assert any(n in ("reduce_scatter_into", "all_reduce") and s == "reduce" for n, s in seen)
    assert all(s != "default" for _, s in seen)  # nothing on the compute stream
    assert c.shard_grad.tolist() == [1.0] * 8 and c.grad_valid
    assert c.streams.issued == 3  # gather, reduce, refresh


def test_late_gradient_is_staged_through_the_host_pool():
    spec = ChunkSpec(0, 8, True, 1, 0, shard_placement=Placement.HOST, optim_placement=Placement.HOST)
    c = Chunk(spec, MemoryLedger())
    c.init_from(torch.zeros(8))
    c.add_grad(0, torch.ones(8))
    c.reduce()
    pool = dev.host_pool()
    before = pool.allocated + pool.reused
    c.add_grad(0, torch.full((8,), 2.0))  # a second backward without zero_grad accumulates
    c.reduce()
    assert c.shard_grad.tolist() == [3.0] * 8
    assert pool.allocated + pool.reused == before + 1  # one staging buffer taken (and given back)
    assert c.streams.reduce.synchronized >= 1  # the host waited for the copy before adding


def _host_plan(plan):
    chunks = [dataclasses.replace(c, shard_placement=Placement.HOST, optim_placement=Placement.HOST) for c in plan.chunks]
    return dataclasses.replace(plan, chunks=tuple(chunks))


@pytest.mark.parametrize("fused", [False, True])
def test_host_placed_run_matches_reference_and_settles_streams(fused):
    """World 1, every chunk on the host: gathers are host-to-device copies on the gather stream;
    the end of backward joins the side streams and (host gradients) synchronizes them, and the
    optimizer synchronizes before the host writes masters."""
    zc = ZOO["gpt2"]
    model = build_model("gpt2")
    em = ElixirModule(model, _host_plan(minimum_waste_search(model, 1)), prefetch=False)
    make = (lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.01)) if fused else default_optimizer
    eo = ElixirOptimizer(em, make([p for p in em.parameters() if p.requires_grad]))
    assert any(c.spec.shard_on_host for c in em.chunks)
    run = train_wrapped(zc, em, eo, steps=3, batch_size=4)
    ref = train_reference(zc, steps=3, batch_size=4, optimizer_fn=make)
    for a, b in zip(run.losses, ref.losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    sd = em.state_dict()
    for k, v in ref.state_dict.items():
        assert torch.allclose(sd[k], v, rtol=1e-5, atol=1e-6), k
    s = em.streams
    assert s.gather.waited_streams > 0 and s.reduce.waited_streams > 0 and s.copy.waited_streams > 0
    # three ends of backward and three optimizer steps each synchronized every side stream
    assert s.reduce.synchronized >= 6
    rep = em.memory_report()
    assert rep["device_allocated_bytes"] == 0 and rep["device_max_allocated_bytes"] == 0  # CPU: the ledger only


def test_module_moves_buffers_and_frozen_parameters_to_its_device():
    model = build_model("buffers")
    em = ElixirModule(model, minimum_waste_search(model, 1))
    assert all(b.device == em.device for b in em.module.buffers())  # on CPU nothing moves
    em.device = torch.device("meta")  # stands in for an accelerator: the same moves happen
    em._move_rest_to_device()
    assert {b.device.type for b in em.module.buffers()} == {"meta"}
    # (parameters move with ``p.data = ...``, which keeps the optimizer's references; torch allows
    # that from CPU to CUDA but not to meta, so they are covered by the cuda tests)


def test_adam_queues_device_tensors_before_the_host_kernel(monkeypatch):
    """HybridAdam's overlap: tensors the native kernel does not take (accelerator tensors; here a
    non-contiguous one stands in) are issued first, so the device works while the host kernel runs."""
    if not functional.kernel_available():
        pytest.skip("native extension not built")
    order = []
    real_torch = functional._torch_adam
    monkeypatch.setattr(functional, "_torch_adam", lambda *a, **k: (order.append("device"), real_torch(*a, **k)))

    class Native:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def adam_update(self, *a):
            order.append("host")
            return self.inner.adam_update(*a)

    native = Native(functional.get_native())
    monkeypatch.setattr(functional, "get_native", lambda: native)
    host = torch.zeros(16)
    strided = torch.zeros(16, 2)[:, 0]  # not contiguous: takes the torch path
    tensors = [host, strided]
    functional.adam_step_multi(
        tensors, [torch.ones(16), torch.ones(16)], [torch.zeros(16), torch.zeros(16)],
        [torch.zeros(16), torch.zeros(16)], step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
    )
    assert order == ["device", "host"]
    assert torch.allclose(host, strided)


def _staging_worker() -> tuple:
    edist.DEVICE_ONLY_BACKENDS.add("gloo")  # in this rank: take the NCCL path for host tensors
    r = edist.get_rank()
    t = torch.tensor([float(r + 1)])
    edist.all_reduce(t)
    full = torch.empty(4)
    edist.all_gather_into(full, torch.full((2,), float(r)))
    out = torch.empty(2)
    edist.reduce_scatter_into(out, torch.arange(4.0))
    b = torch.tensor([float(r + 5)])
    edist.broadcast(b, 0)
    w = edist.all_reduce(torch.ones(1), async_op=True)
    edist.wait_work(w)
    return t.item(), full.tolist(), out.tolist(), b.item()


@pytest.mark.dist
def test_host_tensors_are_staged_for_device_only_backends():
    """NCCL takes device tensors only; the host flags, masks and norms the runtime reduces go
    through the compute device and back (here the CPU stands in for it, under gloo)."""
    from elixir.testing import run_distributed

    got = run_distributed(_staging_worker, 2, timeout=120)
    assert got[0] == (3.0, [0.0, 0.0, 1.0, 1.0], [0.0, 2.0], 5.0)
    assert got[1] == (3.0, [0.0, 0.0, 1.0, 1.0], [4.0, 6.0], 5.0)


def test_backward_step_waits_on_the_host_only_for_host_chunks():
    """The fused backward-and-step steps each chunk as its gradient is final: a host-placed chunk
    makes the host wait for the side streams, a device-placed one only the compute stream."""
    zc = ZOO["gpt2"]
    model = build_model("gpt2")
    plan = minimum_waste_search(model, 1)
    chunks = [dataclasses.replace(c, shard_placement=Placement.HOST, optim_placement=Placement.HOST) if i % 2 else c
              for i, c in enumerate(plan.chunks)]
    em = ElixirModule(model, dataclasses.replace(plan, chunks=tuple(chunks)))
    eo = ElixirOptimizer(em, CPUAdam([p for p in em.parameters() if p.requires_grad], lr=1e-2), fused_step=True)
    calls = []
    s = em.streams
    real_sync, real_join = s.synchronize, s.join
    s.synchronize = lambda: (calls.append("host"), real_sync())[1]
    s.join = lambda: (calls.append("device"), real_join())[1]
    seen = []
    real_settle = em.settle_chunk
    em.settle_chunk = lambda c: (seen.append(c.spec.master_on_host), calls.clear(), real_settle(c), seen.append(tuple(calls)))
    zc.loss(em, zc.make_batch(4, 0)).backward()
    eo.step()
    pairs = list(zip(seen[::2], seen[1::2]))
    assert {host for host, _ in pairs} == {True, False}  # both kinds were stepped during backward
    for host, what in pairs:
        assert what == (("host",) if host else ("device",)), (host, what)


@pytest.mark.dist
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and fork-inherited ru_maxrss are Linux's")
def test_peak_rss_of_a_spawned_process_excludes_the_parents_rss_at_fork():
    # ru_maxrss of a child starts at its parent's RSS at fork (kept across exec), so a rank spawned
    # from a large process reported the parent's peak; peak_rss_bytes reads the child's own VmHWM
    ballast = bytearray(384 << 20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touch every page: resident
    parent = dev.rss_bytes()
    code = ("import resource; from elixir import device as d; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, d.peak_rss_bytes(), d.rss_bytes())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))).stdout.split()
    ru_maxrss, peak, now = (int(x) for x in out)
    del ballast
    assert ru_maxrss > parent - (64 << 20)  # why ru_maxrss is wrong here: the parent's RSS at fork
    # the child's own peak: at least its RSS now, and without the parent's ballast
    assert now <= peak < ru_maxrss - (256 << 20)
