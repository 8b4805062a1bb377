"""The torch plugins: DDP, and FSDP2 (``fully_shard`` per block plus the root)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from elixir import distributed as edist
from elixir.booster.plugin import Plugin, rank_file


def _save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a reader never sees half a file


class OptimizerWrapper:
    """ColossalAI's ``OptimizerWrapper`` for the torch plugins: the boosted optimizer, with
    ``backward``, ``clip_grad_by_norm`` and ``clip_grad_by_value`` beside the wrapped optimizer's
    own methods (``step``, ``zero_grad``, ``param_groups``, ``state_dict`` ... pass through).
    :meth:`unwrap` returns the torch optimizer (an LR scheduler built on it before ``boost`` stays
    valid)."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optim"], name)

    @property
    def param_groups(self) -> list:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self.optim.zero_grad(*args, **kwargs)

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optim.load_state_dict(state)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients' global norm to ``max_norm``; return the norm (before clipping)."""
        params = [p for g in self.optim.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_grad_by_value(self, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_([p for g in self.optim.param_groups for p in g["params"]], clip_value)

    def unwrap(self) -> torch.optim.Optimizer:
        return self.optim


def _wrap_optimizer(optimizer: Any) -> Any:
    if optimizer is None or isinstance(optimizer, OptimizerWrapper):
        return optimizer
    return OptimizerWrapper(optimizer)


class TorchDDPPlugin(Plugin):
    """``torch.nn.parallel.DistributedDataParallel`` over the default group; keyword arguments go
    to DDP (``broadcast_buffers``, ``bucket_cap_mb``, ``find_unused_parameters``, ...).

    Optimizer state is the same on every rank: rank 0 writes it, every rank reads it."""

    name = "torch_ddp"

    def __init__(self, **ddp_kwargs: Any) -> None:
        self.ddp_kwargs = ddp_kwargs

    def configure(self, model, optimizer, criterion, dataloader, lr_scheduler) -> tuple:
        if not isinstance(model, DistributedDataParallel):
            model = DistributedDataParallel(model, **self.ddp_kwargs)
        return model, _wrap_optimizer(optimizer), criterion, dataloader, lr_scheduler

    def no_sync(self, model, optimizer) -> contextlib.AbstractContextManager:
        return model.no_sync()

    def full_state_dict(self, model) -> dict:
        return model.module.state_dict() if edist.get_rank() == 0 else {}

    def load_full_state_dict(self, model, state, strict) -> None:
        model.module.load_state_dict(state, strict=strict)

    def save_optimizer(self, optimizer, path) -> None:
        if edist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            _save(optimizer.state_dict(), os.path.join(path, "optimizer.pt"))

    def load_optimizer(self, optimizer, path) -> None:
        optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))


class TorchFSDPPlugin(Plugin):
    """FSDP2: ``fully_shard`` on every block, then on the root.

    Args:
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, passed through.
        offload_policy: a ``CPUOffloadPolicy`` (or ``OffloadPolicy``), passed through.
        block_types: module classes that are blocks; default: the children of every
            ``nn.ModuleList`` (the layers of a transformer).
        reshard_after_forward: passed through (ZeRO-3 when True, ZeRO-2-like when False).

    The optimizer is built on the model's parameters before :meth:`Booster.boost`, as for every
    plugin; ``fully_shard`` registers new (DTensor) parameters, and ``boost`` points the
    optimizer's groups at them (same object, so an LR scheduler on it stays valid). Each rank
    writes and reads only its own optimizer shard.
    """

    name = "torch_fsdp"

    def __init__(
        self, mp_policy: Any = None, offload_policy: Any = None, block_types: Optional[tuple] = None,
        reshard_after_forward: bool = True,
    ) -> None:
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.block_types = block_types
        self.reshard_after_forward = reshard_after_forward

    def _blocks(self, model: nn.Module) -> list[nn.Module]:
        if self.block_types is not None:
            return [m for m in model.modules() if isinstance(m, self.block_types)]
        return [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]

    def configure(self, model, optimizer, criterion, dataloader, lr_scheduler) -> tuple:

        kw: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        if self.mp_policy is not None:
            kw["mp_policy"] = self.mp_policy
        if self.offload_policy is not None:
            kw["offload_policy"] = self.offload_policy
        name_of = {id(p): n for n, p in model.named_parameters()}
        if optimizer is not None:
            if any(id(p) not in name_of for g in optimizer.param_groups for p in g["params"]):
                raise ValueError("the optimizer holds parameters that are not the model's; build it on model.parameters()")
            if any(len(s) for s in optimizer.state.values()):
                raise ValueError("boost the model before the optimizer's first step (FSDP2 replaces the parameters)")
        for block in self._blocks(model):
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        if optimizer is not None:  # fully_shard registered new (sharded) parameters: point the groups at them
            new = dict(model.named_parameters())
            for g in optimizer.param_groups:
                g["params"] = [new[name_of[id(p)]] for p in g["params"]]
        return model, _wrap_optimizer(optimizer), criterion, dataloader, lr_scheduler

    def no_sync(self, model, optimizer) -> contextlib.AbstractContextManager:
        @contextlib.contextmanager
        def ctx():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return ctx()

    def clip_grad_by_norm(self, model, optimizer, max_norm, norm_type=2.0) -> torch.Tensor:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_state_dict(self, model) -> dict:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if edist.get_rank() == 0 else {}

    def load_full_state_dict(self, model, state, strict) -> None:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))

    def save_optimizer(self, optimizer, path) -> None:
        os.makedirs(path, exist_ok=True)  # every rank: the directory may be on a node-local disk
        _save(_local(optimizer.state_dict()), rank_file(path, "optimizer", "pt"))

    def load_optimizer(self, optimizer, path) -> None:
        local = torch.load(rank_file(path, "optimizer", "pt"), weights_only=True)
        optimizer.load_state_dict(_like(optimizer, local))


def _local(sd: dict) -> dict:
    """An optimizer state dict with every DTensor replaced by this rank's local shard."""
    out = dict(sd)
    out["state"] = {k: {n: (v.to_local().clone() if hasattr(v, "to_local") else v) for n, v in st.items()} for k, st in sd["state"].items()}
    return out


def _like(optimizer: torch.optim.Optimizer, local: dict) -> dict:
    """``local`` (from :func:`_local`) with each parameter-shaped shard wrapped back into a DTensor
    laid out like its parameter (``step`` and other scalars stay as they are)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = dict(local)
    state = {}
    for k, st in local["state"].items():
        p = params[int(k)]
        state[k] = {}
        for n, v in st.items():
            if hasattr(p, "to_local") and isinstance(v, torch.Tensor) and v.shape == p.to_local().shape and v.dim() > 0:
                v = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            state[k][n] = v
    out["state"] = state
    return out
