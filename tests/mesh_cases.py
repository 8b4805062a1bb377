"""Shared by the mesh tests (tensor and pipeline parallel): the one-process full-batch reference."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


def sgd_reference(model: nn.Module, batches: list[dict], loss: Callable[[nn.Module, dict], torch.Tensor], lr: float,
                  max_norm: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch on the full batch: SGD with global-norm clipping; the losses and final weights."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        out = loss(model, batch)
        out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
