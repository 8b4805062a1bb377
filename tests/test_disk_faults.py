"""Disk faults during offload (issue 18 item 4): a full disk (injected ``ENOSPC``) while the
optimizer step writes a disk chunk back, and an I/O error (injected ``EIO``) while it reads one.

The faults are injected into the store's async I/O engine (every transfer of the offload file goes
through it). Checked: the error names the offload directory and the fix; nothing is lost (a failed
write keeps the chunk's values in memory and they reach the disk once it works again; a failed
read leaves the disk copy as it was); no transfer is left in flight; and at world size 2, where
only rank 1's disk fails, every rank raises at that step (none waits in the next collective)."""

from __future__ import annotations

import dataclasses
import errno

import pytest
import torch

from elixir import checkpoint
from elixir import distributed as edist
from elixir.offload import DiskState
from elixir.plan import Placement
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import default_optimizer, shard_batch
from elixir.testing.zoo import ZOO
from elixir.wrapper import ElixirModule, ElixirOptimizer
from tests.checkpoint_cases import bitwise_diff

MODEL = "gpt2"
BATCH = 4


class Faulty:
    """The store's engine, with every write (or read) from the ``nth`` (1-based) after :meth:`arm`
    on failing with ``code`` when waited on, as a failed pwrite/pread reports it (a full disk
    stays full: the store's retries fail too, until :attr:`armed` is cleared)."""

    def __init__(self, real, kind: str, code: int, nth: int = 2) -> None:
        self.real, self.kind, self.code, self.nth = real, kind, code, nth
        self.armed, self.seen, self.failed = False, 0, 0

    def arm(self) -> None:
        self.armed, self.seen = True, 0

    def _maybe(self, kind, f, offset, t):
        handle = getattr(self.real, kind)(f, offset, t)
        if self.armed and kind == self.kind:
            self.seen += 1
            if self.seen >= self.nth:
                self.failed += 1
                code = self.code

                class Failed:
                    def wait(self) -> None:
                        handle.wait()  # the transfer really ran; the engine reports it failed
                        raise OSError(code, f"{errno.errorcode[code]}: {'No space left on device' if code == errno.ENOSPC else 'Input/output error'}")

                return Failed()
        return handle

    def read(self, f, offset, t):
        return self._maybe("read", f, offset, t)

    def write(self, f, offset, t):
        return self._maybe("write", f, offset, t)

    def close(self) -> None:
        self.real.close()


def _build(offload_dir: str):
    zc = ZOO[MODEL]
    torch.manual_seed(0)
    model = zc.build()
    plan = minimum_waste_search(model, edist.get_world_size())
    chunks = [dataclasses.replace(c, optim_placement=Placement.DISK, shard_placement=Placement.HOST) for c in plan.chunks]
    em = ElixirModule(model, dataclasses.replace(plan, chunks=tuple(chunks)), offload_dir=offload_dir)
    em.train()
    eo = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    return em, eo


def _step(em, eo, s: int) -> None:
    zc = ZOO[MODEL]
    eo.zero_grad()
    zc.loss(em, shard_batch(zc.make_batch(BATCH, s), edist.get_rank(), edist.get_world_size())).backward()
    eo.step()


def _disk_masters(store) -> dict[int, torch.Tensor]:
    """What the offload file holds for each chunk's master (every chunk must be offloaded)."""
    return {i: store.mapped(i)["master"].clone() for i in store.chunks}


