"""The GPU path's logic, on CPU (issue 32, items 2-10): what a careful read of the CUDA code paths
found, each checked through the CPU stand-ins of ``elixir.device`` (streams, events, timing
events, the pinned-memory registrar) or by forcing the accelerator branch where it is pure logic.
The cases only a GPU can run are in ``scripts/gpu_smoke.py``."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elixir import device as dev
from elixir import distributed as edist
from elixir.chunk import Chunk, ChunkSpec, MemoryLedger
from elixir.optim import HybridAdam, functional
from elixir.plan import Placement
from elixir.profiling.calibrate import timed_collectives
from elixir.search import minimum_waste_search
from elixir.testing.reference import train_wrapped
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer
from elixir.wrapper import fused_step as fused_step_mod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def placed(plan, shard: Placement, optim: Placement):
    chunks = [dataclasses.replace(c, shard_placement=shard, optim_placement=optim) for c in plan.chunks]
    return dataclasses.replace(plan, chunks=tuple(chunks))


def _module(shard=Placement.HOST, optim=Placement.HOST, dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    model = build_model("gpt2")
    return ElixirModule(model, placed(minimum_waste_search(model, 1), shard, optim), dtype=dtype, **kw)


# ---- item 2: device Adam widens the gradients block by block --------------------------------


def test_device_adam_widens_gradients_per_block_not_all_at_once(monkeypatch):
    torch.manual_seed(0)
    n, k = 600, 6

    def tensors():
        g = torch.Generator().manual_seed(1)
        ps = [torch.randn(n, generator=g) for _ in range(k)]
        gs = [torch.randn(n, generator=g).bfloat16() for _ in range(k)]
        return ps, gs, [torch.zeros(n) for _ in range(k)], [torch.zeros(n) for _ in range(k)]

    hyper = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                 bias_correction=True, div_scale=2.0)
    results = {}
    for block in (1000, 1 << 40):
        monkeypatch.setattr(functional, "WIDEN_BLOCK_NUMEL", block)
        monkeypatch.setattr(functional, "_widened_live", [0, 0])
        ps, gs, ms, vs = tensors()
        functional._torch_adam(ps, gs, ms, vs, [None] * k, **hyper)  # the path accelerator tensors take
        results[block] = (ps, ms, vs, functional._widened_live[1])
    small, whole = results[1000], results[1 << 40]
    assert small[3] == n and whole[3] == n * k  # at most one block alive (here one tensor), not all six
    for a, b in zip(small[:3], whole[:3]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))  # the same update, bit for bit
    assert functional.widen_block_bytes(10) == 4 * functional.WIDEN_BLOCK_NUMEL


# ---- item 3: pinned host memory of exactly the size asked for ----------------------------------


class _Registrar:
    """The CPU stand-in of cudaHostRegister / cudaHostUnregister: records the requests."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def register(self, ptr, nbytes):
        self.registered.append((ptr, nbytes))

    def unregister(self, ptr):
        self.unregistered.append(ptr)


def test_pinned_host_tensors_are_registered_at_their_exact_size(monkeypatch):
    rec = _Registrar()
    monkeypatch.setattr(dev, "PINNED_REGISTRAR", rec)
    before = dev.pinned_bytes()
    t = dev.empty_host((3, 1000), torch.float32)
    assert t.shape == (3, 1000) and t.dtype == torch.float32
    t.fill_(2.0)
    assert rec.registered == [(t.data_ptr(), 12000)]  # not 16 KiB: no power-of-two rounding
    assert dev.pinned_bytes() == before + 12000
    assert dev.empty_host(5, torch.float32, pin=False).numel() == 5 and len(rec.registered) == 1
    ptr = t.data_ptr()
    view = t[1]
    del t
    gc.collect()
    assert rec.unregistered == []  # a view keeps the block alive
    del view
    gc.collect()
    assert rec.unregistered == [ptr] and dev.pinned_bytes() == before
    p = dev.pin(torch.arange(7, dtype=torch.float64))
    assert p.tolist() == list(range(7)) and rec.registered[-1] == (p.data_ptr(), 56)


