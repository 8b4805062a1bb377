"""The plugin contract: how one parallel runtime wraps the five objects, steps, and checkpoints.

A :class:`Plugin` is what :class:`~elixir.booster.Booster` delegates to. Each concrete plugin
wraps model and optimizer in its runtime, says how ``backward``, ``no_sync`` and clipping work
there, and how model, optimizer and scheduler are saved and loaded. The dataloader helper is
shared: every plugin here is data parallel over the default process group.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from elixir import distributed as edist


class Plugin:
    """Base class of the Booster plugins (see the module docstring)."""

    name = "plugin"

    # ---- wrapping -------------------------------------------------------------------------------

    def configure(
        self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], criterion: Optional[Callable],
        dataloader: Optional[DataLoader], lr_scheduler: Optional[Any],
    ) -> tuple:
        raise NotImplementedError

    # ---- the loop -------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        loss.backward()

    def no_sync(self, model: nn.Module, optimizer: Any) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def clip_grad_by_norm(self, model: nn.Module, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    # ---- checkpoints ------------------------------------------------------------------------------

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's full state dict on rank 0 (``{}`` elsewhere). Collective."""
        raise NotImplementedError

    def load_full_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], strict: bool) -> None:
        """Load a full state dict present on every rank."""
        raise NotImplementedError

    def save_optimizer(self, optimizer: Any, path: str) -> None:
        raise NotImplementedError

    def load_optimizer(self, optimizer: Any, path: str) -> None:
        raise NotImplementedError

    # ---- data -----------------------------------------------------------------------------------

    def prepare_dataloader(
        self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024, drop_last: bool = False,
        **kwargs: Any,
    ) -> DataLoader:
        """A DataLoader over this rank's share of ``dataset`` (a :class:`DistributedSampler` over the
        default group); other keyword arguments go to the DataLoader. Call ``loader.sampler.set_epoch``
        each epoch when shuffling."""
        sampler = DistributedSampler(
            dataset, num_replicas=edist.get_world_size(), rank=edist.get_rank(), shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


def rank_file(path: str, stem: str, ext: str) -> str:
    """This rank's file in directory ``path``: ``stem-rank00001-of-00002.ext``."""
    return os.path.join(path, f"{stem}-rank{edist.get_rank():05d}-of-{edist.get_world_size():05d}.{ext}")
