"""No hang when a rank dies (issue 18 item 1, first slice): one of two ranks is SIGKILLed during
backward's gradient reductions; the survivor must exit non-zero within a bounded time, with a
message naming the step. The process group timeout is set short (``ELIXIR_PG_TIMEOUT_S``) so the
bound is small; gloo usually fails sooner, when the dead peer's socket closes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from elixir.testing.dist import free_port

PG_TIMEOUT_S = 10
KILL_AT_STEP = 2

_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from elixir import distributed as edist
    edist.init_distributed(backend="gloo")
    import test_checkpoint as t
    em, opt = t.make(world=2)
    if edist.get_rank() == 1:
        def die(_):  # first gradient of step KILL_AT_STEP's backward, before its chunk is reduced
            if em.iteration == {kill}:
                print("KILLING", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        next(p for p in em.parameters() if p.requires_grad).register_post_accumulate_grad_hook(die)
    t.train(em, opt, range(4))
    print("FINISHED", flush=True)
    """
)


def test_survivor_exits_with_the_step_when_a_rank_is_killed_in_backward(tmp_path):
    code = _CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)), kill=KILL_AT_STEP)
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
    assert "CollectiveFailed" in out0 and f"step {KILL_AT_STEP}, backward" in out0, out0[-3000:]
    assert "ELIXIR_PG_TIMEOUT_S" in out0  # the message names the knob
    # the backend's timeout bounds it (plus the exit hook's drain and interpreter teardown)
    assert survivor_s < PG_TIMEOUT_S + 30, survivor_s
    line = next(ln for ln in out0.splitlines() if "CollectiveFailed" in ln)
    print(f"survivor exited {survivor_s:.1f} s after rank 1 was killed: {line[:300]}")