@pytest.mark.parametrize("kind,code", [("write", errno.ENOSPC), ("read", errno.EIO)])
def test_disk_fault_in_the_step_is_named_and_loses_nothing(tmp_path, kind, code):
    em, eo = _build(str(tmp_path))
    store = em.disk_store
    assert len(store.chunks) >= 2
    _step(em, eo, 0)
    before = _disk_masters(store)
    faulty = store.io = Faulty(store.io, kind, code)
    faulty.arm()
    with pytest.raises(OSError) as info:
        _step(em, eo, 1)
    msg = str(info.value)
    assert faulty.failed >= 1 and info.value.errno == code
    assert str(tmp_path) in msg and "restart from the last checkpoint" in msg  # the offload dir, the way out
    if code == errno.ENOSPC:
        assert "free space in" in msg and "larger disk" in msg and "stay in memory" in msg
    else:
        assert "check the disk" in msg and "disk copy is unchanged" in msg
    # nothing in flight, nothing half-moved
    assert all(rec.state in (DiskState.OFFLOADED, DiskState.RESIDENT) and not rec.pending for rec in store.chunks.values())
    resident = [i for i, rec in store.chunks.items() if rec.state is DiskState.RESIDENT]
    if kind == "write":  # the chunks whose writes failed hold their masters in memory
        kept = {i: em.chunks[i].master.clone() for i in resident}
        assert any(not torch.equal(m, before[i]) for i, m in kept.items())  # one was stepped: newer than its disk copy
        # the offload disk is still full, yet a checkpoint to another disk saves the current
        # values, and a fresh model resumes from it exactly
        full = {"model": em.state_dict(), "optim": eo.state_dict()}
        checkpoint.save(str(tmp_path / "elsewhere"), em, eo)
        em2, eo2 = _build(str(tmp_path / "fresh"))
        checkpoint.load(str(tmp_path / "elsewhere"), em2, eo2)
        assert not bitwise_diff(full, {"model": em2.state_dict(), "optim": eo2.state_dict()})
        em2.disk_store.close()
        faulty.armed = False
        store.settle()  # the disk works again: the values reach it
        after = _disk_masters(store)
        assert all(torch.equal(after[i], m) for i, m in kept.items())
    else:  # the chunk whose read failed: dropped from memory, its disk copy as before the step
        assert not resident
        failed = next(i for i, rec in store.chunks.items() if rec.flats["master"].untyped_storage().nbytes() == 0
                      and torch.equal(store.mapped(i)["master"], before[i]))
        assert failed in before
    store.close()


def _two_ranks(offload_dir: str) -> dict:
    """Rank 1's disk fills up during step 2's optimizer step; both ranks report what they raised."""
    rank = edist.get_rank()
    em, eo = _build(f"{offload_dir}/r{rank}")
    out = {"rank": rank, "error": None}
    try:
        _step(em, eo, 0)
        if rank == 1:
            em.disk_store.io = Faulty(em.disk_store.io, "write", errno.ENOSPC)
            em.disk_store.io.arm()
        for s in range(1, 4):
            masters = _disk_masters(em.disk_store)
            _step(em, eo, s)
    except Exception as e:
        out["error"] = (type(e).__name__, str(e), em.iteration)
        out["stepped"] = _stepped_chunks(em, masters)
        out["disk_chunks"] = sorted(em.disk_store.chunks)
        out["step_again"] = _outcome(lambda: _step(em, eo, 9))[:2]
    if rank == 1:
        em.disk_store.io.armed = False
    em.disk_store.settle()
    em.disk_store.close()
    return out


@pytest.mark.dist
def test_disk_fault_on_one_rank_stops_every_rank(tmp_path):
    res = run_distributed(_two_ranks, 2, str(tmp_path), timeout=60)
    for r in res:
        assert r["error"] is not None, r
        name, msg, step = r["error"]
        assert name == "DiskFault" and step == 2, r  # at the step of the fault, not a collective later
        assert "rank 1's offload disk failed (step 2, optimizer step" in msg, msg
        assert "free space in" in msg and f"{tmp_path}/r1" in msg and "restart from the last checkpoint" in msg, msg
        assert "partly applied" in msg, msg
        # training on from the partial step is refused, on every rank alike
        assert r["step_again"][0] == "RuntimeError" and "Load a checkpoint" in r["step_again"][1], r
    # the same disk chunks were stepped on every rank, and the step stopped partway
    assert res[0]["stepped"] == res[1]["stepped"], res
    assert 0 < len(res[0]["stepped"]) < len(res[0]["disk_chunks"]), res


