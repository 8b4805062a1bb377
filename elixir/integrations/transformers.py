"""ElixirTrainer: the Hugging Face ``Trainer`` on elixir's chunked ZeRO-3 runtime.

``ElixirTrainer`` is a drop-in ``transformers.Trainer``: same arguments, plus ``plan=``,
``search=`` and ``placement_policy=`` (see :mod:`elixir.search.placement_policy`). Launch it like
any Trainer script, e.g. ``torchrun --nproc-per-node 2 train.py``.

Why a subclass: the Trainer delegates distribution to accelerate, whose backends form a closed
enum (DDP, FSDP, DeepSpeed, Megatron, XLA) with no plug-in point for a third-party ZeRO runtime.
So ElixirTrainer overrides the few Trainer methods where that choice is made, and leaves the loop
(data sharding, accumulation bookkeeping, logging, callbacks, evaluation, schedulers) to the Trainer:

=====================================  ======================================================================
overridden                             what elixir does there
=====================================  ======================================================================
``_build_accelerator_args``            accelerate runs with ``mixed_precision="no"``: ``bf16``/``fp16`` set
                                       the chunks' compute dtype instead (fp32 masters; fp16 gets elixir's
                                       dynamic loss scaling, agreed across ranks), so no autocast and no
                                       GradScaler run
``_wrap_model``                        plans the model and wraps it in ``ElixirModule``; the optimizer the
                                       Trainer created (``create_optimizer``, any elementwise torch
                                       optimizer) goes into ``ElixirOptimizer``; accelerate sees an already
                                       prepared optimizer, so it neither wraps the model in DDP nor
                                       round-trips the optimizer state
``_clip_grad_norm``, ``_get_grad_norm`` ``max_grad_norm`` clips the global norm over every rank's shards
``save_model``                         an HF-loadable directory (``config.json``, ``model.safetensors`` or
                                       shards plus their index) streamed by
                                       ``elixir.checkpoint.save_pretrained``: each file is written by one
                                       rank from chunks gathered one at a time, so no rank holds the whole
                                       model; a PEFT model's adapters as PEFT writes them
                                       (``adapter_config.json``, ``adapter_model.safetensors``), gathering
                                       only the adapters; the tokenizer and ``training_args.bin`` as the
                                       Trainer saves them. The ``checkpoint-N/`` folders hold the same.
``_load_best_model``                   ``load_best_model_at_end``: the best ``checkpoint-N/elixir/`` (exact
                                       fp32 masters) is loaded into the shards; with ``save_only_model``,
                                       the best folder's HF files (``load_pretrained``; refused at
                                       construction for a PEFT model, whose folder then holds adapters only)
``_save_optimizer_and_scheduler``      ``checkpoint-N/elixir/``: elixir's sharded checkpoint of the fp32
                                       masters, optimizer state and loss scale (atomic, each rank writes its
                                       own shards); the LR scheduler as the Trainer saves it
``_load_from_checkpoint``,             ``resume_from_checkpoint`` restores that checkpoint after wrapping,
``_load_optimizer_and_scheduler``      exactly; a checkpoint of a plain Trainer (weights + ``optimizer.pt``)
                                       loads too
=====================================  ======================================================================

Gradient accumulation needs no override: the Trainer enters ``model.no_sync()`` on the skipped
micro-steps through accelerate, and that is ``ElixirModule.no_sync``. Refused at construction
(with the reason): DeepSpeed and FSDP configs, ``torch_compile``, several GPUs in one process
(``DataParallel``), and optimizers that are not elementwise (LOMO, GaLore, 8-bit).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer

from elixir import checkpoint as echeckpoint
from elixir.checkpoint.errors import agree
from elixir.integrations.options import ElixirOptions
from elixir.search.placement_policy import PlanArg, SearchArg
from elixir.wrapper import ElixirModule, ElixirOptimizer

ELIXIR_DIR = "elixir"  # inside checkpoint-N/
SCHEDULER_NAME = "scheduler.pt"
OPTIMIZER_NAME = "optimizer.pt"
TRAINING_ARGS_NAME = "training_args.bin"  # transformers' name
STAGING_NAME = ".elixir-save_pretrained"  # inside the output directory, while save_model runs


class _TrainerOptimizer(AcceleratedOptimizer):
    """What the Trainer and its LR scheduler hold: the ElixirOptimizer, seen as a prepared torch
    optimizer, reporting fp16 overflow skips so the scheduler does not step on them."""

    _is_accelerate_prepared = True  # accelerate.prepare() registers it as it is

    def __init__(self, optimizer: ElixirOptimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)

    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError("elixir's optimizer step takes no closure")
        if self.gradient_state.sync_gradients:
            self.optimizer.step()
            self._is_overflow = bool(self.optimizer.last_step_skipped)


class ElixirTrainer(Trainer):
    """``transformers.Trainer`` that trains on elixir (see the module docstring for what changes).

    Extra keyword arguments:
        placement_policy: ``"cuda"`` (everything on the compute device), ``"cpu"`` (shards and
            optimizer state in host memory) or ``"auto"`` (``optimal_search``).
        plan: a :class:`~elixir.search.SearchResult` or the path of a plan JSON.
        search: ``"minimum_waste"``, ``"optimal"`` or ``fn(model, world_size, dtype)``.
        prefetch, offload_dir: passed to :class:`~elixir.wrapper.ElixirModule`.
        loss_scale: keyword arguments of ``ElixirOptimizer``'s dynamic loss scale (fp16 only).
        verbose: print the plan on rank 0.
        master, moments: optimizer-state formats (``MixedPrecisionPolicy.master``/``.moments``).
        frozen: the frozen weights' format (``MixedPrecisionPolicy.frozen``: ``"nf4"``, ``"int8"``).
        allow_lossy_state: let ``optimal_search`` choose leaner state formats where these do not
            fit (``MixedPrecisionPolicy.allow_lossy_state``; ``placement_policy="auto"`` or ``search="optimal"``).
    """

    def __init__(
        self,
        *args: Any,
        placement_policy: str = "cuda",
        plan: PlanArg = None,
        search: SearchArg = None,
        prefetch: bool = False,
        offload_dir: Optional[str] = None,
        loss_scale: Optional[dict[str, float]] = None,
        verbose: bool = False,
        master: str = "fp32",
        moments: str = "fp32",
        frozen: Optional[str] = None,
        allow_lossy_state: bool = False,
        **kwargs: Any,
    ) -> None:
        self.options = ElixirOptions(placement_policy, plan, search, prefetch, offload_dir, loss_scale or {}, verbose,
                                     master, moments, frozen, allow_lossy_state)
        self.elixir_module: Optional[ElixirModule] = None
        self.elixir_optimizer: Optional[ElixirOptimizer] = None
        super().__init__(*args, **kwargs)
        _check_supported(self.args, self.model)

    @property
    def elixir_dtype(self) -> torch.dtype:
        """The chunks' compute dtype: ``bf16=True`` -> bfloat16, ``fp16=True`` -> float16, else float32."""
        if self.args.bf16:
            return torch.bfloat16
        if self.args.fp16:
            return torch.float16
        return torch.float32

    # ---- accelerate: no autocast, no GradScaler ---------------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # the chunks compute in bf16/fp16 themselves
        return args

    # ---- wrapping ---------------------------------------------------------------------------------

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader=None) -> torch.nn.Module:
        if self.elixir_module is not None:
            return self.elixir_module  # evaluation after (or during) training runs on the shards
        if not training:
            return model  # evaluation before any training: the plain model is still whole
        if self.optimizer is None:
            self.create_optimizer()
        world = max(1, self.args.world_size)
        plan = self.options.make_plan(self.model, world, self.elixir_dtype, self.args.process_index == 0,
                                      accumulation=self.args.gradient_accumulation_steps > 1)
        self.elixir_module = self.options.wrap(self.model, plan, self.elixir_dtype, self.elixir_dtype != torch.float32)
        inner = self.optimizer.optimizer if isinstance(self.optimizer, AcceleratedOptimizer) else self.optimizer
        self.elixir_optimizer = self.options.wrap_optimizer(self.elixir_module, inner)
        self.optimizer = _TrainerOptimizer(self.elixir_optimizer)
        return self.elixir_module

    # ---- clipping ---------------------------------------------------------------------------------

    def _clip_grad_norm(self, model):
        return self.elixir_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.elixir_optimizer.clip_grad_norm_(float("inf"))  # the norm; clips nothing
        return grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm

    # ---- saving -----------------------------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """An HF-loadable directory (``from_pretrained`` reads it). Collective: every rank calls it,
        as the Trainer does."""
        if self.elixir_module is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        _save_pretrained_into(output_dir, self.elixir_module)
        if self.args.should_save:  # what Trainer._save writes besides the weights
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights into the shards (the plain
        Trainer would write into the wrapped model's parameters, views of released chunks)."""
        if self.elixir_module is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        elixir_dir = os.path.join(best, ELIXIR_DIR)
        if os.path.isdir(elixir_dir):
            echeckpoint.load(elixir_dir, self.elixir_module)  # the exact fp32 masters, no optimizer state
        else:  # save_only_model: the HF files of a full model (a PEFT model is refused at construction)
            echeckpoint.load_pretrained(best, self.elixir_module)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        echeckpoint.save(os.path.join(output_dir, ELIXIR_DIR), self.elixir_module, self.elixir_optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ---- resuming ---------------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, ELIXIR_DIR)):
            return  # restored exactly after wrapping, in _load_optimizer_and_scheduler
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # a plain Trainer's weights

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        elixir_dir = os.path.join(checkpoint, ELIXIR_DIR)
        if os.path.isdir(elixir_dir):
            echeckpoint.load(elixir_dir, self.elixir_module, self.elixir_optimizer)
        elif os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):  # a plain Trainer's full state
            state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
            self.elixir_optimizer.load_state_dict(state)
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))


