"""No hang when a rank dies (issue 18 item 1): one of two ranks is SIGKILLed during forward,
during backward's gradient reductions, during the optimizer step or during a checkpoint save; the
survivor must exit non-zero within a bounded time, with a message naming the step and the phase.
A save cut short leaves the previous checkpoint whole and loadable. The process group timeout is
set short (``ELIXIR_PG_TIMEOUT_S``) so the bound is small; gloo usually fails sooner, when the dead
peer's socket closes.

The survivor names where *it* was when it noticed: the next collective after the kill. So the
optimizer-step case clips gradients (``max_norm``: a global-norm all-reduce inside the step);
a step without any collective would be noticed at the next forward's first gather.

The four cases run at once (a module fixture starts all eight processes, a thread per case times
its survivor), on the zoo's toy tied LM, which needs no transformers import: a case is mostly two
interpreters starting."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from elixir import checkpoint
from elixir.testing.dist import free_port
from tests.checkpoint_cases import make

PG_TIMEOUT_S = 10
KILL_AT_STEP = 2
MODEL = "tied"  # the toy tied LM: what the phases exercise is the runtime's, not the model's
PHASES = ["forward", "backward", "optimizer step", "checkpoint save"]

_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from elixir import checkpoint, distributed as edist
    from elixir.checkpoint import format as tensor_files
    edist.init_distributed(backend="gloo")
    import checkpoint_cases as t
    PHASE, KILL, MODEL, rank = {phase!r}, {kill}, {model!r}, edist.get_rank()
    em, opt = t.make(world=2, name=MODEL, max_norm=1.0)

    def die(*_):
        if em.iteration == KILL:
            print("KILLING", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    if PHASE == "checkpoint save":
        t.train(em, opt, range(1), MODEL)
        checkpoint.save({path!r}, em, opt)
        sd = em.state_dict()
        if rank == 0:
            torch.save(sd, {expected!r})
        t.train(em, opt, range(1, KILL), MODEL)
        if rank == 1:  # die after writing this rank's shard, before the ranks agree on the outcome
            real = tensor_files.write_tensors
            def cut(path, tensors):
                real(path, tensors)
                die()
            tensor_files.write_tensors = cut
        checkpoint.save({path!r}, em, opt)
    else:
        if rank == 1 and PHASE == "forward":  # before the model's first gather of the step
            em.module.register_forward_pre_hook(die)
        if rank == 1 and PHASE == "backward":  # first gradient, before its chunk is reduced
            next(p for p in em.parameters() if p.requires_grad).register_post_accumulate_grad_hook(die)
        if rank == 1 and PHASE == "optimizer step":  # inside step, before the norm's all-reduce
            em.register_pre_step_hook(die)
        t.train(em, opt, range(4), MODEL)
    print("FINISHED", flush=True)
    """
)


def _start(tmp_path, phase: str) -> list[subprocess.Popen]:
    code = _CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)), kill=KILL_AT_STEP, phase=phase,
                         model=MODEL, path=str(tmp_path / "ck"), expected=str(tmp_path / "expected.pt"))
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   ELIXIR_PG_TIMEOUT_S=str(PG_TIMEOUT_S))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _watch(procs: list[subprocess.Popen]) -> dict:
    """Wait for rank 1's death, then time the survivor's exit (each case in a thread of its own)."""
    try:
        out1 = procs[1].communicate(timeout=240)[0]
        died = time.monotonic()
        if procs[1].returncode != -9 or "KILLING" not in out1:
            return {"error": f"rank 1 ended with {procs[1].returncode}, not killed:\n{out1[-2000:]}"}
        out0 = procs[0].communicate(timeout=PG_TIMEOUT_S + 60)[0]
        return {"out0": out0, "rc0": procs[0].returncode, "survivor_s": time.monotonic() - died}
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out: {e}"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict:
    """Per phase: its folder and how its survivor ended; all four cases run at once."""
    dirs = {phase: tmp_path_factory.mktemp(phase.replace(" ", "_")) for phase in PHASES}
    started = {}
    try:
        for phase in PHASES:
            started[phase] = _start(dirs[phase], phase)
    except BaseException:
        for procs in started.values():
            for p in procs:
                p.kill()
        raise
    with ThreadPoolExecutor(len(PHASES)) as pool:
        watched = {phase: pool.submit(_watch, procs) for phase, procs in started.items()}
        return {phase: (dirs[phase], w.result()) for phase, w in watched.items()}


@pytest.mark.dist
@pytest.mark.parametrize("phase", PHASES)
def test_survivor_exits_naming_the_step_and_phase_when_a_rank_is_killed(killed, phase):
    tmp_path, got = killed[phase]
    assert "error" not in got, got.get("error")
    path, expected, out0, survivor_s = str(tmp_path / "ck"), str(tmp_path / "expected.pt"), got["out0"], got["survivor_s"]
    assert got["rc0"] not in (0, None), out0[-2000:]
    assert "FINISHED" not in out0
    assert "CollectiveFailed" in out0 and f"step {KILL_AT_STEP}, {phase}" in out0, out0[-3000:]
    assert "ELIXIR_PG_TIMEOUT_S" in out0  # the message names the knob
    # the backend's timeout bounds it (plus the exit hook's drain and interpreter teardown)
    assert survivor_s < PG_TIMEOUT_S + 30, survivor_s
    line = next(ln for ln in out0.splitlines() if "CollectiveFailed" in ln)
    print(f"{phase}: survivor exited {survivor_s:.1f} s after rank 1 was killed: {line[:200]}")
    if phase == "checkpoint save":  # the save was cut short: the step-1 checkpoint is whole and loads
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".ck.tmp-")]  # rank 0 cleaned up
        checkpoint.verify(path)
        em, opt = make(world=1, name=MODEL)
        checkpoint.load(path, em, opt)
        want = torch.load(expected, weights_only=True)
        got = em.state_dict()
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