def test_host_shards_and_masters_are_pinned_at_their_exact_sizes(monkeypatch):
    rec = _Registrar()
    monkeypatch.setattr(dev, "PINNED_REGISTRAR", rec)
    em = _module(Placement.HOST, Placement.HOST)
    sizes = {ptr: n for ptr, n in rec.registered}
    host = [c for c in em.chunks if c.spec.shard_on_host]
    assert host
    for c in host:
        for t in (c.shard, c.master):
            assert sizes.get(t.data_ptr()) == t.numel() * t.element_size(), c.index
    opt = ElixirOptimizer(em, torch.optim.SGD([p for p in em.parameters() if p.requires_grad], lr=0.1))
    zc = ZOO["gpt2"]
    zc.loss(em, zc.make_batch(2, 0)).backward()
    grads = [c.shard_grad for c in host if c.shard_grad is not None]
    assert grads
    registered = {ptr: n for ptr, n in rec.registered}
    assert all(registered[g.data_ptr()] == g.numel() * g.element_size() for g in grads)
    opt.step()


# ---- item 4: the fused step's refresh on the copy stream, and only of stale chunks --------------


def _refreshes(monkeypatch):
    calls = []
    real = Chunk.refresh_from_master

    def spy(self):
        calls.append((self.index, dev.current_stream(self.spec.device).name))
        real(self)
    monkeypatch.setattr(Chunk, "refresh_from_master", spy)
    return calls


def _train(em, opt, steps=2):
    return train_wrapped(ZOO["gpt2"], em, opt, steps=steps, batch_size=2).losses


def test_fused_backward_step_refreshes_host_masters_on_the_copy_stream(monkeypatch):
    """A chunk stepped during backward with its master on the host: the shard is refreshed by a
    non-blocking copy issued on the copy stream (step() waits for it), not a blocking copy."""
    runs = {}
    for fused in (False, True):
        calls = _refreshes(monkeypatch)
        em = _module(Placement.HOST, Placement.HOST)
        opt = ElixirOptimizer(em, torch.optim.AdamW([p for p in em.parameters() if p.requires_grad], lr=1e-2),
                              fused_step=fused)
        zc = ZOO["gpt2"]
        opt.zero_grad()
        zc.loss(em, zc.make_batch(2, 0)).backward()
        during_backward = list(calls)
        opt.step()
        losses = _train(em, opt)
        runs[fused] = (losses, {k: v.clone() for k, v in em.state_dict().items()})
        if fused:
            assert opt.backward_step is not None
            stale = [c.index for c in em.chunks if c.shard is not c.master]
            assert sorted(i for i, _ in during_backward) == sorted(stale) and stale
            assert em.streams.copy.synchronized > 0  # step() waited for those copies
    assert runs[False][0] == runs[True][0]
    assert all(torch.equal(runs[False][1][k], runs[True][1][k]) for k in runs[False][1])


def test_step_refreshes_only_the_chunks_the_kernel_did_not_write(monkeypatch):
    real = fused_step_mod.shard_target
    states = {}
    for patched in (False, True):
        if patched:  # the kernel does not write chunk 0's compute shard (as for a device shard beside a host master)
            monkeypatch.setattr(fused_step_mod, "shard_target", lambda c: c.index != 0 and real(c))
        em = _module(Placement.HOST, Placement.HOST)
        opt = ElixirOptimizer(em, HybridAdam([p for p in em.parameters() if p.requires_grad], lr=1e-2), fused_step=False)
        calls = _refreshes(monkeypatch)
        _train(em, opt)
        states[patched] = {k: v.clone() for k, v in em.state_dict().items()}
        if patched:
            assert sorted({i for i, _ in calls}) == [0], calls  # not every chunk
        else:
            assert calls == []
    assert all(torch.equal(states[False][k], states[True][k]) for k in states[False])


