"""Runs under ``torchrun --max-restarts`` with ranks killed on purpose: the restart test and the
soak run of issue 18. A run is launched with a tag in its environment, which every worker
inherits, so its workers are found in ``/proc`` (Linux) by tag, rank and restart generation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from typing import Optional, Sequence

TAG = "ELIXIR_RESTART_TAG"


def torchrun(script: str, args: Sequence[str], nproc: int = 2, max_restarts: int = 0) -> list[str]:
    """The command line that runs ``script args`` on ``nproc`` local ranks under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", script, *args]


class TaggedRun:
    """A torchrun launched with a tag (:meth:`start`), whose workers :meth:`kill` can find."""

    def __init__(self, cmd: Sequence[str], env: Optional[dict] = None, log: Optional[str] = None) -> None:
        self.tag = uuid.uuid4().hex
        self.env = {**os.environ, **(env or {}), TAG: self.tag}
        self.cmd = list(cmd)
        self.log_path = log
        self.proc: Optional[subprocess.Popen] = None
        self.kills: list[tuple[int, int, int]] = []  # (rank, restart generation, pid)

    def start(self) -> TaggedRun:
        out = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        return self

    def workers(self) -> dict[tuple[int, int], int]:
        """``{(restart generation, rank): pid}`` of this run's live workers."""
        found = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if env.get(TAG.encode()) == self.tag.encode() and b"RANK" in env and b"LOCAL_RANK" in env:
                gen = int(env.get(b"TORCHELASTIC_RESTART_COUNT", b"0"))
                found[(gen, int(env[b"RANK"]))] = int(name)
        return found

    def kill(self, rank: int) -> Optional[int]:
        """SIGKILL ``rank``'s worker of the newest generation; its pid, or None if it is not running."""
        live = self.workers()
        if not live:
            return None
        gen = max(g for g, _ in live)
        pid = live.get((gen, rank))
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)
        self.kills.append((rank, gen, pid))
        return pid

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Kill the launcher and its workers if still running (after a test failure)."""
        if self.proc is not None and self.proc.poll() is None:
            for (_, _), pid in self.workers().items():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.proc.kill()
            self.proc.wait()

    def output(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return f.read()
