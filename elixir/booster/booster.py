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

from elixir import checkpoint as ckpt
from elixir import distributed as edist
from elixir.booster import model_io
from elixir.booster.auto import choose_plugin
from elixir.booster.compat import LOAD, SAVE_MODEL, SAVE_OPTIMIZER, check_compat, note
from elixir.booster.hybrid import PipelineModel
from elixir.booster.plugin import Plugin
from elixir.booster.runtime_plugin import ElixirRuntimePlugin
from elixir.booster.torch_plugins import OptimizerWrapper
from elixir.plan.state_format import check_frozen_format, check_state_formats
from elixir.wrapper import ElixirModule

_MIXED = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _auto_formats(plugin: Union[Plugin, str], master: str, moments: str, frozen: Optional[str],
                  allow_lossy_state: bool) -> dict[str, Any]:
    """The formats ``Booster(plugin="auto", ...)`` plans with, checked now; refused (naming the
    plugin's own arguments) beside a plugin instance, which would not see them."""
    check_state_formats(master, moments, where="Booster")
    check_frozen_format(frozen, where="Booster")
    if not isinstance(allow_lossy_state, bool):
        raise ValueError(f"Booster(allow_lossy_state=...) must be True or False, got {allow_lossy_state!r}")
    formats = {"master": master, "moments": moments, "frozen": frozen, "allow_lossy_state": allow_lossy_state}
    defaults = {"master": "fp32", "moments": "fp32", "frozen": None, "allow_lossy_state": False}
    given = [f"{k}={v!r}" for k, v in formats.items() if v != defaults[k]]
    if given and plugin != "auto":
        raise ValueError(f"Booster({', '.join(given)}) is for plugin='auto'; {type(plugin).__name__} would not see it: "
                         f"give the formats to an elixir plugin instead, GeminiPlugin({', '.join(given)}) (the torch "
                         "plugins keep fp32 state)")
    return formats


