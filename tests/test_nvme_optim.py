"""NVMe offload inside CPUAdam/HybridAdam: same numbers as in memory, state dicts, errors, cleanup."""

import copy
import os

import pytest
import torch
import torch.nn as nn

from elixir.offload import OffloadDirError
from elixir.optim import CPUAdam, HybridAdam
from tests.at_once import run_at_once


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # sizes that are not multiples of the bucket or of 16, so pieces and tails both occur
    return nn.Sequential(nn.Embedding(37, 24), nn.Linear(24, 53), nn.GELU(), nn.Linear(53, 37))


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 37, (4, 9), generator=g)


def _train(model, opt, steps, start=0):
    for s in range(start, start + steps):
        x = _batch(s)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offloaded_moments_step_bitwise_like_memory(tmp_path, cls, fraction):
    ref = _model()
    _train(ref, cls(ref.parameters(), lr=1e-2), 5)
    m = _model()
    opt = cls(m.parameters(), lr=1e-2, nvme_offload_fraction=fraction, nvme_offload_dir=str(tmp_path), nvme_offload_bucket_numel=500)
    _train(m, opt, 5)
    for a, b in zip(_params(ref), _params(m)):
        assert torch.equal(a, b)
    nvme = opt.nvme
    assert len(nvme.buckets) > 2  # several buckets, so the pipeline actually overlapped reads and writes
    total = sum(p.numel() for p in m.parameters())
    on_disk = sum(b.numel for b in nvme.buckets)
    largest = max(p.numel() for p in m.parameters())
    assert fraction * total <= on_disk < fraction * total + largest  # whole parameters
    # moments of offloaded parameters are not in memory: state holds only the step count
    for p in m.parameters():
        assert (set(opt.state[p]) == {"step"}) == nvme.is_offloaded(p)
    # at most two buckets were staged at once
    assert nvme.store.peak_staged_bytes <= 2 * max(b.numel for b in nvme.buckets) * 4 * 2
    assert nvme.store.bytes_written > 0 and nvme.store.bytes_read > 0


def test_state_dict_round_trip_and_resume(tmp_path):
    ref = _model()
    ref_opt = CPUAdam(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, 3)
    m = _model()
    opt = CPUAdam(m.parameters(), lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), nvme_offload_bucket_numel=700)
    _train(m, opt, 3)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert ref_sd["state"].keys() == sd["state"].keys()
    for k in ref_sd["state"]:
        for key, v in ref_sd["state"][k].items():
            assert torch.equal(v, sd["state"][k][key]), (k, key)
    assert all(set(opt.state[p]) == {"step"} for p in m.parameters())  # materialised only for the call
    # a torch optimizer loads it, and an offloading one loads torch's
    torch.optim.AdamW(_model().parameters(), lr=1e-2).load_state_dict(sd)
    m2 = _model()
    m2.load_state_dict(m.state_dict())
    opt2 = CPUAdam(m2.parameters(), lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), nvme_offload_bucket_numel=300)
    opt2.load_state_dict(copy.deepcopy(ref_sd))  # torch shares loaded tensors with their source
    assert all(set(opt2.state[p]) == {"step"} for p in m2.parameters())  # the loaded moments went to disk
    _train(ref, ref_opt, 2, start=3)
    _train(m2, opt2, 2, start=3)
    for a, b in zip(_params(ref), _params(m2)):
        assert torch.equal(a, b)


def test_bad_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OffloadDirError, match="not a directory"):
        CPUAdam(_model().parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=str(blocker))
    with pytest.raises(OffloadDirError, match="cannot be created"):
        CPUAdam(_model().parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=str(blocker / "sub"))
    with pytest.raises(ValueError, match=r"nvme_offload_fraction must lie in \[0, 1\]"):
        CPUAdam(_model().parameters(), nvme_offload_fraction=1.5)


