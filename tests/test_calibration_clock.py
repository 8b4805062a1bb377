"""The calibration's collective clock (issue 35): an asynchronous collective shows the host its
call and its wait only, so the collectives factor is measured over the gathers' spans, from call
to end of wait, which without prefetch are their whole time."""

import time

import torch

from elixir import distributed as edist
from elixir.profiling.calibrate import _all_reduce_ratio, _collectives_ratio, timed_collectives


class _Work:
    def __init__(self, done_at: float) -> None:
        self.done_at = done_at

    def wait(self) -> bool:
        while time.perf_counter() < self.done_at:  # the transfer finishing in the background
            pass
        return True


def test_an_async_gathers_span_counts_the_time_it_ran_in_the_background(monkeypatch):
    def fake_gather(out, shard, group=None, async_op=False):
        return _Work(time.perf_counter() + 0.03) if async_op else None

    monkeypatch.setattr(edist, "all_gather_into", fake_gather)
    with timed_collectives(torch.device("cpu")) as clock:
        work = edist.all_gather_into(torch.zeros(2), torch.zeros(1), async_op=True)
        time.sleep(0.05)  # compute while it runs: the wait then returns at once
        work.wait()
        edist.all_gather_into(torch.zeros(2), torch.zeros(1))  # a blocking call: its span is its time
    assert clock.calls == 2
    assert clock.span_seconds["all_gather_into"] >= 0.05  # call to end of wait
    assert clock.seconds < 0.02  # calls and waits only: the background time is not seen


def test_the_collectives_factor_compares_gather_spans_with_predicted_gathers():
    meas = {"gather_spans": 0.09, "collectives": 0.05}
    pred = {"all_gather": 0.10, "collectives": 0.20}
    assert abs(_collectives_ratio(meas, pred) - 0.9) < 1e-12
    # no gather seen (world 1, or no sharded chunk): the step's whole collective time, as before
    assert abs(_collectives_ratio({"gather_spans": 0.0, "collectives": 0.05}, pred) - 0.25) < 1e-12
    assert _collectives_ratio({"gather_spans": 0.0, "collectives": 0.0}, {"all_gather": 0.0, "collectives": 0.0}) == 1.0


def test_the_all_reduce_factor_comes_from_the_replicated_run():
    # the replicated run's collective time is its all-reduce: measured over predicted, apart from the gathers'
    assert abs(_all_reduce_ratio({"collectives": 0.024}, {"collectives": 0.019}, fallback=2.0) - 0.024 / 0.019) < 1e-12
    assert _all_reduce_ratio({"collectives": 0.0}, {"collectives": 0.0}, fallback=2.0) == 2.0  # none predicted
