"""Several independent processes started at once, for the tests that each check one of them.

A process that starts an interpreter, imports torch and runs a few tiny steps spends most of its
time on one core; on the 2-core box, several of them side by side finish in about half the time
they take one after another. A module-scoped fixture calls :func:`run_at_once`, and each test
asserts on its own process's result.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def _finish(p: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        return subprocess.CompletedProcess(p.args, None, out, f"{err}\n(killed after {timeout:.0f} s)")


def run_at_once(commands: dict[str, list[str]], timeout: float = 300.0, cwds: dict[str, Any] | None = None,
                envs: dict[str, dict] | None = None, **popen: Any) -> dict[str, subprocess.CompletedProcess]:
    """Start every command (in ``cwds[name]``, with environment ``envs[name]``, where given), wait
    for all (each read by a thread of its own, so none blocks on a full pipe); per name, the
    finished process with its text output. One still running after ``timeout`` seconds is killed
    and comes back with return code None."""
    procs = {}
    try:
        for name, cmd in commands.items():
            kw = dict(popen, cwd=(cwds or {}).get(name), **({"env": envs[name]} if envs and name in envs else {}))
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        with ThreadPoolExecutor(len(procs)) as pool:
            waits = {name: pool.submit(_finish, p, timeout) for name, p in procs.items()}
            return {name: w.result() for name, w in waits.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
