"""Several tests' multi-rank jobs in one launch of the ranks.

Starting a world of ranks (fresh interpreters importing torch, elixir, often transformers) costs
3-8 s on the 2-core box, more than most jobs it runs. A test module lists its jobs once, a
module-scoped fixture runs every job of one world size in one launch (:func:`run_jobs`), and each
test reads its own job's per-rank results (:func:`result`), so a failure still fails the test that
owns the job and names it.

A job that raises on a rank is recorded with its traceback and the rank stops there (the ranks
could no longer agree on the next collective); the tests of the jobs left unrun say so. A job must
leave no state behind that a later job could see: each builds its own model, optimizer and files.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from elixir.testing import run_distributed


@dataclass(frozen=True)
class Job:
    fn: Callable[..., Any]  # module-level, picklable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def _run_all(jobs: dict[str, Job]) -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    for name, job in jobs.items():
        try:
            out[name] = ("ok", job.fn(*job.args, **job.kwargs))
        except Exception:
            out[name] = ("error", traceback.format_exc())
            break
    return out


def run_jobs(world: int, jobs: dict[str, Job], timeout: float = 600.0, **launch: Any) -> dict[str, list]:
    """Run every job on ``world`` ranks in one launch; return, per job name, the per-rank
    outcomes (``("ok", value)`` or ``("error", traceback)``, missing when not run)."""
    per_rank = run_distributed(_run_all, world, jobs, timeout=timeout, **launch)
    return {name: [r.get(name) for r in per_rank] for name in jobs}


class Launches(dict):
    """World size -> :func:`run_jobs`'s results for ``make_jobs(world)``, launched when first read
    (so a selection of tests that needs one world size never launches the other)."""

    def __init__(self, make_jobs: Callable[[int], dict[str, Job]], **launch: Any) -> None:
        super().__init__()
        self.make_jobs, self.launch = make_jobs, launch

    def __missing__(self, world: int) -> dict[str, list]:
        self[world] = run_jobs(world, self.make_jobs(world), **self.launch)
        return self[world]


def result(results: dict[str, list], name: str) -> list:
    """Job ``name``'s per-rank return values; fails naming the job (and its traceback) if it
    raised or did not run on some rank."""
    outcomes = results[name]
    failed = [n for n, per_rank in results.items() if any(o is not None and o[0] == "error" for o in per_rank)]
    problems = []
    for rank, o in enumerate(outcomes):
        if o is None:
            problems.append(f"rank {rank}: not run (an earlier job in the same launch failed: {failed})")
        elif o[0] == "error":
            problems.append(f"rank {rank} raised:\n{o[1]}")
    assert not problems, f"job {name!r}:\n" + "\n".join(problems)
    return [o[1] for o in outcomes]
