"""Disk placement of fp32 masters and optimizer state (elixir.offload), executed by the runtime.

One spawned run per world size (1 and 2) trains every case: plans from ``minimum_waste_search``
with chunk placements replaced by DISK (some or all chunks), against the plain-torch reference
(the runtime matrix's tolerances), against the same run with those chunks on host (bit for bit,
plain AdamW and the fused CPUAdam path in bf16), and across a checkpoint saved and loaded
mid-run (sharded and full formats). The async I/O engines and offload_dir errors run in-process.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch

from elixir import checkpoint
from elixir import distributed as edist
from elixir._native import get_native
from elixir.offload import DiskState, NativeFileIO, OffloadDirError, OffloadFile, ThreadFileIO
from elixir.offload.directory import open_offload_file
from elixir.optim import CPUAdam
from elixir.plan import Placement
from elixir.plan.footprint import DISK_STAGING
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import default_optimizer, train_wrapped
from elixir.testing.zoo import ZOO
from elixir.wrapper import ElixirModule, ElixirOptimizer

try:  # the runtime matrix's reference comparison (same tolerances)
    from tests.matrix_cases import Case, compare
except ImportError:  # pragma: no cover - run from another directory
    from tests.matrix_cases import Case, compare

MODEL = "gpt2"
BATCH = 4


def _placed(plan, which: str):
    """``plan`` with the chosen chunks' optimizer state on DISK and the rest on HOST; with "all"
    the disk chunks' shards go to HOST, with "some" they stay where the plan put them (DEVICE)."""
    chunks = []
    for i, c in enumerate(plan.chunks):
        disk = which == "all" or (which == "some" and i % 2 == 0)
        place = Placement.DISK if disk else Placement.HOST
        shard = Placement.HOST if disk and which == "all" else c.shard_placement
        chunks.append(dataclasses.replace(c, optim_placement=place, shard_placement=shard))
    return dataclasses.replace(plan, chunks=tuple(chunks))


def _host_twin(plan):
    """The same plan with every DISK placement moved to HOST."""
    chunks = [dataclasses.replace(c, optim_placement=Placement.HOST) if c.optim_placement is Placement.DISK else c for c in plan.chunks]
    return dataclasses.replace(plan, chunks=tuple(chunks))


def _build(plan_of, dtype=torch.float32, fused=False, offload_dir=None, fused_step=None):
    zc = ZOO[MODEL]
    torch.manual_seed(0)
    model = zc.build()
    plan = plan_of(minimum_waste_search(model, edist.get_world_size()))
    em = ElixirModule(model, plan, dtype=dtype, output_fp32=dtype != torch.float32, offload_dir=offload_dir)
    em.train()
    params = [p for p in em.parameters() if p.requires_grad]
    inner = CPUAdam(params, lr=1e-2, weight_decay=0.01) if fused else default_optimizer(params)
    return em, ElixirOptimizer(em, inner, fused_step=fused_step)


def _resident_bytes(em, eo) -> int:
    """Host bytes the disk chunks' masters and elementwise optimizer state hold right now."""
    total = 0
    for i in em.disk_store.chunks:
        total += em.chunks[i].master.untyped_storage().nbytes()
        for f in eo.chunk_fragments(i):
            for v in (eo.optim.state.get(f.tensor) or {}).values():
                if isinstance(v, torch.Tensor) and v.dim() >= 1:
                    total += v.untyped_storage().nbytes()
    return total