def _save_pretrained_into(output_dir: str, em: ElixirModule) -> None:
    """Stream ``em`` as HF model files into ``output_dir``, keeping whatever else it holds
    (``checkpoint-N/`` folders, the tokenizer). Collective.

    ``save_pretrained`` commits a whole directory, so it writes a staging folder inside
    ``output_dir``; rank 0 then moves the files up one by one (each ``os.replace`` is atomic) and
    removes weight files of an earlier save that the new one does not have (another shard count),
    as transformers' ``save_pretrained`` does."""
    staging = os.path.join(output_dir, STAGING_NAME)
    echeckpoint.save_pretrained(staging, em)
    error = None
    if em.rank == 0:
        try:
            new = set(os.listdir(staging))
            for name in os.listdir(output_dir):
                if name not in new and _is_weight_file(name):
                    os.remove(os.path.join(output_dir, name))
            for name in sorted(new):
                os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
            os.rmdir(staging)
        except OSError as e:
            error = f"moving the saved model files from {staging} into {output_dir} failed: {e}"
    agree(em.group, em.world_size, error)


def _is_weight_file(name: str) -> bool:
    return name.startswith(("model", "adapter_model")) and (name.endswith(".safetensors") or name.endswith(".safetensors.index.json"))


def _check_supported(args, model) -> None:
    """Refuse what elixir does not run, with the reason (identical on every rank)."""
    if args.load_best_model_at_end and args.save_only_model and hasattr(model, "peft_config"):
        raise ValueError(
            "ElixirTrainer restores the best checkpoint of a PEFT model from checkpoint-N/elixir/, which "
            "save_only_model=True does not write; set save_only_model=False, or load_best_model_at_end=False and "
            "load the best adapter yourself with PeftModel.from_pretrained(base, best_checkpoint)"
        )
    if args.deepspeed:
        raise ValueError("ElixirTrainer replaces DeepSpeed; remove the deepspeed config from TrainingArguments")
    if args.fsdp:
        raise ValueError("ElixirTrainer replaces FSDP; remove fsdp from TrainingArguments")
    if args.torch_compile:
        raise ValueError("ElixirTrainer does not support torch_compile (its hooks gather chunks per module call)")
    if args.n_gpu > 1:
        raise ValueError("ElixirTrainer runs one device per process; launch with torchrun instead of DataParallel")
    optim = str(getattr(args.optim, "value", args.optim)).lower()
    if any(tag in optim for tag in ("lomo", "galore", "8bit", "4bit", "apollo")):
        raise ValueError(
            f"optim={optim!r} is not an elementwise optimizer, so it cannot step on shards; use e.g. adamw_torch"
        )


__all__ = ["ElixirTrainer"]
