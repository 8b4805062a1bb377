"""A plain torchrun script exits with code 0 on every rank: no native abort at interpreter exit.

The abort (issue 20, item 1): collectives issued during ``loss.backward()`` copy a thread-local state
that holds a Python object (the ``contextvars`` context torch stashes for the autograd engine). The
gloo thread that finishes such a collective may drop the work last, which takes the GIL; when that
happens after the script's end, while the interpreter finalizes, the rank dies with SIGABRT
("terminate called without an active exception") and torchrun reports the finished job as failed.
See :mod:`elixir.distributed`.

The deterministic check of the cause is ``test_collectives_issued_in_backward_carry_no_python_object``;
the torchrun loop samples the symptom 6 times in the default suite, two jobs at a time (each is a
torchrun launch, about 6 s here alone; the abort struck about 1 run in 16 before the fix).
``ELIXIR_EXIT_RUNS=50 pytest tests/test_exit.py -k torchrun`` is the stress version.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import pytest
import torch

from elixir import distributed as edist
from elixir.testing import run_distributed
from tests.at_once import run_at_once

pytestmark = pytest.mark.dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "torchrun_plain_train.py"


def _tls_at_collectives() -> dict:
    """Record, for every gloo collective elixir issues during a training step, whether the issuing
    thread's state held torch's stashed Python object at that moment."""
    import torch.distributed as dist

    from elixir.search import minimum_waste_search
    from elixir.testing.reference import default_optimizer, shard_batch
    from elixir.testing.zoo import ZOO
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    seen = []

    def spy(orig):
        def call(*args, **kwargs):
            seen.append(bool(torch._C._is_key_in_tls("context")))
            return orig(*args, **kwargs)

        return call

    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"):
        setattr(dist, name, spy(getattr(dist, name)))
    for name in ("_all_gather_base", "_reduce_scatter_base"):
        setattr(edist, name, spy(getattr(edist, name)))

    zc = ZOO["tied"]
    torch.manual_seed(0)
    model = zc.build()
    rank, world = edist.get_rank(), edist.get_world_size()
    em = ElixirModule(model, minimum_waste_search(model, world), prefetch=True)
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    in_backward = []

    def hook(grad):  # a user's hook during backward: torch's stash is there
        in_backward.append(bool(torch._C._is_key_in_tls("context")))
        return grad

    loss = zc.loss(em, shard_batch(zc.make_batch(4, 0), rank, world))
    loss.register_hook(hook)
    seen.clear()
    loss.backward()
    opt.step()
    return {"collectives": len(seen), "with_python_tls": sum(seen), "stash_in_backward": in_backward}


def test_collectives_issued_in_backward_carry_no_python_object():
    for rank, r in enumerate(run_distributed(_tls_at_collectives, 2, timeout=120)):
        assert r["collectives"] > 0, (rank, r)
        if r["stash_in_backward"] != [True]:
            pytest.skip("this torch stashes no Python object for backward")  # nothing to guard against
        assert r["with_python_tls"] == 0, (rank, r)


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def test_plain_torchrun_script_exits_cleanly_every_time(tmp_path):
    """Run the plain script (no harness, normal interpreter exit) repeatedly: 0 aborts allowed.
    Two jobs run at a time: each spends most of its time starting interpreters on one core."""
    runs = int(os.environ.get("ELIXIR_EXIT_RUNS", "6"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = _torchrun() + ["--nproc-per-node", "2", "--standalone", str(SCRIPT), "--search", "minimum_waste"]
    failures = []
    for first in range(0, runs, 2):
        batch = {i: cmd for i in range(first, min(first + 2, runs))}
        for i, p in run_at_once(batch, timeout=300, cwds={i: tmp_path for i in batch}, env=env).items():
            out = p.stdout + p.stderr
            if p.returncode != 0 or "terminate called" in out or out.count(": loss ") != 2:
                failures.append(f"run {i}: exit code {p.returncode}\n{out[-2000:]}")
    assert not failures, f"{len(failures)} of {runs} runs failed:\n" + "\n".join(failures)