# ---- item 5: a finished bench trial stays finished --------------------------------------------


def _bench():
    spec = importlib.util.spec_from_file_location("elixir_gpu_bench_t", os.path.join(ROOT, "bench", "gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.dist  # starts processes
def test_bench_keeps_a_result_written_before_the_trial_hung_at_exit(tmp_path):
    bench = _bench()
    args = bench.argparse.Namespace(out=str(tmp_path), budget_s=60.0, tiny=True, name="b", hardware=None)
    b = bench.Bench(args)
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent("""
        import json, sys, time
        out = sys.argv[sys.argv.index("--result") + 1]
        json.dump({"status": "ok", "step_s": 0.5, "final": True}, open(out, "w"))
        time.sleep(120)  # an NCCL group never destroyed: the process does not exit
    """))
    b.child_cmd = [sys.executable, str(child)]
    res = b.trial({"system": "plain", "size": "tiny"}, timeout=3.0)
    assert res["status"] == "ok" and "hung at exit" in res["exit"] and res["wall_s"] < 30
    child.write_text("import time; time.sleep(120)\n")
    assert b.trial({"system": "plain", "size": "tiny"}, timeout=2.0)["status"] == "timeout"
    assert bench.settle_result({"status": "running"}, True)["status"] == "timeout"


@pytest.mark.dist  # starts processes
def test_a_trial_process_leaves_even_with_a_thread_still_running():
    code = ("import threading, time, importlib.util, sys\n"
            "threading.Thread(target=time.sleep, args=(120,)).start()  # not a daemon: would block exit\n"
            f"spec = importlib.util.spec_from_file_location('b', {os.path.join(ROOT, 'bench', 'gpu.py')!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._end_trial()\n")
    r = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---- item 6: a world-1 host-shard gather copies once ----------------------------------------


class _Copies(TorchDispatchMode):
    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default) and args[0].numel() == self.numel:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_world_one_host_shard_gather_is_one_copy_into_the_payload(monkeypatch):
    spec = ChunkSpec(0, 4096, True, 1, 0, dtype=torch.bfloat16, shard_placement=Placement.HOST, optim_placement=Placement.HOST)
    c = Chunk(spec, MemoryLedger())
    c.init_from(torch.arange(4096, dtype=torch.float32))
    c.release()
    monkeypatch.setattr(dev, "is_accelerator", lambda d: True)  # the accelerator's branch, on CPU memory
    with _Copies(4096) as copies:
        c.gather()
    assert copies.count == 1  # straight into the payload (was: a device copy of the shard, then a second copy)
    assert torch.equal(c.payload, torch.arange(4096, dtype=torch.float32).bfloat16())


# ---- item 7: memory_report's host accounting and torch's peak statistics ----------------------


def test_memory_report_counts_host_bytes_only_and_building_resets_no_peaks(monkeypatch):
    resets = []
    monkeypatch.setattr(dev, "reset_peak_memory", lambda d=None: resets.append(d))
    em = _module(Placement.DEVICE, Placement.HOST)
    ElixirOptimizer(em, torch.optim.AdamW([p for p in em.parameters() if p.requires_grad], lr=1e-2), init_step=True)
    assert resets == []  # the user's own peak statistics survive building the module and optimizer
    cpu = em.memory_report()
    on_device = sum(n for (_, loc), n in em.ledger.current.items() if loc == "device")
    assert on_device > 0
    monkeypatch.setattr(dev, "is_accelerator", lambda d: True)  # as on a GPU: "device" bytes are not in RSS
    gpu = em.memory_report()
    assert cpu["elixir_bytes"] - gpu["elixir_bytes"] == on_device
    assert gpu["optimizer_state_host_bytes"] == gpu["optimizer_state_bytes"] > 0  # AdamW's moments are on the host


# ---- item 8: calibration times collectives by device events ------------------------------------