def test_offload_dir_vanishing_mid_run_changes_nothing(tmp_path):
    """The offload file's name is unlinked once its descriptors are open (elixir.offload.directory),
    so removing the whole offload directory mid-run (a cleanup job, a tmp reaper) loses nothing:
    training goes on bit for bit as with the directory in place, and closing does not fail."""
    import shutil

    def run(vanish: bool) -> dict:
        root = tmp_path / ("gone" if vanish else "kept")
        em, eo = _build(str(root / "offload"))
        _step(em, eo, 0)
        if vanish:
            shutil.rmtree(root)
            assert not root.exists()
        for s in range(1, 3):
            _step(em, eo, s)
        sd = em.state_dict()
        em.disk_store.close()
        return sd

    kept, gone = run(False), run(True)
    assert set(kept) == set(gone) and all(torch.equal(kept[k], gone[k]) for k in kept)


def _stepped_chunks(em, before: dict[int, torch.Tensor]) -> list[int]:
    """The disk chunks whose master differs from ``before`` (a chunk still staged after a failed
    write is read from memory)."""
    from elixir.offload.pipeline import disk_mapped

    with disk_mapped(em.disk_store) as masters:
        return sorted(i for i, m in masters.items() if not torch.equal(m, before[i]))


def _arm_rank1(em, kind: str, code: int, nth: int) -> list[Faulty]:
    """Rank 1's transfers of every store the module has fail from the ``nth`` ``kind`` on."""
    if edist.get_rank() != 1:
        return []
    armed = []
    for store in {id(s): s for s in (em.disk_store, em.shard_store) if s is not None}.values():
        store.io = Faulty(store.io, kind, code, nth)
        store.io.arm()
        armed.append(store.io)
    return armed


def _outcome(fn) -> tuple:
    """``fn()``'s error (type name, message, the faulty rank it names) and the seconds it took."""
    import time

    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), getattr(e, "rank", None), time.perf_counter() - t0
    return None, None, None, time.perf_counter() - t0


