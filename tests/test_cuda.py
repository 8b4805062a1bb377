"""The runtime on CUDA: the CPU correctness matrix again, on one GPU (and on two over NCCL when
two are present), in fp32, bf16 and fp16, with device, host and disk placements, prefetch on and
off, and a checkpoint round trip. Skipped without a GPU; `scripts/gpu_check.sh` runs them.

The references run on the same GPU (plain torch, the full batch), so the tolerances are those of
the CPU tests: TF32 is off so fp32 matmuls and convolutions are true fp32 on both sides, attention
runs on SDPA's math backend and convolutions on deterministic cuDNN kernels. GPU kernels may still
round differently for the chunk's parameter views (alignment picks the kernel), so final
parameters after AdamW get the allowance for another reduction order (``compare(reordered=True)``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from elixir import checkpoint
from elixir import device as dev
from elixir import distributed as edist
from elixir.plan import Placement
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import train_wrapped
from elixir.wrapper import ElixirModule, ElixirOptimizer
from tests.matrix_cases import BATCH, CASES, STEPS, Case, build, compare, opt_fn
from tests.mixed_reference import RUNS, check_mixed, mixed_worker

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]
DEVICE = "cuda"


def _exact_kernels() -> contextlib.AbstractContextManager:
    """True fp32 matmuls and convolutions, deterministic cuDNN, SDPA's math backend (in this
    process; spawned ranks enter it themselves)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    return sdpa_kernel([SDPBackend.MATH])


@pytest.fixture(autouse=True)
def _exact():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic)
    with _exact_kernels():
        yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = saved


def test_streams_are_real_and_host_memory_is_pinned():
    """On CUDA the side streams are distinct CUDA streams, host shards and gradients are pinned,
    and a step leaves no side-stream work unjoined."""
    from elixir.testing.reference import to_device
    from elixir.testing.zoo import ZOO, build_model

    zc = ZOO["gpt2"]
    model = build_model("gpt2")
    em = ElixirModule(model, placed(minimum_waste_search(model, 1), "host"))
    opt = ElixirOptimizer(em, torch.optim.AdamW([p for p in em.parameters() if p.requires_grad], lr=1e-2))
    s = em.streams
    assert isinstance(s.gather, torch.cuda.Stream) and len({s.gather, s.reduce, s.copy}) == 3
    assert s.gather != torch.cuda.current_stream()
    zc.loss(em, to_device(zc.make_batch(BATCH, 0), em.device)).backward()
    opt.step()
    host = [c for c in em.chunks if c.spec.shard_on_host]
    assert host and all(c.shard.is_pinned() and c.master.is_pinned() for c in host)
    assert all(c.shard_grad.is_pinned() for c in host if c.shard_grad is not None)
    assert s.issued > 0
    dev.synchronize()


def placed(plan, where: str):
    """``plan`` with every chunk's shard and optimizer state moved: "device" keeps the plan,
    "host" puts shards and optimizer state in (pinned) host memory, "disk" puts the optimizer
    state on disk and the shards on the host."""
    if where == "device":
        return plan
    optim = Placement.DISK if where == "disk" else Placement.HOST
    chunks = [dataclasses.replace(c, shard_placement=Placement.HOST, optim_placement=optim) for c in plan.chunks]
    return dataclasses.replace(plan, chunks=tuple(chunks))