class _DeviceClock:
    now = 0.0


class _Ev:
    def record(self, stream=None):
        self.t = _DeviceClock.now

    def elapsed_time(self, end):
        return 1e3 * (end.t - self.t)


def test_calibration_times_accelerator_collectives_with_device_events(monkeypatch):
    """NCCL returns at once and its wait only orders a stream: host time is ~0. With an
    accelerator the clock reads device timing events after synchronising."""
    syncs = []

    class Work:
        def wait(self):
            _DeviceClock.now += 0.02  # the device finishes the collective later
            return True

    def fake_all_reduce(t, group=None, op=None, async_op=False):
        _DeviceClock.now += 0.05  # the device's time; the host returns at once
        return Work() if async_op else None

    monkeypatch.setattr(edist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(dev, "is_accelerator", lambda d: True)
    monkeypatch.setattr(dev, "timing_event", lambda d=None: _Ev())
    monkeypatch.setattr(dev, "synchronize", lambda d=None: syncs.append(d))
    with timed_collectives(torch.device("cpu")) as clock:
        edist.all_reduce(torch.zeros(1))
        edist.all_reduce(torch.zeros(1), async_op=True).wait()
    assert clock.calls == 2 and abs(clock.seconds - 0.12) < 1e-9 and syncs
    monkeypatch.undo()
    with timed_collectives(torch.device("cpu")) as clock:  # CPU: the host clock, as before
        edist.all_reduce(torch.zeros(1))
    assert clock.calls == 1 and clock.pairs == [] and clock.seconds >= 0


# ---- item 9: the rank's device is bound for a user-made process group -------------------------


def test_bind_device_picks_the_rank_device(monkeypatch):
    sets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: sets.append(i))
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert edist.bind_device() == torch.device("cuda", 2) and sets == [2]
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(edist, "is_initialized", lambda: True)  # a group the user initialised himself
    monkeypatch.setattr(edist.dist, "get_rank", lambda group=None: 7)
    assert edist.bind_device() == torch.device("cuda", 3) and sets == [2, 3]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # a device the user chose stays
    assert edist.bind_device() == torch.device("cuda", 1) and sets == [2, 3]


def test_module_binds_the_device_before_any_collective(monkeypatch):
    order = []
    monkeypatch.setattr(edist, "bind_device", lambda: order.append("bind"))
    real = edist.broadcast_object
    monkeypatch.setattr(edist, "broadcast_object", lambda *a, **k: (order.append("collective"), real(*a, **k))[1])
    _module(Placement.DEVICE, Placement.DEVICE, dtype=torch.float32)
    assert order and order[0] == "bind"


# ---- item 10: one host transfer for the norms, not one per chunk -----------------------------


def test_loss_scaler_flag_is_one_transfer_per_device():
    from elixir.optim.loss_scaler import found_inf_across_ranks

    assert not found_inf_across_ranks([torch.ones(3), torch.zeros(2)])
    assert found_inf_across_ranks([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not found_inf_across_ranks([])



def test_grad_norm_takes_no_host_copy_per_chunk(monkeypatch):
    """Item 10: the gradient norm's per-chunk terms stay on their device and come to the host
    together (here, on the CPU device, no copy at all), and the norm is still torch's."""
    from elixir.wrapper.clipping import global_grad_norm

    zc = ZOO["gpt2"]
    model = build_model("gpt2")
    ref = build_model("gpt2")
    em = ElixirModule(model, minimum_waste_search(model, 1))
    assert len(em.chunks) > 1
    batch = zc.make_batch(4, 0)
    zc.loss(em, batch).backward()
    zc.loss(ref, batch).backward()
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or real_cpu(self, *a, **k))
    norm = global_grad_norm(em, 2.0)
    monkeypatch.undo()
    assert copies == []
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None], 2.0)
    assert norm.norm == pytest.approx(want.item(), rel=1e-6) and not norm.found_inf