def _run(which: str, steps: int = 3, dtype=torch.float32, fused=False) -> dict:
    em, eo = _build(lambda p: _placed(p, which), dtype, fused)
    run = train_wrapped(ZOO[MODEL], em, eo, steps=steps, batch_size=BATCH)
    store = em.disk_store
    rep = store.report() if store is not None else {}
    out = {
        "losses": run.losses,
        "grads": run.first_grads,
        "warnings": run.warnings,
        "state": em.state_dict(),
        "optim": eo.state_dict(),
        "master_bytes": em.memory_report()["master_bytes"],
        "disk_master_bytes": sum(4 * em.chunks[i].spec.shard_numel for i in (store.chunks if store else ())),
        "report": rep,
        "resident_after_step": _resident_bytes(em, eo) if store is not None else 0,
        "states": sorted({rec.state.value for rec in store.chunks.values()}) if store is not None else [],
    }
    if store is not None:
        store.close()
    return out


def _host_run(steps: int = 3, dtype=torch.float32, fused=False, which="some") -> dict:
    em, eo = _build(lambda p: _host_twin(_placed(p, which)), dtype, fused)
    run = train_wrapped(ZOO[MODEL], em, eo, steps=steps, batch_size=BATCH)
    return {"losses": run.losses, "state": em.state_dict(), "optim": eo.state_dict(),
            "master_bytes": em.memory_report()["master_bytes"]}


def _resume(shard: bool, root: str) -> dict:
    """2 steps, checkpoint, a fresh model and optimizer load it, 2 more steps (all disk)."""
    zc = ZOO[MODEL]
    path = os.path.join(root, f"ckpt-{'sharded' if shard else 'full'}")
    em, eo = _build(lambda p: _placed(p, "all"))
    first = train_wrapped(zc, em, eo, steps=2, batch_size=BATCH)
    checkpoint.save(path, em, eo, shard=shard)
    em.disk_store.close()
    em2, eo2 = _build(lambda p: _placed(p, "all"))
    checkpoint.load(path, em2, eo2)
    resident = _resident_bytes(em2, eo2)
    losses = train_wrapped(zc, em2, eo2, steps=2, batch_size=BATCH, first_step=2).losses
    out = {"losses": first.losses + losses, "state": em2.state_dict(), "optim": eo2.state_dict(), "resident_after_load": resident}
    em2.disk_store.close()
    return out


def _one_rank_bad_dir(root: str) -> str:
    """Only the last rank gets an unusable offload_dir: every rank must raise (none may hang)."""
    bad = os.path.join(root, "a-file")
    if edist.get_rank() == 0:
        with open(bad, "w") as fh:
            fh.write("x")
    edist.barrier()
    last = edist.get_rank() == edist.get_world_size() - 1
    try:
        _build(lambda p: _placed(p, "all"), offload_dir=bad if last else None)
    except OffloadDirError as e:
        return str(e)
    return ""


def _worker(root: str) -> dict:
    out = {
        "bad_dir": _one_rank_bad_dir(root),
        "some": _run("some"),
        "all": _run("all"),
        "host": _host_run(),
        "bf16_fused_disk": _run("some", dtype=torch.bfloat16, fused=True),
        "bf16_fused_host": _host_run(dtype=torch.bfloat16, fused=True),
    }
    # uninterrupted 4-step run for the resume checks (dropout-free model: the RNG does not matter)
    out["four"] = _run("all", steps=4)
    out["resume_sharded"] = _resume(True, root)
    out["resume_full"] = _resume(False, root)
    return out


def _equal_dicts(a: dict, b: dict) -> list[str]:
    errs = [f"keys differ: {set(a) ^ set(b)}"] if set(a) != set(b) else []
    return errs + [f"{k} differs" for k in a if k in b and not torch.equal(a[k], b[k])]