class Booster:
    """Wrap model, optimizer, criterion, dataloader and LR scheduler for a plugin, then train,
    clip and checkpoint through it.

    Args:
        plugin: a :class:`~elixir.booster.plugin.Plugin` (TorchDDPPlugin, TorchFSDPPlugin,
            GeminiPlugin/ElixirPlugin, LowLevelZeroPlugin) or ``"auto"``.
        mixed_precision: with ``plugin="auto"``, the compute dtype to plan for (``"fp16"``,
            ``"bf16"``, ``"fp32"``). With GeminiPlugin or LowLevelZeroPlugin it is ignored with a
            note, as in ColossalAI (the plugin's ``precision=`` sets the dtype); with the torch
            plugins it is refused naming their own argument (FSDP2's ``MixedPrecisionPolicy``).
        device: ColossalAI's device argument; the plugins place the model on elixir's default
            device, so another value is ignored with a note (as ColossalAI does for plugins that
            control the device).
        master, moments, frozen, allow_lossy_state: with ``plugin="auto"``, the optimizer-state
            and frozen-weight formats (``MixedPrecisionPolicy``'s fields of these names;
            docs/optimizer.md): the search prices them (``allow_lossy_state``: and may choose leaner
            state formats), the plan records them and the chosen plugin runs them. With a plugin
            instance they are refused: set them on the plugin (``GeminiPlugin(moments="int8")``).

    ColossalAI's positional order ``Booster(device, mixed_precision, plugin)`` is recognised too
    (a device first, a plugin third); ``Booster(plugin)`` takes the plugin.
    """

    def __init__(
        self, plugin: Union[Plugin, str, None] = None, mixed_precision: Optional[str] = None,
        device: Union[str, torch.device, int, None] = None, *, master: str = "fp32", moments: str = "fp32",
        frozen: Optional[str] = None, allow_lossy_state: bool = False,
    ) -> None:
        if (isinstance(device, Plugin) or device == "auto") and not (isinstance(plugin, Plugin) or plugin == "auto"):
            plugin, device = device, plugin  # ColossalAI's positional order: Booster(device, mixed_precision, plugin)
        if mixed_precision is not None and mixed_precision not in _MIXED:
            raise ValueError(f"mixed_precision must be one of {tuple(_MIXED)} or None, got {mixed_precision!r}")
        if isinstance(plugin, str) and plugin != "auto":
            raise ValueError(f"plugin must be a Plugin instance or 'auto', got {plugin!r}")
        if plugin is None:
            raise ValueError("Booster needs plugin= (TorchDDPPlugin(), TorchFSDPPlugin(), GeminiPlugin(...) or 'auto')")
        if device is not None:
            note(f"Booster(device={device!r}) is ignored: the plugin places the model on elixir's default device "
                 "(the current CUDA device, else the CPU)", stacklevel=2)
        if isinstance(plugin, ElixirRuntimePlugin) and mixed_precision is not None:
            note(f"Booster(mixed_precision={mixed_precision!r}) is ignored: {type(plugin).__name__}'s precision= sets "
                 f"the compute dtype (here {plugin.precision!r})", stacklevel=2)
            mixed_precision = None
        if isinstance(plugin, Plugin) and mixed_precision is not None:
            raise ValueError(
                f"Booster(mixed_precision={mixed_precision!r}) with {type(plugin).__name__} is not supported: set the "
                "precision on the plugin (GeminiPlugin(precision=...), TorchFSDPPlugin(mp_policy=MixedPrecisionPolicy(...)))"
            )
        self.formats = _auto_formats(plugin, master, moments, frozen, allow_lossy_state)
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
            choice = choose_plugin(model, self.dtype, formats=self.formats)
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

    def execute_pipeline(self, data_iter: Any, model: nn.Module, criterion: Callable, optimizer: Any = None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict:
        """Forward and backward of one batch from ``data_iter`` through a pipeline
        (:class:`~elixir.booster.HybridParallelPlugin` with ``pp_size > 1``); returns
        ``{"loss": ..., "outputs": ...}``, set on the last stage. Then step the optimizer."""
        plugin = self._plugin()
        run = getattr(plugin, "execute_pipeline", None)
        if run is None:
            raise TypeError(f"{type(plugin).__name__} runs no pipeline: use HybridParallelPlugin(pp_size=...), or train "
                            "with loss = criterion(model(...)), booster.backward(loss, optimizer)")
        return run(data_iter, model, criterion, optimizer, return_loss=return_loss, return_outputs=return_outputs)

    # ---- checkpoints ------------------------------------------------------------------------------

    def save_model(
        self, model: nn.Module, checkpoint: str, shard: bool = True, gather_dtensor: bool = True, prefix: Optional[str] = None,
        size_per_shard: float = 1024, use_safetensors: bool = True, use_async: bool = False,
    ) -> None:
        """The full model. ``shard=True`` (elixir's default): the directory ``checkpoint`` in HF's
        safetensors layout (``model.safetensors``, or shards of at most ``size_per_shard`` MiB
        with an index), written by :func:`elixir.checkpoint.save_pretrained`: for a model on
        elixir's runtime one gathered chunk at a time, files spread over the ranks (no rank holds
        the whole model); on a tensor/pipeline mesh by :func:`elixir.checkpoint.save_pretrained_mesh`
        (each stage its own files, chunks gathered over dp and tensors over tp one at a time); for
        DDP and FSDP2 from the full state dict on rank 0. ``shard=False``
        (ColossalAI's default): the single file ``checkpoint``, safetensors or (``use_safetensors=False``)
        ``torch.save``, written by rank 0 from the gathered state dict. ColossalAI's
        ``gather_dtensor``, ``prefix`` and ``use_async`` are noted and ignored. Collective: every
        rank calls it."""
        check_compat("Booster.save_model", {"gather_dtensor": gather_dtensor, "prefix": prefix, "use_async": use_async},
                     SAVE_MODEL)
        if not shard:
            self._save_model_file(model, checkpoint, use_safetensors)
            return
        if not use_safetensors:
            note("Booster.save_model(shard=True, use_safetensors=False): the shards are written as safetensors "
                 "(Hugging Face's layout, which load_model and from_pretrained read)", stacklevel=2)
        limit = max(1, int(size_per_shard * 2**20))  # bytes
        if isinstance(model, ElixirModule) and model.tensor_parallel is None:
            ckpt.save_pretrained(checkpoint, model, max_shard_size=limit)
            return
        if isinstance(model, (ElixirModule, PipelineModel)):  # on a mesh: each stage writes its own files
            inner = model.pipeline if isinstance(model, PipelineModel) else model
            ckpt.save_pretrained_mesh(checkpoint, inner, _unwrap(model), max_shard_size=limit)
            return
        state = self._plugin().full_state_dict(model)
        error = None
        if edist.get_rank() == 0:
            try:
                ckpt.save_state_dict_pretrained(checkpoint, state, _unwrap(model), max_shard_size=limit)
            except (OSError, ckpt.CheckpointError) as e:
                error = f"save_model({checkpoint!r}) failed: {e}"
        _agree(error)

    def _save_model_file(self, model: nn.Module, path: str, use_safetensors: bool) -> None:
        state = self._plugin().full_state_dict(model)
        error = None
        if edist.get_rank() == 0:
            try:
                model_io.write_file(path, state, use_safetensors)
            except OSError as e:
                error = f"save_model({path!r}) failed: {e}"
        _agree(error)

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1) -> None:
        """Load what :meth:`save_model` (or HF ``save_pretrained``) wrote: a directory (under the
        model's names: transformers' key conversions applied), or a single safetensors or
        ``torch.save`` file. Every rank reads it. ``model`` may be boosted or plain."""
        check_compat("Booster.load_model", {"low_cpu_mem_mode": low_cpu_mem_mode, "num_threads": num_threads}, LOAD)
        state = model_io.fill_tied(model_io.read(checkpoint, _unwrap(model)), _unwrap(model))
        if isinstance(model, (ElixirModule, DistributedDataParallel, PipelineModel)) or self.plugin is None:
            self._plugin().load_full_state_dict(model, state, strict)
        elif any(hasattr(p, "device_mesh") for p in model.parameters()):  # FSDP2's DTensors
            self._plugin().load_full_state_dict(model, state, strict)
        else:  # a model that was never boosted: it is a plain module
            model.load_state_dict(state, strict=strict)

    def save_optimizer(self, optimizer: Any, checkpoint: str, shard: bool = True, gather_dtensor: bool = True,
                       prefix: Optional[str] = None, size_per_shard: int = 1024, use_async: bool = False) -> None:
        """Optimizer state in the directory ``checkpoint``: each rank writes only its own shard
        (replicated state: rank 0 writes it once). ``shard=False`` (ColossalAI's single file) is
        noted: the directory is written all the same, and :meth:`load_optimizer` reads it.
        Collective."""
        check_compat("Booster.save_optimizer", {"gather_dtensor": gather_dtensor, "prefix": prefix,
                                                "size_per_shard": size_per_shard, "use_async": use_async}, SAVE_OPTIMIZER)
        if not shard:
            note(f"Booster.save_optimizer(shard=False): elixir writes one file per rank into the directory "
                 f"{checkpoint!r} (it never gathers the optimizer state); load_optimizer reads it", stacklevel=2)
        self._plugin().save_optimizer(_inner_optimizer(optimizer), checkpoint)
        model_io.barrier()

    def load_optimizer(self, optimizer: Any, checkpoint: str, low_cpu_mem_mode: bool = True, num_threads: int = 1) -> None:
        """Load what :meth:`save_optimizer` wrote, each rank its own shard."""
        check_compat("Booster.load_optimizer", {"low_cpu_mem_mode": low_cpu_mem_mode, "num_threads": num_threads}, LOAD)
        self._plugin().load_optimizer(_inner_optimizer(optimizer), checkpoint)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """``lr_scheduler.state_dict()`` to the file ``checkpoint`` (rank 0)."""
        if edist.get_rank() == 0:
            tmp = checkpoint + ".tmp"
            torch.save(lr_scheduler.state_dict(), tmp)
            os.replace(tmp, checkpoint)
        model_io.barrier()

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        lr_scheduler.load_state_dict(torch.load(checkpoint, weights_only=False))


def _unwrap(model: nn.Module) -> nn.Module:
    if isinstance(model, PipelineModel):
        return model.unwrapped
    if isinstance(model, DistributedDataParallel):
        return model.module
    if isinstance(model, ElixirModule):
        return model.module
    return model


def _inner_optimizer(optimizer: Any) -> Any:
    """The optimizer a torch plugin's :class:`~elixir.booster.torch_plugins.OptimizerWrapper` wraps
    (others as they are)."""
    return optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer


def _agree(error: Optional[str]) -> None:
    """Raise ``error`` (rank 0's) on every rank."""
    if edist.is_initialized() and edist.get_world_size() > 1:
        error = edist.all_gather_object(error)[0]
    if error:
        raise OSError(error)
