"""The plain-torch reference: one process, the full global batch, a fixed seed.

Wrapped runs are compared against this. With ``world_size`` ranks each rank takes an equal slice
of the same global batch (:func:`shard_batch`), so a batch-independent loss gives the same
gradient as the reference up to reduction order.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.testing.zoo import ZooCase, build_model, get_case

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def to_device(batch: dict, device) -> dict:
    """``batch`` with every tensor moved to ``device`` (unchanged when ``device`` is None)."""
    if device is None:
        return batch
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def shard_batch(batch: dict, rank: int, world_size: int) -> dict:
    """This rank's equal slice (dim 0) of every batched tensor; 0-d tensors are shared."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if v.shape[0] % world_size:
                raise ValueError(f"batch dim {v.shape[0]} of {k!r} does not split evenly over {world_size} ranks")
            n = v.shape[0] // world_size
            out[k] = v[rank * n : (rank + 1) * n]
        else:
            out[k] = v
    return out


@dataclass
class ReferenceRun:
    losses: list[float]
    state_dict: dict[str, torch.Tensor]
    first_grads: dict[str, Optional[torch.Tensor]]


def train_reference(
    case: ZooCase | str,
    steps: int = 3,
    batch_size: int = 4,
    optimizer_fn: OptimizerFactory = default_optimizer,
    seed: int = 0,
    model: Optional[nn.Module] = None,
    device=None,
    **build_overrides,
) -> ReferenceRun:
    """Train ``steps`` steps single-process on the full batch; return losses, final state and the
    gradients after the first backward (on the host). With ``device`` the model and batches
    move there first."""
    case = get_case(case) if isinstance(case, str) else case
    model = model if model is not None else build_model(case.name, seed=seed, **build_overrides)
    if device is not None:
        model = model.to(device)
    model.train()
    opt = optimizer_fn([p for p in model.parameters() if p.requires_grad])
    torch.manual_seed(seed + 1)  # dropout RNG stream, same as wrapped runs use
    losses, first_grads = [], {}
    for step in range(steps):
        batch = to_device(case.make_batch(batch_size, step), device)
        opt.zero_grad(set_to_none=True)
        loss = case.loss(model, batch)
        loss.backward()
        if step == 0:
            first_grads = {n: (p.grad.cpu().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return ReferenceRun(losses, state, first_grads)


@dataclass
class WrappedRun:
    losses: list[float]  # global-batch losses (mean over ranks), as the reference reports them
    first_grads: Optional[dict]  # ``model.full_grads()`` after the first backward
    warnings: list[str]


def train_wrapped(
    case: ZooCase | str, model, optimizer, steps: int = 3, batch_size: int = 4, seed: int = 0, device=None,
    first_step: int = 0,
) -> WrappedRun:
    """The wrapped counterpart of :func:`train_reference`: each rank trains on its slice of the same
    global batches, with the same dropout seed; warnings raised while training are collected.
    With ``device`` the batches move there; the gradients come back on the host. ``first_step``:
    continue a run (after a checkpoint load) with the batches from that step on."""
    case = get_case(case) if isinstance(case, str) else case
    rank, world = edist.get_rank(), edist.get_world_size()
    torch.manual_seed(seed + 1)  # dropout RNG stream, as in train_reference
    losses, grads = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(first_step, first_step + steps):
            batch = to_device(shard_batch(case.make_batch(batch_size, step), rank, world), device)
            optimizer.zero_grad()
            loss = case.loss(model, batch)
            loss.backward()
            if step == 0 and getattr(optimizer, "backward_step", None) is None:  # (the fused step consumed them)
                grads = {k: None if g is None else g.cpu() for k, g in model.full_grads().items()}
            optimizer.step()
            t = loss.detach().clone()
            edist.all_reduce(t)
            losses.append(t.item() / world)
    return WrappedRun(losses, grads, sorted({str(w.message)[:80] for w in caught}))
