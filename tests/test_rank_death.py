"""No hang when a rank dies (issue 18 item 1): one of two ranks is SIGKILLed during forward,
during backward's gradient reductions, during the optimizer step or during a checkpoint save; the
survivor must exit non-zero within a bounded time, with a message naming the step and the phase.
A save cut short leaves the previous checkpoint whole and loadable. The process group timeout is
set short (``ELIXIR_PG_TIMEOUT_S``) so the bound is small; gloo usually fails sooner, when the dead
peer's socket closes.

The survivor names where *it* was when it noticed: the next collective after the kill. So the
optimizer-step case clips gradients (``max_norm``: a global-norm all-reduce inside the step);
a step without any collective would be noticed at the next forward's first gather."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from elixir import checkpoint
from elixir.testing.dist import free_port
from tests.checkpoint_cases import make

PG_TIMEOUT_S = 10
KILL_AT_STEP = 2

_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from elixir import checkpoint, distributed as edist
    from elixir.checkpoint import format as tensor_files
    edist.init_distributed(backend="gloo")
    import checkpoint_cases as t
    PHASE, KILL, rank = {phase!r}, {kill}, edist.get_rank()
    em, opt = t.make(world=2, max_norm=1.0)

    def die(*_):
        if em.iteration == KILL:
            print("KILLING", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    if PHASE == "checkpoint save":
        t.train(em, opt, range(1))
        checkpoint.save({path!r}, em, opt)
        sd = em.state_dict()
        if rank == 0:
            torch.save(sd, {expected!r})
        t.train(em, opt, range(1, KILL))
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
        t.train(em, opt, range(4))
    print("FINISHED", flush=True)
    """
)


@pytest.mark.dist
@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer step", "checkpoint save"])
def test_survivor_exits_naming_the_step_and_phase_when_a_rank_is_killed(tmp_path, phase):
    path, expected = str(tmp_path / "ck"), str(tmp_path / "expected.pt")
    code = _CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)), kill=KILL_AT_STEP, phase=phase,
                         path=path, expected=expected)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   ELIXIR_PG_TIMEOUT_S=str(PG_TIMEOUT_S))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        out1 = procs[1].communicate(timeout=240)[0]
        died = time.monotonic()
        assert procs[1].returncode == -9 and "KILLING" in out1, out1[-2000:]
        out0 = procs[0].communicate(timeout=PG_TIMEOUT_S + 60)[0]
        survivor_s = time.monotonic() - died
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode not in (0, None), out0[-2000:]
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
        em, opt = make(world=1)
        checkpoint.load(path, em, opt)
        want = torch.load(expected, weights_only=True)
        got = em.state_dict()
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
