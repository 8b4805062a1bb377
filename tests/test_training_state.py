"""ElixirModule's training state: an explicit enum with checked transitions, observed through a
whole step, including recomputation under activation checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from elixir.chunk.state import IllegalTransition
from elixir.search import minimum_waste_search
from elixir.wrapper import ElixirModule
from elixir.wrapper.backward_tracker import TrainingState


class _Net(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
        self.recompute = recompute
        self.seen: list[TrainingState] = []
        self.owner = None

    def forward(self, x):
        self.seen.append(self.owner.tracker.state)
        h = checkpoint(self._body, x, use_reentrant=False) if self.recompute else self._body(x)
        return self.b(h)

    def _body(self, x):
        self.seen.append(self.owner.tracker.state)
        return torch.relu(self.a(x))


@pytest.mark.parametrize("recompute", [False, True])
def test_state_through_a_step(recompute):
    torch.manual_seed(0)
    net = _Net(recompute)
    em = ElixirModule(net, minimum_waste_search(net, 1))
    net.owner = em
    assert em.tracker.state is TrainingState.IDLE
    out = em(torch.randn(4, 8)).sum()
    assert em.tracker.state is TrainingState.IDLE
    during = []
    out.register_hook(lambda g: during.append(em.tracker.state))
    em.module.a.weight.register_hook(lambda g: during.append(em.tracker.state))
    out.backward()
    assert em.tracker.state is TrainingState.IDLE
    assert TrainingState.BACKWARD in during
    # forward, its body, and (recomputed) the body again during backward
    assert net.seen == [TrainingState.FORWARD] * 2 + ([TrainingState.BACKWARD] if recompute else [])
    assert em.iteration == 1  # the recomputation is no new training forward


def test_a_forward_that_raises_leaves_the_module_idle():
    net = nn.Linear(8, 1)
    em = ElixirModule(net, minimum_waste_search(net, 1))
    with pytest.raises(RuntimeError):
        em(torch.randn(4, 7))  # wrong width
    assert em.tracker.state is TrainingState.IDLE
    em(torch.randn(4, 8)).sum().backward()
    assert em.tracker.state is TrainingState.IDLE


def test_illegal_transitions_raise():
    net = nn.Linear(8, 1)
    em = ElixirModule(net, minimum_waste_search(net, 1))
    with pytest.raises(IllegalTransition, match="IDLE -> FINALIZING"):
        em.tracker.move(TrainingState.FINALIZING)
    em.tracker.move(TrainingState.BACKWARD)
    with pytest.raises(IllegalTransition, match="BACKWARD -> FORWARD"):
        em.tracker.move(TrainingState.FORWARD)
