"""Booster: ColossalAI's training-loop API over elixir's plugins.

    booster = Booster(plugin=GeminiPlugin(placement_policy="static", offload_optim_frac=1.0, precision="bf16"))
    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(model, optimizer, criterion, dataloader, lr_scheduler)
    ...
    booster.backward(loss, optimizer)
    optimizer.step()

``plugin="auto"`` lets the search choose (:mod:`elixir.booster.auto`); the reason is printed on
rank 0 and kept in :attr:`Booster.reason`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from elixir import checkpoint
from elixir import distributed as edist
from elixir.booster import model_io
from elixir.booster.auto import choose_plugin
from elixir.booster.plugin import Plugin
from elixir.wrapper import ElixirModule

_MIXED = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class Booster:
    """Wrap model, optimizer, criterion, dataloader and LR scheduler for a plugin, then train,
    clip and checkpoint through it.

    Args:
        plugin: a :class:`~elixir.booster.plugin.Plugin` (TorchDDPPlugin, TorchFSDPPlugin,
            GeminiPlugin/ElixirPlugin, LowLevelZeroPlugin) or ``"auto"``.
        mixed_precision: with ``plugin="auto"``, the compute dtype to plan for (``"fp16"``,
            ``"bf16"``, ``"fp32"``). With a given plugin it must be None: Gemini takes
            ``precision=``, FSDP2 a ``MixedPrecisionPolicy`` (DDP runs in the model's dtype).
    """

    def __init__(self, plugin: Union[Plugin, str, None] = None, mixed_precision: Optional[str] = None) -> None:
        if mixed_precision is not None and mixed_precision not in _MIXED:
            raise ValueError(f"mixed_precision must be one of {tuple(_MIXED)} or None, got {mixed_precision!r}")
        if isinstance(plugin, str) and plugin != "auto":
            raise ValueError(f"plugin must be a Plugin instance or 'auto', got {plugin!r}")
        if plugin is None:
            raise ValueError("Booster needs plugin= (TorchDDPPlugin(), TorchFSDPPlugin(), GeminiPlugin(...) or 'auto')")
        if isinstance(plugin, Plugin) and mixed_precision is not None:
            raise ValueError(
                f"Booster(mixed_precision={mixed_precision!r}) with {type(plugin).__name__} is not supported: set the "
                "precision on the plugin (GeminiPlugin(precision=...), TorchFSDPPlugin(mp_policy=MixedPrecisionPolicy(...)))"
            )
        self.plugin: Optional[Plugin] = plugin if isinstance(plugin, Plugin) else None
        self.auto = plugin == "auto"
        self.dtype = _MIXED.get(mixed_precision or "fp32")
        self.reason: Optional[str] = None

    # ---- wrapping ---------------------------------------------------------------------------------

    def boost(
        self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, criterion: Optional[Callable] = None,
        dataloader: Any = None, lr_scheduler: Any = None,
    ) -> tuple:
        """Return ``(model, optimizer, criterion, dataloader, lr_scheduler)`` wrapped for the plugin.
        Build the optimizer (and scheduler) on the unwrapped model's parameters first."""
        if self.plugin is None:
            choice = choose_plugin(model, self.dtype)
            self.plugin, self.reason = choice.plugin, choice.reason
            if edist.get_rank() == 0:
                print(f"Booster(plugin='auto'): {type(self.plugin).__name__}: {self.reason}")
        return self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler)

    def _plugin(self) -> Plugin:
        if self.plugin is None:
            raise RuntimeError("call Booster.boost(...) first (plugin='auto' is chosen there)")
        return self.plugin

    # ---- the loop -------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        self._plugin().backward(loss, optimizer)

    def no_sync(self, model: nn.Module = None, optimizer: Any = None) -> contextlib.AbstractContextManager:
        """Accumulate gradients without reducing them (the next backward outside reduces)."""
        return self._plugin().no_sync(model, optimizer)

    def clip_grad_by_norm(self, model: nn.Module, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm; return it. Collective."""
        return self._plugin().clip_grad_by_norm(model, optimizer, max_norm, norm_type)

    # ---- checkpoints ------------------------------------------------------------------------------

    def save_model(self, model: nn.Module, path: str, shard: bool = True, size_per_shard: float = 1024, use_safetensors: bool = True) -> None:
        """The full model in HF's safetensors layout in the directory ``path`` (shards of at most
        ``size_per_shard`` MiB with an index when ``shard``), written by
        :func:`elixir.checkpoint.save_pretrained`: for a model on elixir's runtime one gathered
        chunk at a time, files spread over the ranks (no rank holds the whole model); for DDP and
        FSDP2 from the full state dict on rank 0. Collective: every rank calls it."""
        if not use_safetensors:
            raise ValueError("save_model writes safetensors only; use_safetensors=False is not supported")
        limit = max(1, int(size_per_shard * 2**20)) if shard else 2**62  # bytes
        if isinstance(model, ElixirModule):
            checkpoint.save_pretrained(path, model, max_shard_size=limit)
            return
        state = self._plugin().full_state_dict(model)
        error = None
        if edist.get_rank() == 0:
            try:
                checkpoint.save_state_dict_pretrained(path, state, _unwrap(model), max_shard_size=limit)
            except (OSError, checkpoint.CheckpointError) as e:
                error = f"save_model({path!r}) failed: {e}"
        _agree(error)

    def load_model(self, model: nn.Module, path: str, strict: bool = True) -> None:
        """Load what :meth:`save_model` (or HF ``save_pretrained``) wrote, under the model's names
        (transformers' key conversions applied: ``checkpoint.read_pretrained``). Every rank reads it."""
        state = model_io.fill_tied(checkpoint.read_pretrained(path, _unwrap(model)), _unwrap(model))
        self._plugin().load_full_state_dict(model, state, strict)

    def save_optimizer(self, optimizer: Any, path: str, shard: bool = True) -> None:
        """Optimizer state in the directory ``path``: each rank writes only its own shard
        (replicated state: rank 0 writes it once). Collective."""
        if not shard:
            raise ValueError("save_optimizer writes one shard per rank; shard=False is not supported")
        self._plugin().save_optimizer(optimizer, path)
        model_io.barrier()

    def load_optimizer(self, optimizer: Any, path: str) -> None:
        """Load what :meth:`save_optimizer` wrote, each rank its own shard."""
        self._plugin().load_optimizer(optimizer, path)

    def save_lr_scheduler(self, lr_scheduler: Any, path: str) -> None:
        """``lr_scheduler.state_dict()`` to the file ``path`` (rank 0)."""
        if edist.get_rank() == 0:
            tmp = path + ".tmp"
            torch.save(lr_scheduler.state_dict(), tmp)
            os.replace(tmp, path)
        model_io.barrier()

    def load_lr_scheduler(self, lr_scheduler: Any, path: str) -> None:
        lr_scheduler.load_state_dict(torch.load(path, weights_only=False))


def _unwrap(model: nn.Module) -> nn.Module:
    if isinstance(model, DistributedDataParallel):
        return model.module
    if isinstance(model, ElixirModule):
        return model.module
    return model


def _agree(error: Optional[str]) -> None:
    """Raise ``error`` (rank 0's) on every rank."""
    if edist.is_initialized() and edist.get_world_size() > 1:
        error = edist.all_gather_object(error)[0]
    if error:
        raise OSError(error)