def _equal_optim(a: dict, b: dict) -> list[str]:
    if a.keys() != b.keys() or a["state"].keys() != b["state"].keys():
        return ["optimizer state keys differ"]
    errs = []
    for i in a["state"]:
        for k, v in a["state"][i].items():
            w = b["state"][i].get(k)
            if isinstance(v, torch.Tensor):
                if not isinstance(w, torch.Tensor) or not torch.equal(v, w):
                    errs.append(f"optimizer state {i}/{k} differs")
            elif v != w:
                errs.append(f"optimizer state {i}/{k}: {v} != {w}")
    return errs


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_disk_runs_match_reference_host_and_resume(world, tmp_path):
    results = run_distributed(_worker, world, str(tmp_path), timeout=300)
    got = results[0]
    errors = []
    # (a) against the plain-torch reference, with the runtime matrix's tolerances
    for which in ("some", "all"):
        errors += [f"[{which}] {e}" for e in compare(Case(MODEL), got[which], world)]
    # (b) disk and host placement step identically (plain AdamW and fused CPUAdam in bf16)
    for disk, host in (("some", "host"), ("bf16_fused_disk", "bf16_fused_host")):
        if got[disk]["losses"] != got[host]["losses"]:
            errors.append(f"{disk}: losses {got[disk]['losses']} != host {got[host]['losses']}")
        errors += [f"{disk}: {e}" for e in _equal_dicts(got[disk]["state"], got[host]["state"])]
        errors += [f"{disk}: {e}" for e in _equal_optim(got[disk]["optim"], got[host]["optim"])]
    # (c) resume from a checkpoint with disk-resident state equals the uninterrupted run
    for name in ("resume_sharded", "resume_full"):
        r = got[name]
        if r["losses"] != got["four"]["losses"]:
            errors.append(f"{name}: losses {r['losses']} != uninterrupted {got['four']['losses']}")
        errors += [f"{name}: {e}" for e in _equal_dicts(r["state"], got["four"]["state"])]
        errors += [f"{name}: {e}" for e in _equal_optim(r["optim"], got["four"]["optim"])]
        if r["resident_after_load"]:
            errors.append(f"{name}: {r['resident_after_load']} B of disk state left resident after load")
    assert not errors, "\n".join(errors)
    # (e) an unusable offload_dir on one rank raises on every rank, naming the rank and the fix
    for r, rank_res in enumerate(results):
        assert "not a directory" in rank_res["bad_dir"] and "offload_dir=" in rank_res["bad_dir"], (r, rank_res["bad_dir"])
        if world > 1 and r < world - 1:
            assert rank_res["bad_dir"].startswith(f"rank {world - 1}:")
    # host memory: between steps the disk chunks hold nothing; at most DISK_STAGING were staged at once
    for rank_res in results:
        for name in ("some", "all", "bf16_fused_disk"):
            r = rank_res[name]
            rep = r["report"]
            assert r["resident_after_step"] == 0, (name, r["resident_after_step"])
            assert r["states"] == [DiskState.OFFLOADED.value]
            assert rep["staged_bytes"] == 0
            assert rep["max_chunk_staged_bytes"] < rep["peak_staged_bytes"] <= DISK_STAGING * rep["max_chunk_staged_bytes"], rep
            assert rep["bytes_read"] > 0 and rep["bytes_written"] > 0
    # the ledger books masters only while staged: the bf16 disk run holds the host run's masters
    # minus exactly the disk chunks' (in bf16 every master is a tensor of its own)
    disk, host = got["bf16_fused_disk"], got["bf16_fused_host"]
    assert disk["disk_master_bytes"] > 0
    assert disk["master_bytes"] == host["master_bytes"] - disk["disk_master_bytes"]


# --------------------------------------------------------------------------------------------
# async I/O engines (in-process)


def _engines():
    out = [ThreadFileIO(2)]
    if get_native() is not None and hasattr(get_native(), "AioEngine"):
        out.append(NativeFileIO(2, piece_bytes=1 << 16))  # small pieces: many in flight per request
    return out


