import pytest
import torch

from elixir import distributed as edist
from elixir.optim.loss_scaler import DynamicLossScaler, LossScalePolicy, found_inf_across_ranks
from elixir.testing import run_distributed


def test_backoff_respects_hysteresis_and_min():
    s = DynamicLossScaler(LossScalePolicy(initial_scale=8, min_scale=2, hysteresis=2, growth_interval=3))
    s.update(True)
    assert s.scale == 8  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 4
    s.update(True), s.update(True)
    assert s.scale == 2
    s.update(True), s.update(True)
    assert s.scale == 2  # clamped at min_scale


def test_growth_after_interval_and_max():
    s = DynamicLossScaler(LossScalePolicy(initial_scale=4, max_scale=8, growth_interval=2, hysteresis=1))
    s.update(False)
    assert s.scale == 4
    s.update(False)
    assert s.scale == 8
    s.update(False), s.update(False)
    assert s.scale == 8
    s.update(True)
    assert s.scale == 4


def test_state_round_trip():
    a = DynamicLossScaler(LossScalePolicy(hysteresis=3))
    a.update(True), a.update(False)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()


def test_bad_policy_is_rejected():
    with pytest.raises(ValueError, match="initial_scale"):
        LossScalePolicy(initial_scale=0.5, min_scale=1)


def _overflow_on_rank(bad_rank):
    g = torch.ones(10)
    if edist.get_rank() == bad_rank:
        g[3] = float("inf")
    return found_inf_across_ranks([g, torch.zeros(0)])


@pytest.mark.dist
def test_overflow_on_one_rank_is_seen_by_all():
    assert run_distributed(_overflow_on_rank, 2, 1, timeout=120) == [True, True]
    assert run_distributed(_overflow_on_rank, 2, -1, timeout=120) == [False, False]


def test_nan_counts_single_process():
    assert found_inf_across_ranks([torch.tensor([1.0, float("nan")])])
    assert not found_inf_across_ranks([torch.tensor([1.0, 2.0])])