def _faults_outside_the_step(offload_dir: str) -> dict:
    """Rank 1's disk fails (1) reading a KK chunk's compute shard in step 2's forward, (2) writing
    a chunk back in step 2's fused backward-and-step. Every rank reports what it raised."""
    rank = edist.get_rank()
    zc = ZOO[MODEL]
    out: dict = {"rank": rank}

    # (1) forward: every chunk's shard, master and state on disk (KK)
    torch.manual_seed(0)
    model = zc.build()
    plan = minimum_waste_search(model, edist.get_world_size())
    kk = [dataclasses.replace(c, optim_placement=Placement.DISK, shard_placement=Placement.DISK) if c.sharded else c
          for c in plan.chunks]
    em = ElixirModule(model, dataclasses.replace(plan, chunks=tuple(kk)), offload_dir=f"{offload_dir}/kk{rank}")
    em.train()
    eo = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    _step(em, eo, 0)
    before = {k: v.clone() for k, v in em.state_dict().items()}
    faulty = _arm_rank1(em, "read", errno.EIO, 1)
    batch = shard_batch(zc.make_batch(BATCH, 1), rank, edist.get_world_size())
    eo.zero_grad()
    out["forward"] = _outcome(lambda: zc.loss(em, batch))
    out["forward_failed"] = sum(f.failed for f in faulty)
    for f in faulty:
        f.armed = False
    after = em.state_dict()
    out["forward_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    _step(em, eo, 1)  # the disk works again: training goes on, every rank in step
    out["forward_then_step"] = em.iteration
    for f in faulty:  # a state dict (a checkpoint's gather) reading a disk chunk
        f.arm()
    out["state_dict"] = _outcome(em.state_dict)
    for f in faulty:
        f.armed = False
    out["state_dict_after"] = len(em.state_dict())
    for store in (em.disk_store, em.shard_store):
        if store is not None:
            store.close()

    # (2) the fused backward-and-step: optimizer state on disk, written back during backward
    torch.manual_seed(0)
    model = zc.build()
    plan = minimum_waste_search(model, edist.get_world_size())
    chunks = [dataclasses.replace(c, optim_placement=Placement.DISK) for c in plan.chunks]
    em = ElixirModule(model, dataclasses.replace(plan, chunks=tuple(chunks)), offload_dir=f"{offload_dir}/fs{rank}")
    em.train()
    eo = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]), fused_step=True)
    _step(em, eo, 0)
    masters = _disk_masters(em.disk_store)
    faulty = _arm_rank1(em, "write", errno.ENOSPC, 2)
    batch = shard_batch(zc.make_batch(BATCH, 1), rank, edist.get_world_size())
    eo.zero_grad()
    loss = zc.loss(em, batch)
    out["fused"] = _outcome(loss.backward)
    out["fused_stepped"] = _stepped_chunks(em, masters)
    out["disk_chunks"] = sorted(em.disk_store.chunks)
    out["torn_step"] = eo.torn_step
    out["step_again"] = _outcome(eo.step)[:2]
    for f in faulty:
        f.armed = False
    em.disk_store.settle()
    # a checkpoint saved now holds the partial step; loading it lets training go on
    ckpt = f"{offload_dir}/ckpt"
    checkpoint.save(ckpt, em, eo)
    checkpoint.load(ckpt, em, eo)
    _step(em, eo, 2)
    out["after_load"] = eo.torn_step, em.iteration
    em.disk_store.close()
    return out


@pytest.mark.dist
def test_disk_faults_outside_the_step_stop_every_rank(tmp_path):
    """A disk fault in forward (a KK chunk's compute-shard read) or in the fused backward-and-step
    (a write) on rank 1 only: every rank raises DiskFault naming rank 1 at that point, at once (before
    the fix rank 0 waited in the next collective until the process group's timeout)."""
    res = run_distributed(_faults_outside_the_step, 2, str(tmp_path), timeout=60)
    for r in res:
        # (1) forward: every rank stops in the gather, names rank 1; nothing changed; training goes on
        name, msg, faulty, seconds = r["forward"]
        assert name == "DiskFault" and faulty == 1, r
        assert "rank 1's offload disk failed (step 2, forward: reading chunk" in msg and "restart from the last checkpoint" in msg, msg
        assert seconds < 10, r
        assert r["forward_unchanged"] and r["forward_then_step"] == 3, r
        name, msg, faulty, seconds = r["state_dict"]  # every rank stops before the gather, names rank 1
        assert name == "DiskFault" and faulty == 1 and "for a state dict after step 3" in msg and seconds < 10, r
        assert r["state_dict_after"] > 0, r
        # (2) the fused step: every rank stops in backward at the same point, names rank 1
        name, msg, faulty, seconds = r["fused"]
        assert name == "DiskFault" and faulty == 1 and "fused backward-and-step" in msg, r
        assert "free space in" in msg and f"{tmp_path}/fs1" in msg and "partly applied" in msg, msg
        assert seconds < 30, r
        assert r["torn_step"] == 2 and r["step_again"][0] == "RuntimeError" and "Load a checkpoint" in r["step_again"][1], r
        assert r["after_load"] == (None, 3), r
    assert res[1]["forward_failed"] >= 1
    # the same chunks were stepped on every rank (a sharded chunk is never stepped on only some
    # ranks), and the step stopped partway: some stepped, some not
    assert res[0]["fused_stepped"] == res[1]["fused_stepped"], res
    assert 0 < len(res[0]["fused_stepped"]) < len(res[0]["disk_chunks"]), res