@pytest.mark.parametrize("direct", [False, True])
def test_aio_round_trip(tmp_path, direct):
    engines = _engines()
    assert get_native() is None or len(engines) == 2, "the native extension lacks AioEngine: rebuild it"
    for io in engines:
        f = OffloadFile(str(tmp_path / f"{io.kind}-{direct}.bin"), direct=direct)
        try:
            # an aligned buffer (its body O_DIRECT eligible, a 100-byte buffered tail) and odd
            # sizes/offsets (buffered)
            raw = torch.empty(4 * 4096 + 100, dtype=torch.uint8)
            off = (-raw.data_ptr()) % 4096
            aligned = raw[off : off + 3 * 4096 + 100]
            aligned.copy_(torch.randint(0, 255, aligned.shape, dtype=torch.uint8))
            parts = f.parts(0, aligned.data_ptr(), aligned.numel())
            if f.direct_fd is not None:
                assert [p[0] for p in parts] == [f.direct_fd, f.fd] and parts[1][3] == 100
            odd = torch.randn(100_003)
            odd16 = torch.randn(777).to(torch.bfloat16)
            hs = [io.write(f, 0, aligned), io.write(f, 4 * 4096 + 12, odd), io.write(f, 10**6 + 3, odd16)]
            for h in hs:
                h.wait()
            back_a, back_o, back_b = torch.empty_like(aligned), torch.empty_like(odd), torch.empty_like(odd16)
            hs = [io.read(f, 0, back_a), io.read(f, 4 * 4096 + 12, back_o), io.read(f, 10**6 + 3, back_b)]
            for h in hs:
                h.wait()
            assert torch.equal(back_a, aligned) and torch.equal(back_o, odd) and torch.equal(back_b, odd16), io.kind
            with pytest.raises((OSError, ValueError)):  # reading past the end of the file fails loudly
                io.read(f, 10**8, torch.empty(16)).wait()
            with pytest.raises(ValueError):
                io.write(f, 0, torch.randn(4, 4).t())  # not contiguous
        finally:
            io.close()
            f.close()


def test_a_filled_prefix_is_all_that_moves_after_the_first_write(tmp_path):
    """A record filled only in a prefix (a chunk's padding is its tail): its first write lays the
    whole region down, later writes and every read move the prefix only, and a read (staging, a
    derived shard's read-ahead, a converted read) zeroes the tail whatever memory held there."""
    from elixir.offload import DiskStore
    from elixir.offload.store import MASTER

    store = DiskStore(None, str(tmp_path), need_bytes=0)
    try:
        n, filled = 1000, 613
        master = torch.zeros(n)
        master[:filled] = torch.randn(filled)
        store.register_tensor(0, MASTER, master, filled=filled)
        assert store.bytes_written == 4 * n  # laid down whole once
        store.register_tensor(1, MASTER, torch.ones(8), filled=0)  # a shard of padding only
        store.stage(0)
        flat = store.chunks[0].flats[MASTER]
        assert store.bytes_read == 4 * filled and torch.equal(flat[filled:], torch.zeros(n - filled))
        expected = flat.clone()
        flat[filled:] = 7.0  # stray values in the tail never reach the disk
        store.offload(0)
        assert store.bytes_written == 4 * n + 4 * 8 + 4 * filled  # both laid down, then the prefix
        store.stage(0)
        assert torch.equal(store.chunks[0].flats[MASTER], expected)
        store.offload(0, write=False)
        out = torch.full((n,), 5.0)
        handle, nbytes, _ = store.read_flat(0, MASTER, out)
        handle.wait()
        assert nbytes == 4 * filled and torch.equal(out, expected)
        half = torch.full((n,), 5.0, dtype=torch.bfloat16)
        pieces = (torch.empty(100), torch.empty(100))
        assert store.read_converted(0, MASTER, half, pieces) == 4 * filled
        assert torch.equal(half, expected.to(torch.bfloat16))
        store.stage(1)
        assert torch.equal(store.chunks[1].flats[MASTER], torch.zeros(8))  # nothing read: all zero
        store.offload(1)
    finally:
        store.close()


# --------------------------------------------------------------------------------------------
# offload_dir errors and cleanup (in-process)


