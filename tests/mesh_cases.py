"""Shared by the mesh tests (tensor and pipeline parallel): the one-process full-batch reference and
the torch DDP run beside it."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from elixir.testing.reference import shard_batch


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


def ddp_reference(model: nn.Module, batches: list[dict], loss: Callable[[nn.Module, dict], torch.Tensor], lr: float,
                  max_norm: float, dp_group, dp_rank: int, dp: int, micro: int = 1) -> dict[str, torch.Tensor]:
    """torch DDP over the dp ranks on each one's slice of every batch, in ``micro`` microbatches
    (gradients accumulated under ``no_sync`` but for the last, each loss divided by ``micro``), SGD
    with global-norm clipping; the final weights. The error every mesh test is held to twice of."""
    ddp = DistributedDataParallel(model, process_group=dp_group)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for batch in batches:
        mine = shard_batch(batch, dp_rank, dp)
        for k in range(micro):
            sync = ddp.no_sync() if k < micro - 1 else contextlib.nullcontext()
            with sync:
                (loss(ddp, shard_batch(mine, k, micro)) / micro).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
