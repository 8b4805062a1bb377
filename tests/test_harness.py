"""The multi-rank harness: results come back, failures carry the rank's traceback, hangs are caught."""

import os
import time

import pytest
import torch

from elixir import distributed as edist
from elixir import launch
from elixir.testing import DistributedFailure, DistributedHang, run_distributed
from tests.launch_jobs import Job, result, run_jobs

pytestmark = pytest.mark.dist


def _collectives_agree():
    rank, world = edist.get_rank(), edist.get_world_size()
    x = torch.full((4,), float(rank + 1))
    with edist.count_collectives() as counts:
        edist.all_reduce(x)
        full = torch.empty(4 * world)
        edist.all_gather_into(full, torch.full((4,), float(rank)))
        shard = torch.empty(2)
        edist.reduce_scatter_into(shard, torch.arange(2.0 * world))
    return rank, world, x.tolist(), full.tolist(), shard.tolist(), dict(counts)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_results_and_collectives(world):
    results = run_distributed(_collectives_agree, world, timeout=120)
    total = sum(range(1, world + 1))
    for rank, (r, w, reduced, gathered, shard, counts) in enumerate(results):
        assert (r, w) == (rank, world)
        assert reduced == [float(total)] * 4
        assert gathered == [float(i) for i in range(world) for _ in range(4)]
        assert shard == [float(world * (2 * rank)), float(world * (2 * rank + 1))]
        assert counts == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}


def _fail_on_rank_one():
    if edist.get_rank() == 1:
        raise ValueError("boom from rank one")
    edist.barrier()  # rank 0 waits for a peer that died: the harness must not hang on it
    return "ok"


def test_failing_rank_fails_with_its_traceback():
    with pytest.raises(DistributedFailure) as err:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    msg = str(err.value)
    assert "rank 1" in msg and "boom from rank one" in msg and "_fail_on_rank_one" in msg


# long enough for both ranks to start and reach the function, so rank 0's stack shows where it
# hangs (forked from the preloaded server, tests/conftest.py: well under a second; spawned, importing
# torch and elixir: 3-8 s here); every second of it is waited out
HANG_TIMEOUT_S = 15 if launch.START_METHOD == "spawn" else 6


def _hang_on_rank_zero():
    if edist.get_rank() == 0:
        time.sleep(3600)
    return "done"


def test_hanging_rank_is_caught():
    start = time.monotonic()
    with pytest.raises(DistributedHang) as err:
        run_distributed(_hang_on_rank_zero, 2, timeout=HANG_TIMEOUT_S)
    assert time.monotonic() - start < HANG_TIMEOUT_S + 30
    msg = str(err.value)
    # rank 1 finished its function and waits for rank 0 at shutdown, so both may be listed
    assert "hang" in msg and "ranks [0" in msg and "--- rank 0 ---" in msg
    assert "_hang_on_rank_zero" in msg  # the stuck rank's stack is shown


def test_init_distributed_single_process():
    info = edist.init_distributed()
    assert (info.rank, info.world_size) == (0, 1) and info.is_main


def _abort_on_rank_one():
    import os

    if edist.get_rank() == 1:
        os.abort()  # stands in for a crash in native code: no Python exception
    return "ok"


def test_native_abort_is_reported_with_its_stack():
    with pytest.raises(DistributedFailure) as err:
        run_distributed(_abort_on_rank_one, 2, timeout=60)
    msg = str(err.value)
    assert "rank 1 (exit code -6)" in msg and "_abort_on_rank_one" in msg


def _leave_exit_work(outdir):
    """A clean rank still gets a normal exit: exit handlers run, non-daemon threads are joined."""
    import atexit
    import os
    import threading

    rank = edist.get_rank()

    def write(name):
        with open(os.path.join(outdir, f"{name}_{rank}"), "w") as f:
            f.write("done")

    atexit.register(write, "atexit")

    def late():
        time.sleep(0.5)
        write("thread")

    threading.Thread(target=late).start()
    return rank


def test_clean_rank_runs_exit_handlers_and_joins_threads(tmp_path):
    assert run_distributed(_leave_exit_work, 2, str(tmp_path), timeout=60) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit_0", "atexit_1", "thread_0", "thread_1"]


def _environment_and_output():
    print(f"rank {edist.get_rank()} prints to the launcher's stdout", flush=True)
    return os.environ.get("ELIXIR_HARNESS_PROBE")


def test_ranks_see_the_launchers_environment_and_write_to_its_output(monkeypatch, capfd):
    # set after the first launch of this session (a fork server started then has its own copies)
    run_distributed(_environment_and_output, 1, timeout=60)
    monkeypatch.setenv("ELIXIR_HARNESS_PROBE", "set by the test")
    capfd.readouterr()
    assert run_distributed(_environment_and_output, 2, timeout=60) == ["set by the test"] * 2
    out = capfd.readouterr().out
    assert "rank 0 prints to the launcher's stdout" in out and "rank 1 prints" in out, out


def _double(x):
    return 2 * x


def _raise_on_rank_one():
    if edist.get_rank() == 1:
        raise ValueError("job failed on rank one")
    return "fine"


def test_batched_jobs_fail_only_the_tests_that_own_them():
    """tests/launch_jobs.py: several tests' jobs in one launch; a job that raises fails its own
    test with its traceback, the jobs after it say they did not run, those before it pass."""
    res = run_jobs(2, {"first": Job(_double, (3,)), "bad": Job(_raise_on_rank_one), "after": Job(_double, (1,))},
                   timeout=60)
    assert result(res, "first") == [6, 6]
    with pytest.raises(AssertionError, match=r"(?s)job 'bad'.*rank 1 raised.*job failed on rank one"):
        result(res, "bad")
    with pytest.raises(AssertionError, match=r"rank 1: not run \(an earlier job in the same launch failed: \['bad'\]\)"):
        result(res, "after")