def test_bad_offload_dir_errors(tmp_path):
    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    with pytest.raises(OffloadDirError, match="offload_dir"):
        _build(lambda p: _placed(p, "all"), offload_dir=str(afile / "sub"))
    with pytest.raises(OffloadDirError, match="not a directory"):
        _build(lambda p: _placed(p, "all"), offload_dir=str(afile))
    with pytest.raises(OffloadDirError, match="free"):
        open_offload_file(str(tmp_path), need_bytes=1 << 60)
    assert os.listdir(tmp_path) == ["not-a-dir"]  # nothing left behind by the failures
    # no disk chunk: no store, and the directory is never touched
    em, _ = _build(lambda p: p, offload_dir=str(afile / "sub"))
    assert em.disk_store is None


def test_offload_dir_is_cleaned_up(tmp_path):
    """The offload file is unlinked as soon as it is open (nothing is left even if the process is
    killed); the default per-run directory under the temp dir goes with it."""
    em, eo = _build(lambda p: _placed(p, "all"), offload_dir=str(tmp_path))
    path = em.disk_store.path
    assert os.path.dirname(path) == str(tmp_path) and not os.path.exists(path) and not os.listdir(tmp_path)
    fd = em.disk_store.location.file.fd
    assert os.fstat(fd).st_size >= em.disk_store.report()["file_bytes"] > 0  # still reachable
    with pytest.raises(ValueError, match="pass offload_dir to ElixirModule"):
        ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]), offload_dir=str(tmp_path / "x"))
    em.disk_store.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    em2, _ = _build(lambda p: _placed(p, "some"))  # default: a per-run directory under the temp dir
    d = em2.disk_store.location.temp_dir
    assert d is not None and os.path.dirname(d) == tempfile.gettempdir() and not os.path.exists(d)
    em2.disk_store.close()


def test_missing_offload_dir_is_created_and_removed_again(tmp_path):
    """A nonexistent offload_dir (and its missing parents) is created for the run and removed
    again when the offload file is closed; a directory that existed is left as it was."""
    wanted = tmp_path / "new" / "deeper"
    em, _ = _build(lambda p: _placed(p, "all"), offload_dir=str(wanted))
    assert wanted.is_dir() and not os.listdir(wanted)  # in use (the file is open, its name unlinked)
    em.disk_store.close()
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
    # a created directory that holds a user's file by then stays
    em, _ = _build(lambda p: _placed(p, "all"), offload_dir=str(wanted))
    (tmp_path / "new" / "keep.txt").write_text("user data")
    em.disk_store.close()
    assert sorted(os.listdir(tmp_path / "new")) == ["keep.txt"]  # only the empty directory went
    # an existing directory stays
    em, _ = _build(lambda p: _placed(p, "all"), offload_dir=str(tmp_path / "new"))
    em.disk_store.close()
    assert sorted(os.listdir(tmp_path / "new")) == ["keep.txt"]


def test_python_fallback_trains_like_host(monkeypatch):
    """Without the native engine the thread fallback is used (with a warning) and a run with every
    chunk on disk still equals the host run bit for bit."""
    import elixir._native as native
    import elixir.offload.aio as aio

    monkeypatch.setattr(aio, "get_native", lambda: None)
    monkeypatch.setattr(native, "_warned", set())  # the warning is once per process
    with pytest.warns(RuntimeWarning, match="async disk I/O"):
        io = aio.make_io()
    assert isinstance(io, ThreadFileIO)
    io.close()
    em, eo = _build(lambda p: _placed(p, "all"))
    assert em.disk_store.io.kind == "python"
    disk = train_wrapped(ZOO[MODEL], em, eo, steps=2, batch_size=BATCH)
    sd = em.state_dict()
    em.disk_store.close()
    em2, eo2 = _build(lambda p: _host_twin(_placed(p, "all")))
    host = train_wrapped(ZOO[MODEL], em2, eo2, steps=2, batch_size=BATCH)
    assert disk.losses == host.losses
    assert not _equal_dicts(sd, em2.state_dict())


