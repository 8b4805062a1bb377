"""Launch a function on N local gloo ranks in subprocesses, as torchrun would.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` fresh processes, sets the same
environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port),
initialises a gloo process group, calls ``fn(*args, **kwargs)`` on every rank and returns the list
of per-rank return values.

- A rank that raises fails the call with :class:`DistributedFailure`, carrying that rank's
  traceback; the other ranks are killed.
- A rank still running at ``timeout`` seconds is killed and reported with
  :class:`DistributedHang`, including the stack every unfinished rank was in.

How a rank ends: after ``fn`` returns, the ranks drain elixir's asynchronous work, meet at a
barrier and destroy the process group (:func:`elixir.distributed.shutdown`); then each joins its
non-daemon threads, runs its exit handlers and leaves with ``os._exit``, without finalizing the
interpreter (so a file ``fn`` left open and unflushed is not flushed: close what you write). A rank that raised
writes its traceback and leaves with ``os._exit(1)`` at once. The reason: torch can keep the gloo
worker threads alive past ``destroy_process_group``, and a gloo thread that finishes a collective
while the interpreter finalizes aborts the rank ("terminate called without an active exception",
see :mod:`elixir.distributed`), most readily when a rank fails with a collective in flight.

The ranks start as fresh interpreters (``multiprocessing``'s "spawn") unless :data:`START_METHOD`
says otherwise: the test suite uses "forkserver" with torch and elixir preloaded in the server
(``tests/conftest.py``), so a launch costs a fork instead of importing torch in every rank. Each
rank then takes the launching process's environment and standard output and error, as a spawned
one would.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import reduction
from typing import Any, Callable

import torch

from elixir.distributed import init_distributed, shutdown

START_METHOD = "spawn"  # multiprocessing start method of the ranks (see the module docstring)


class DistributedFailure(RuntimeError):
    """A rank raised. The message holds that rank's traceback."""


class DistributedHang(TimeoutError):
    """Some ranks did not finish in time. The message holds their stacks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _LauncherContext:
    """The launching process's environment and standard output and error, for a rank started
    from a fork server (which has its own): pickled with the rank, the descriptors passed along."""

    def __init__(self, env: dict[str, str], fds: tuple = ()) -> None:
        self.env, self.fds = env, fds

    def __reduce__(self):
        return _LauncherContext, (self.env, tuple(reduction.DupFd(fd) for fd in (1, 2)))

    def enter(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        for target, fd in zip((1, 2), self.fds):
            os.dup2(fd.detach(), target)


def _worker(fn, args, kwargs, rank, world_size, port, outdir, timeout, threads, backend="gloo", launcher=None):
    if launcher is not None:
        launcher.enter()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    stack_file = open(os.path.join(outdir, f"stack_{rank}.txt"), "w")
    # When the parent gives up on this rank it sends SIGUSR1 first: dump where we are stuck.
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # A fatal signal (an abort in native code, a segfault) also leaves the Python stacks there.
    faulthandler.enable(file=stack_file, all_threads=True)
    code = 1
    try:
        torch.set_num_threads(threads)
        # the group's own timeout outlasts the launch's: a rank waiting on a hung peer must not fail
        # first, or the hang would be reported as that rank's timeout, without the hung rank's stack
        init_distributed(backend=backend, timeout_s=timeout + 60)
        result = fn(*args, **kwargs)
        with open(os.path.join(outdir, f"result_{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        # Shut down together, with nothing in flight: a rank that tears down gloo while a peer
        # still has traffic for it can fail the peer.
        shutdown()
        code = 0
    except BaseException:
        with open(os.path.join(outdir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    _exit_rank(code, stack_file)


def _exit_rank(code: int, stack_file) -> None:
    """Leave the rank without finalizing the interpreter (see the module docstring).

    A clean rank first does what a normal exit does while the interpreter is still whole: join
    non-daemon threads and run the exit handlers. A failed rank skips them: they could wait on
    peers that are gone, and the parent is waiting for this exit code.
    """
    if code == 0:
        threading._shutdown()  # join non-daemon threads, as interpreter exit does
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    faulthandler.unregister(signal.SIGUSR1)
    faulthandler.disable()
    stack_file.close()
    os._exit(code)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    threads_per_rank: int | None = None,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results.

    ``fn`` and its arguments must be picklable (define ``fn`` at module level). ``backend`` is the
    process group's (``"nccl"`` for one GPU per rank: rank r uses ``cuda:r``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    threads = threads_per_rank or 1  # as torchrun (OMP_NUM_THREADS=1), and as tests/conftest.py
    ctx = mp.get_context(START_METHOD)
    launcher = None if START_METHOD == "spawn" else _LauncherContext(dict(os.environ))
    outdir = tempfile.mkdtemp(prefix="elixir_dist_")
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, args, kwargs, rank, world_size, port, outdir, timeout, threads, backend, launcher),
            name=f"elixir-rank{rank}",
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while True:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                _kill(procs)
                raise DistributedFailure(_failure_message(failed, procs, outdir))
            if all(p.exitcode == 0 for p in procs):
                break
            if time.monotonic() > deadline:
                pending = [r for r, p in enumerate(procs) if p.exitcode is None]
                for r in pending:
                    if procs[r].pid is not None:
                        os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(1.0)  # let faulthandler write the stacks
                _kill(procs)
                stacks = "\n".join(
                    f"--- rank {r} ---\n{_read(os.path.join(outdir, f'stack_{r}.txt')) or '(no stack)'}"
                    for r in pending
                )
                raise DistributedHang(f"ranks {pending} still running after {timeout:.0f}s (hang)\n{stacks}")
            time.sleep(0.05)
        results = []
        for rank in range(world_size):
            with open(os.path.join(outdir, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        _kill(procs)
        shutil.rmtree(outdir, ignore_errors=True)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:  # never started: nothing to join
            p.join(timeout=5)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _failure_message(failed: list[int], procs, outdir: str) -> str:
    parts = []
    for r in failed:
        tb = _read(os.path.join(outdir, f"error_{r}.txt"))
        if not tb:
            stacks = _read(os.path.join(outdir, f"stack_{r}.txt"))
            tb = f"(died without a Python exception; stacks at the fatal signal:)\n{stacks}" if stacks else ""
        parts.append(f"--- rank {r} (exit code {procs[r].exitcode}) ---\n{tb or '(died without a traceback)'}")
    return f"rank(s) {failed} failed:\n" + "\n".join(parts)