def test_full_disk_is_refused_up_front(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1 << 30, 1 << 30, 1000))
    with pytest.raises(OffloadDirError, match=r"has 1000 bytes free but .* needs \d+\.\d KiB .* at least \d+\.\d KiB free") as err:
        CPUAdam(_model().parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    assert "0.0 MiB" not in str(err.value)  # before: "with at least 0.0 MiB free" for a need of tens of KiB
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_files_are_private_and_gone(tmp_path):
    opt = CPUAdam(_model().parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # unlinked once open: nothing to leak, even on a kill
    fd = opt.nvme.store.location.file.fd
    assert os.fstat(fd).st_size > 0


# ---- inside ElixirOptimizer (world 2, bf16 chunks: the fused mixed-precision path) ----------------


def _wrapped_run(fraction: float, root: str, steps: int = 5, resume_from: str = None):
    from elixir import checkpoint
    from elixir import distributed as edist
    from elixir.search import minimum_waste_search
    from elixir.testing.reference import train_wrapped
    from elixir.testing.zoo import ZOO
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    torch.manual_seed(0)
    model = ZOO["gpt2"].build()
    em = ElixirModule(model, minimum_waste_search(model, edist.get_world_size()), dtype=torch.bfloat16, output_fp32=True)
    inner = HybridAdam(
        [p for p in em.parameters() if p.requires_grad], lr=1e-2,
        nvme_offload_fraction=fraction, nvme_offload_dir=os.path.join(root, "nvme"), nvme_offload_bucket_numel=4096,
    )
    eo = ElixirOptimizer(em, inner)
    if resume_from:
        checkpoint.load(resume_from, em, eo)
    run = train_wrapped("gpt2", em, eo, steps=steps, seed=7 if resume_from else 0)
    out = {"losses": run.losses, "params": {k: v.clone() for k, v in em.state_dict().items()}, "optim": eo.state_dict()}
    if fraction > 0:
        out["on_disk"] = inner.nvme.offloaded_bytes
        out["resident_moments"] = sum(1 for s in inner.state.values() if "exp_avg" in s)
    if not resume_from:
        checkpoint.save(os.path.join(root, f"ckpt{fraction}"), em, eo)
    return out


def _elixir_worker(root: str) -> dict:
    return {
        "mem": _wrapped_run(0.0, root),
        "disk": _wrapped_run(1.0, root),
        "resumed": _wrapped_run(1.0, root, steps=1, resume_from=os.path.join(root, "ckpt0.0")),
        "resumed_mem": _wrapped_run(0.0, root, steps=1, resume_from=os.path.join(root, "ckpt1.0")),
    }


@pytest.mark.dist
def test_inside_elixir_optimizer_bitwise_and_checkpoints(tmp_path):
    from elixir.testing import run_distributed

    got = run_distributed(_elixir_worker, 2, str(tmp_path), timeout=300)[0]
    mem, disk = got["mem"], got["disk"]
    assert disk["on_disk"] > 0 and disk["resident_moments"] == 0
    assert mem["losses"] == disk["losses"]
    for k in mem["params"]:
        assert torch.equal(mem["params"][k], disk["params"][k]), k
    for i, st in mem["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, disk["optim"]["state"][i][k]), (i, k)
    # a checkpoint of the in-memory run loads into the offloading one and vice versa, same step after
    assert got["resumed"]["losses"] == got["resumed_mem"]["losses"]
    for k in got["resumed"]["params"]:
        assert torch.equal(got["resumed"]["params"][k], got["resumed_mem"]["params"][k]), k


@pytest.mark.dist
def test_example_and_bench_smoke(tmp_path):
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    example = [sys.executable, "example/gpt_nvme_offload.py", "--small", "--steps", "2", "--dir", str(tmp_path)]
    bench = [sys.executable, "bench/nvme_optimizer.py", "--numel", "200000", "--steps", "1", "--dd-mib", "8", "--bucket",
             "50000", "--dir", str(tmp_path)]
    # the three runs at once, each with files of its own in the one folder
    done = run_at_once({"0.0": [*example, "--fraction", "0.0"], "1.0": [*example, "--fraction", "1.0"], "bench": bench},
                       timeout=120, cwd=root, env=env)
    outs = []
    for f in ("0.0", "1.0"):
        r = done[f]
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append([line for line in r.stdout.splitlines() if line.startswith("step ")])
    assert len(outs[0]) == 2 and outs[0] == outs[1]  # same losses with the moments on disk
    r = done["bench"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert "efficiency vs dd" in r.stdout and "RSS saved" in r.stdout
    assert os.listdir(tmp_path) == []  # every file was private to its run


def test_a_failed_write_loses_nothing(tmp_path):
    """A full disk while writing a bucket back: the step raises, naming the fix; the bucket's
    stepped moments stay in memory and reach the disk on the retry; no value is lost or stale."""
    import errno

    def params():
        g = torch.Generator().manual_seed(0)
        return [nn.Parameter(torch.randn(640, generator=g)) for _ in range(3)]

    def grads(step):
        g = torch.Generator().manual_seed(10 + step)
        return [torch.randn(640, generator=g) for _ in range(3)]

    ref_p = params()
    ref = CPUAdam(ref_p, lr=1e-2)
    snapshots = []
    for step in range(3):
        for p, gr in zip(ref_p, grads(step)):
            p.grad = gr
        ref.step()
        snapshots.append({i: {k: v.clone() for k, v in ref.state[p].items()} for i, p in enumerate(ref_p)})

    ps = params()
    opt = CPUAdam(ps, lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path), nvme_offload_bucket_numel=640)
    for step in range(2):
        for p, gr in zip(ps, grads(step)):
            p.grad = gr
        opt.step()
    assert len(opt.nvme.buckets) == 3
    io = opt.nvme.store.io
    real_write, calls = io.write, []

    class Full:
        def wait(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    def write_failing_once(f, offset, t):  # the second bucket's first flat, once
        calls.append(offset)
        return Full() if len(calls) == 3 else real_write(f, offset, t)

    io.write = write_failing_once
    for p, gr in zip(ps, grads(2)):
        p.grad = gr
    with pytest.raises(OSError, match="free space in") as err:
        opt.step()
    assert err.value.errno == errno.ENOSPC and "its values stay in memory" in str(err.value)
    io.write = real_write
    sd = opt.state_dict()["state"]
    # buckets 0 and 1 were stepped (1's failed write was retried), bucket 2 was not reached
    for i, want in ((0, snapshots[2][0]), (1, snapshots[2][1]), (2, snapshots[1][2])):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd[i][k], want[k]), (i, k)