def _train(case: Case, where: str, offload_dir=None) -> dict:
    zc = CASES[case.model]
    rank, world = edist.get_rank(), edist.get_world_size()
    model = build(case)
    if case.prefetch:
        sr = minimum_waste_search(model, world, prefetch=True, inp=zc.make_batch(BATCH // world, 0), step_fn=zc.step_fn)
    else:
        sr = minimum_waste_search(model, world)
    em = ElixirModule(model, placed(sr, where), prefetch=case.prefetch, offload_dir=offload_dir)
    assert em.device.type == "cuda"
    em.train()
    opt = ElixirOptimizer(em, opt_fn(case)([p for p in em.parameters() if p.requires_grad]))
    run = train_wrapped(zc, em, opt, steps=STEPS, batch_size=BATCH, device=em.device)
    out = {
        "losses": run.losses, "grads": run.first_grads if rank == 0 else None,
        "state": em.state_dict(rank0_only=True), "warnings": run.warnings,
        "memory": em.memory_report(), "prefetches": em.cache.prefetches,
    }
    if em.disk_store is not None:
        em.disk_store.close()
    return out


def _matrix() -> list:
    """The cases, host and disk placements first (the paths the CPU suite runs least like a GPU)."""
    out = [
        (Case("gpt2", True), "host"), (Case("gpt2", False), "host"), (Case("llama", True), "host"),
        (Case("gpt2", True), "disk"), (Case("tied", False), "disk"),
        (Case("gpt2", True, "nonreentrant"), "host"), (Case("routed", True, optim="sgd"), "host"),
        (Case("llama", False, "reentrant"), "device"),
    ]
    for name in ("gpt2", "llama", "opt", "tied", "frozen", "routed", "shared", "convnet", "buffers"):
        for pf in (False, True):
            out.append((Case(name, pf), "device"))
    return out


MATRIX = _matrix()


def _matrix_worker(cases: list, offload_dir: str) -> list:
    with _exact_kernels():  # (again: a spawned rank has no pytest fixture)
        return [_train(c, where, offload_dir) for c, where in cases]


def _check(cases: list, results: list, world: int) -> None:
    errors = []
    for (case, where), got in zip(cases, results):
        errors += [f"{where}: {e}" for e in compare(case, got, world, device=DEVICE, reordered=True)]
        if case.prefetch and world > 1 and where == "device":
            assert got["prefetches"] > 0, case.label
        if where == "device":
            assert got["memory"]["device_max_allocated_bytes"] > 0  # torch's statistics beside the ledger
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("case,where", MATRIX, ids=[f"{w}-{c.label}" for c, w in MATRIX])
def test_matrix_one_gpu(tmp_path, case, where):
    """One case per test, so one failure hides no other (scripts/gpu_check.sh runs them in this order)."""
    cases = [(case, where)]
    _check(cases, _matrix_worker(cases, str(tmp_path)), 1)


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_matrix_two_gpus_nccl(tmp_path):
    cases = [(c, w) for c, w in MATRIX if c.model != "buffers"]  # BatchNorm: batch-dependent
    results = run_distributed(_matrix_worker, 2, cases, str(tmp_path), timeout=600, backend="nccl")
    _check(cases, results[0], 2)
    for (case, where), a, b in zip(cases, results[0], results[1]):
        assert a["losses"] == b["losses"], (case.label, where)


def test_mixed_precision_one_gpu():
    check_mixed(mixed_worker(RUNS, device=DEVICE), 1, device=DEVICE)


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_mixed_precision_two_gpus_nccl():
    check_mixed(run_distributed(mixed_worker, 2, RUNS, device=DEVICE, timeout=300, backend="nccl")[0], 2, device=DEVICE)


@pytest.mark.parametrize("where", ["device", "host", "disk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_round_trip_one_gpu(tmp_path, where, dtype):
    """Train 2 steps, save, load into a fresh module and optimizer, train 1 more: the same state
    as 3 uninterrupted steps, bit for bit."""
    from elixir.testing.reference import to_device
    from elixir.testing.zoo import ZOO, build_model

    zc = ZOO["gpt2"]

    def make():
        model = build_model("gpt2")
        em = ElixirModule(model, placed(minimum_waste_search(model, 1), where), dtype=dtype,
                          output_fp32=dtype != torch.float32, offload_dir=str(tmp_path / "offload"))
        return em, ElixirOptimizer(em, torch.optim.AdamW([p for p in em.parameters() if p.requires_grad], lr=1e-2))

    def steps(em, opt, which):
        for s in which:
            opt.zero_grad()
            zc.loss(em, to_device(zc.make_batch(BATCH, s), em.device)).backward()
            opt.step()

    em, opt = make()
    steps(em, opt, range(2))
    checkpoint.save(str(tmp_path / "ckpt"), em, opt)
    steps(em, opt, [2])
    want = {"model": em.state_dict(), "optim": opt.state_dict()}
    em2, opt2 = make()
    checkpoint.load(str(tmp_path / "ckpt"), em2, opt2)
    steps(em2, opt2, [2])
    got = {"model": em2.state_dict(), "optim": opt2.state_dict()}
    bad = [k for k in want["model"] if not torch.equal(want["model"][k], got["model"][k])]
    for i, st in want["optim"]["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and not torch.equal(v.cpu(), got["optim"]["state"][i][k].cpu()):
                bad.append(f"optim {i}.{k}")
    assert not bad, bad
    for e in (em, em2):
        if e.disk_store is not None:
            e.disk_store.close()