def test_init_step_and_load_state_dict_bind_to_disk():
    """init_step and load_state_dict leave no disk chunk's state resident and match the host twin."""
    zc = ZOO[MODEL]
    em, eo = _build(lambda p: _placed(p, "all"))
    eo_init = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]), init_step=True)
    assert _resident_bytes(em, eo_init) == 0
    em_h, _ = _build(lambda p: _host_twin(_placed(p, "all")))
    eo_h = ElixirOptimizer(em_h, default_optimizer([p for p in em_h.parameters() if p.requires_grad]), init_step=True)
    assert not _equal_optim(eo_init.state_dict(), eo_h.state_dict())
    train_wrapped(zc, em_h, eo_h, steps=2, batch_size=BATCH)
    eo_init.load_state_dict(eo_h.state_dict())
    em.load_state_dict(em_h.state_dict())
    assert _resident_bytes(em, eo_init) == 0 and em.disk_store.staged_bytes == 0
    assert not _equal_optim(eo_init.state_dict(), eo_h.state_dict())
    assert not _equal_dicts(em.state_dict(), em_h.state_dict())
    em.disk_store.close()


@pytest.mark.parametrize("shard", [True, False])
def test_checkpoint_stages_at_most_one_disk_chunk(tmp_path, shard):
    """Saving maps the disk chunks from the file (nothing staged; full format: one at a time);
    loading writes masters through the mapping and binds the loaded state one chunk at a time;
    a model-only load works too."""
    zc = ZOO[MODEL]
    em, eo = _build(lambda p: _placed(p, "all"))
    train_wrapped(zc, em, eo, steps=2, batch_size=BATCH)
    store = em.disk_store
    store.reset_peak()
    checkpoint.save(str(tmp_path / "ck"), em, eo, shard=shard)
    one = store.report()["max_chunk_staged_bytes"]
    assert store.peak_staged_bytes <= (0 if shard else one)
    em2, eo2 = _build(lambda p: _placed(p, "all"))
    em2.disk_store.reset_peak()
    checkpoint.load(str(tmp_path / "ck"), em2, eo2)
    assert 0 < em2.disk_store.peak_staged_bytes <= one and em2.disk_store.staged_bytes == 0
    assert _resident_bytes(em2, eo2) == 0
    assert not _equal_dicts(em.state_dict(), em2.state_dict())
    assert not _equal_optim(eo.state_dict(), eo2.state_dict())
    em3, _ = _build(lambda p: _placed(p, "some"))
    checkpoint.load(str(tmp_path / "ck"), em3)
    assert not _equal_dicts(em.state_dict(), em3.state_dict())
    for m in (em, em2, em3):
        m.disk_store.close()


@pytest.mark.parametrize("depth", [2, 4])
def test_fused_step_staging_depth_trains_like_host(depth):
    """The fused step at another staging depth than the default (2: each write finished before
    the next chunk is staged; 4: two writes in flight) steps every chunk on disk as the host
    placement does, bit for bit in fp32, and stages at most ``depth`` chunks at once (the
    default depth is checked by every other fused disk test)."""
    em, eo = _build(lambda p: _placed(p, "all"), fused=True, fused_step=True)
    eo.backward_step.stager.depth = depth
    disk = train_wrapped(ZOO[MODEL], em, eo, steps=3, batch_size=BATCH)
    rep, sd = em.disk_store.report(), em.state_dict()
    em.disk_store.close()
    em2, eo2 = _build(lambda p: _host_twin(_placed(p, "all")), fused=True, fused_step=True)
    host = train_wrapped(ZOO[MODEL], em2, eo2, steps=3, batch_size=BATCH)
    assert disk.losses == host.losses
    assert not _equal_dicts(sd, em2.state_dict())
    assert rep["bytes_written"] > 0 and rep["peak_staged_bytes"] <= depth * rep["max_chunk_staged_bytes"], rep
