"""HybridParallelPlugin: ColossalAI's tensor x pipeline x data parallel plugin on torch's engines,
with elixir's chunks as the data-parallel axis.

The ranks form a mesh of ``pp`` x ``dp`` x ``tp`` (pipeline outermost, tensor innermost:
torchtitan's order; :func:`elixir.parallel.pipeline_mesh`). The model is made tensor-parallel
over ``tp`` with torch's DTensor (:func:`elixir.parallel.tensor_parallel`), cut into pipeline
stages by layer and run by torch's pipeline schedules (:class:`elixir.parallel.ElixirPipeline`),
and each stage runs on :class:`~elixir.wrapper.ElixirModule` chunks sharded over ``dp`` with the
``zero_stage``'s chunk kind. With ``pp_size=1`` the model is one ``ElixirModule`` over the
``(dp, tp)`` mesh and trains with ``model(**batch)`` / ``booster.backward``; with ``pp_size > 1``
it trains with ``booster.execute_pipeline``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from elixir import checkpoint
from elixir import distributed as edist
from elixir.booster.compat import ALWAYS, Compat, check_compat, note
from elixir.booster.mesh_wrap import (
    bind_optimizer,
    copy_optimizer,
    device_mesh,
    local_slice,
    parameter_names,
    whole_state,
)
from elixir.booster.plugin import Plugin, nothing
from elixir.booster.runtime_plugin import PRECISIONS, pop_loss_scale
from elixir.parallel import ElixirPipeline, PipelineOptimizer, causal_lm_loss, tensor_parallel
from elixir.plan import MeshLayout, Sharding
from elixir.search import SearchResult, minimum_waste_search
from elixir.wrapper import ElixirModule, ElixirOptimizer

ZERO_STAGES = {0: Sharding.REPLICATED, 1: Sharding.ZERO1, 2: Sharding.ZERO2, 3: Sharding.SHARDED}
"""``zero_stage`` -> the kind of every chunk: 0 replicated (DDP), 1/2 ZeRO-1/2, 3 elixir's ZeRO-3."""

_SHARDFORMER = "Shardformer rewrites are not applied: the model's own modules run (torch's DTensor styles for tp)"
_DDP = "elixir's chunks are the data-parallel engine (each chunk is a reduction bucket), not torch DDP"

# HybridParallelPlugin (ColossalAI 0.5) arguments elixir does not honour one-to-one
HYBRID: dict[str, Compat] = {
    "sp_size": Compat(None, "a separate sequence axis (all_to_all / ring attention) is not supported: leave sp_size unset "
                            "(enable_sequence_parallelism=True splits the sequence over the tp ranks)", refuse=True),
    "enable_fused_normalization": Compat(False, _SHARDFORMER),
    "enable_jit_fused": Compat(False, _SHARDFORMER),
    "parallel_output": Compat(True, "the last stage's logits are gathered over tp (no vocab-parallel loss yet)"),
    "broadcast_buffers": Compat(True, "buffers are broadcast from rank 0 once, when the model is wrapped"),
    "ddp_bucket_cap_mb": Compat(25, _DDP),
    "find_unused_parameters": Compat(ALWAYS),  # elixir finds them at the end of every backward
    "check_reduction": Compat(False, _DDP),
    "gradient_as_bucket_view": Compat(False, _DDP),
    "static_graph": Compat(False, _DDP),
    "zero_bucket_size_in_m": Compat(12, "chunk sizes come from elixir's search (minimum_waste_search); pass plan_fn"),
    "overlap_communication": Compat(ALWAYS),  # each chunk reduces as soon as backward completes it
    "custom_policy": Compat(None, "Shardformer policies are not supported: pass a tensor-parallel plan in torch's "
                                  "format with tp_plan={...} (elixir.parallel.tensor_parallel)", refuse=True),
    "scheduler_nodes": Compat(None, "the zero-bubble schedule is not supported: pp_style='1f1b' or 'interleaved'",
                              refuse=True),
    "gradient_checkpoint_config": Compat(None, "call model.gradient_checkpointing_enable() on the Hugging Face model "
                                               "before boosting", refuse=True),
    "enable_metadata_cache": Compat(ALWAYS),  # stage shapes are fixed per batch shape anyway
    "make_vocab_size_divisible_by": Compat(64, "the vocabulary is not padded: it must divide by tp_size"),
    "dp_outside": Compat(ALWAYS),  # elixir's mesh order is pp, dp, tp (docs/parallel.md)
    "overlap_p2p": Compat(ALWAYS),  # torch's schedules overlap their sends
    "overlap_allgather": Compat(False, "ZeRO-1/2 chunks all-gather their updated slices right after the step"),
    "fp8_communication": Compat(False, "fp8 communication is not supported", refuse=True),
    "use_fp8": Compat(False, "fp8 compute is not supported", refuse=True),
    "inner_ring_size": Compat(None, "ring attention is not supported", refuse=True),
    "enable_all_optimization": Compat(False, "of Shardformer's optimizations elixir applies fused attention "
                                             "(enable_flash_attention=True)"),
}


class StageManager:
    """ColossalAI's ``PipelineStageManager`` questions about this rank's place in the pipeline."""

    def __init__(self, stage: int, num_stages: int) -> None:
        self.stage, self.num_stages = stage, num_stages

    def is_first_stage(self) -> bool:
        return self.stage == 0

    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1


class PipelineModel(nn.Module):
    """The boosted model of a pipeline run: this rank's stage modules (``self.stages``) and the
    :class:`~elixir.parallel.ElixirPipeline` that runs them (``self.pipeline``). Train it with
    ``booster.execute_pipeline``."""

    def __init__(self, pipeline: ElixirPipeline, model: nn.Module) -> None:
        super().__init__()
        self.stages = nn.ModuleList(pipeline.modules)
        self.pipeline = pipeline
        self.__dict__["unwrapped"] = model  # the Hugging Face model (names, config): not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline-parallel model runs a whole batch at once: call booster.execute_pipeline(data_iter, "
                           "model, criterion, optimizer) instead of model(...)")


class HybridParallelPlugin(Plugin):
    """Tensor, pipeline and data parallelism under ColossalAI's argument names (module docstring).

    Args:
        tp_size, pp_size: ranks along the tensor and pipeline axes; the rest is ``dp_size``.
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"``: the compute dtype (fp32 masters).
        zero_stage: 0 (replicated chunks: DDP), 1, 2 (ZeRO-1/2 chunks) or 3 (elixir's ZeRO-3).
        num_microbatches / microbatch_size: microbatches per step, or the rows of one (``pp_size > 1``).
        pp_style: ``"1f1b"`` or ``"interleaved"`` (with ``num_model_chunks`` stages per rank).
        max_norm: clip the global gradient norm over the whole mesh (0: none).
        initial_scale ... max_scale: the fp16 loss scaler (one loss scale, agreed over every stage).
        cpu_offload: fp32 masters and optimizer state in host memory.
        communication_dtype: ``torch.float32`` reduces gradients in fp32 under bf16/fp16.
        enable_flash_attention: switch Hugging Face attention to torch's fused SDPA.
        enable_sequence_parallelism: split the activations between blocks over the tp ranks by
            the sequence (ColossalAI's ``"split_gather"`` mode, torch's ``SequenceParallel``;
            LLaMA-style models, ``pp_size=1``; see :func:`elixir.parallel.tensor_parallel`).
        sequence_parallelism_mode: ``None`` or ``"split_gather"`` (the only mode).
        num_layers_per_stage: decoder layers of each stage (default: an even split).
        tp_plan: a tensor-parallel plan in torch's format (default: elixir's plan for the model).
        plan_fn: ``plan_fn(module, MeshLayout) -> plan`` for each wrapped module (default
            :func:`~elixir.search.minimum_waste_search`; ``zero_stage`` then sets the chunk kind).

    Every other argument of ColossalAI's HybridParallelPlugin is accepted: noted where elixir does
    something else that trains the same model, refused naming the alternative where it cannot
    (:data:`HYBRID`).
    """

    name = "hybrid"

    def __init__(self, tp_size: int, pp_size: int, precision: str = "fp16", zero_stage: int = 0, *,
                 num_microbatches: Optional[int] = None, microbatch_size: Optional[int] = None, max_norm: float = 0.0,
                 cpu_offload: bool = False, communication_dtype: Optional[torch.dtype] = None, pp_style: str = "1f1b",
                 num_model_chunks: int = 1, enable_flash_attention: bool = False,
                 num_layers_per_stage: Optional[list[int]] = None, tp_plan: Optional[dict] = None,
                 plan_fn: Optional[Callable[[nn.Module, MeshLayout], SearchResult]] = None,
                 enable_sequence_parallelism: bool = False, sequence_parallelism_mode: Optional[str] = None,
                 **options: Any) -> None:
        self.loss_scale = pop_loss_scale(options)
        check_compat(type(self).__name__, options, HYBRID)
        self.sequence_parallel = _sequence_parallel(enable_sequence_parallelism, sequence_parallelism_mode, tp_size,
                                                    pp_size, tp_plan)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
        if zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3 (elixir's sharded chunks), got {zero_stage!r}")
        if max_norm < 0:
            raise ValueError(f"max_norm must be >= 0 (0 disables clipping), got {max_norm}")
        if communication_dtype not in (None, torch.float32):
            raise ValueError(f"communication_dtype must be None (the compute dtype) or torch.float32, got {communication_dtype}")
        if pp_size > 1:
            if num_microbatches is None and microbatch_size is None:
                raise ValueError("pp_size > 1 needs num_microbatches or microbatch_size")
            if pp_style not in ("1f1b", "interleaved"):
                raise ValueError(f"pp_style must be '1f1b' or 'interleaved' (zero-bubble 'zbv' is not supported), got {pp_style!r}")
            if (pp_style == "interleaved") != (num_model_chunks > 1):
                raise ValueError("pp_style='interleaved' needs num_model_chunks > 1, and '1f1b' num_model_chunks=1")
        world = edist.get_world_size()
        if tp_size < 1 or pp_size < 1 or world % (tp_size * pp_size):
            raise ValueError(f"the world size ({world}) must divide by tp_size * pp_size ({tp_size} x {pp_size})")
        self.tp_size, self.pp_size, self.dp_size = tp_size, pp_size, world // (tp_size * pp_size)
        self.precision, self.dtype, self.zero_stage = precision, PRECISIONS[precision], zero_stage
        self.num_microbatches, self.microbatch_size = num_microbatches, microbatch_size
        self.max_norm, self.cpu_offload = float(max_norm), cpu_offload
        self.reduce_always_fp32 = communication_dtype == torch.float32
        self.schedule = "interleaved_1f1b" if pp_style == "interleaved" else "1f1b"
        self.num_model_chunks = num_model_chunks
        self.use_fused_kernels = enable_flash_attention
        self.num_layers_per_stage, self.tp_plan, self.plan_fn = num_layers_per_stage, tp_plan, plan_fn
        self.mesh = device_mesh({"pp": pp_size, "dp_shard": self.dp_size, "tp": tp_size})
        self.pp_group = self.mesh["pp"].get_group()
        self.dp_group = self.mesh["dp_shard"].get_group()
        self.tp_group = self.mesh["tp"].get_group()
        self.stage_manager = StageManager(self.mesh.get_local_rank("pp"), pp_size) if pp_size > 1 else None

    # ---- wrapping -------------------------------------------------------------------------------

    def _plan(self, module: nn.Module, layout: MeshLayout) -> SearchResult:
        if self.plan_fn is not None:
            return self.plan_fn(module, layout)
        # a pipeline stage accumulates its microbatches under no_sync, every sharded chunk gathered
        sr = minimum_waste_search(module, layout, unified_dtype=self.dtype, cpu_offload=self.cpu_offload,
                                  accumulation=self.pp_size > 1)
        kind = ZERO_STAGES[self.zero_stage]
        return dataclasses.replace(sr, chunks=tuple(c.with_sharding(kind, sr.world_size) for c in sr.chunks))

    def _module_kwargs(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "reduce_always_fp32": self.reduce_always_fp32,
                "output_fp32": self.dtype != torch.float32, "use_fused_kernels": self.use_fused_kernels}

    def configure(self, model, optimizer, criterion, dataloader, lr_scheduler) -> tuple:
        if isinstance(model, (ElixirModule, PipelineModel)):
            return model, optimizer, criterion, dataloader, lr_scheduler
        names = parameter_names(model)
        if self.pp_size > 1:
            model, optimizer = self._configure_pipeline(model, optimizer, names)
        else:
            if self.tp_size > 1:
                tensor_parallel(model, self.mesh, plan=self.tp_plan, sequence_parallel=self.sequence_parallel)
            sub = self.mesh["dp_shard", "tp"]
            model = ElixirModule(model, self._plan(model, MeshLayout(dp_shard=self.dp_size, tp=self.tp_size)), mesh=sub,
                                 **self._module_kwargs())
            if optimizer is not None:
                optimizer = ElixirOptimizer(model, bind_optimizer(optimizer, names, model), max_norm=self.max_norm,
                                            loss_scale_policy=self.loss_scale)
        return model, optimizer, criterion, dataloader, lr_scheduler

    def _configure_pipeline(self, model: nn.Module, optimizer: Any, names: dict) -> tuple:
        pipe = ElixirPipeline(model, self.mesh, self.num_microbatches, schedule=self.schedule,
                              stages_per_rank=self.num_model_chunks, plan_fn=self._plan, microbatch_size=self.microbatch_size,
                              layers_per_stage=self.num_layers_per_stage, tp_plan=self.tp_plan, **self._module_kwargs())
        if optimizer is not None:
            inner = [optimizer] + [copy_optimizer(optimizer) for _ in pipe.modules[1:]]
            inner = [bind_optimizer(opt, names, em) for opt, em in zip(inner, pipe.modules)]
            optimizer = PipelineOptimizer(pipe, inner, max_norm=self.max_norm, follow_first=True,
                                          loss_scale_policy=self.loss_scale)
        return PipelineModel(pipe, model), optimizer

    # ---- the loop -------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        if self.pp_size > 1:
            raise RuntimeError("with pp_size > 1, booster.execute_pipeline(...) runs forward and backward together")
        optimizer.backward(loss)

    def no_sync(self, model, optimizer):
        if self.pp_size > 1:
            raise RuntimeError("with pp_size > 1 the pipeline accumulates its microbatches itself: raise num_microbatches")
        return model.no_sync() if model is not None else nothing()

    def clip_grad_by_norm(self, model, optimizer, max_norm, norm_type=2.0) -> torch.Tensor:
        return optimizer.clip_grad_norm_(max_norm, norm_type)

    def execute_pipeline(self, data_iter: Iterator, model: PipelineModel, criterion: Callable[[Any, Any], torch.Tensor],
                         optimizer: Any = None, return_loss: bool = True, return_outputs: bool = False) -> dict:
        """One batch (``next(data_iter)``: a dict with ``input_ids``, and whatever ``criterion``
        reads) through the pipeline: forward and backward of every microbatch, gradients reduced
        once. ``criterion(outputs, inputs)`` is called on the last stage per microbatch, with
        ``outputs.logits`` (and ``outputs.loss``, the causal-LM loss, when ``inputs`` has
        ``labels``) and that microbatch's ``inputs``. Returns ``{"loss": mean loss or None,
        "outputs": logits or None}`` (both on the last stage only). Step the optimizer after."""
        if not isinstance(model, PipelineModel):
            raise TypeError("execute_pipeline needs the boosted model of HybridParallelPlugin(pp_size > 1); with pp_size=1 "
                            "train with outputs = model(**batch), booster.backward(loss, optimizer)")
        pipe = model.pipeline
        batch = next(data_iter)
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise ValueError("execute_pipeline reads batches that are dicts with 'input_ids' (as ColossalAI's schedules do)")
        device = pipe.modules[0].device
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        mask = batch.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("pipeline stages apply the causal mask only: pack sequences without padding (an "
                             "attention_mask with zeros cannot cross a stage boundary)")
        rows = torch.arange(batch["input_ids"].shape[0], device=device)
        pipe.loss_fn = _criterion_on_rows(criterion, batch)
        loss = pipe.step(batch["input_ids"], rows, return_outputs=return_outputs)
        return {"loss": loss if return_loss else None, "outputs": pipe.outputs if return_outputs else None}

    # ---- checkpoints ------------------------------------------------------------------------------

    def full_state_dict(self, model) -> dict:
        """The whole model's state dict on rank 0 (``{}`` elsewhere), in the Hugging Face layout:
        each stage's chunks gathered over dp, tensor-parallel shards over tp (GPT-2's fused
        ``c_attn`` back in its own column order), the stages' pieces sent to rank 0. Collective."""
        local: dict[str, torch.Tensor] = {}
        for em in _modules(model):
            local.update(whole_state(em, self.tp_size))
        first = self.mesh.get_local_rank("dp_shard") == 0 and self.mesh.get_local_rank("tp") == 0
        pieces = edist.all_gather_object(local if first else {})
        if edist.get_rank() != 0:
            return {}
        out: dict[str, torch.Tensor] = {}
        for piece in pieces:
            out.update(piece)
        return out

    def load_full_state_dict(self, model, state, strict) -> None:
        """Load a whole model's state dict (on every rank) into this layout: each stage takes its
        names, each tp rank its slice."""
        for em in _modules(model):
            keys = list(em.module.state_dict(keep_vars=True))  # names only: keep_vars reads no payload
            missing = [k for k in keys if k not in state]
            if missing and strict:
                raise KeyError(f"load_model: the checkpoint lacks {missing[:5]} of stage {getattr(em.module, 'index', 0)}")
            em.load_state_dict({k: local_slice(em, k, state[k], self.tp_size) for k in keys if k in state}, strict=strict)

    def save_optimizer(self, optimizer, path) -> None:
        """A mesh checkpoint (:func:`elixir.checkpoint.save_mesh`): every stage module's fp32
        master shards and optimizer state, one part per stage and tp rank (``stage00-tp00``),
        each rank writing its own shard, in one atomic directory. It loads at any other layout
        (tp, pp, dp, world size 1 with :func:`elixir.checkpoint.load`). Collective."""
        checkpoint.save_mesh(path, _owner(optimizer), optimizer)

    def load_optimizer(self, optimizer, path) -> None:
        """Read a checkpoint :meth:`save_optimizer` wrote at any layout into this one. Collective."""
        checkpoint.load_mesh(path, _owner(optimizer), optimizer)

    # ---- data -----------------------------------------------------------------------------------

    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, **kwargs: Any) -> DataLoader:
        """A DataLoader over this rank's data-parallel share of ``dataset``: the ranks of one
        pipeline and tensor group read the same rows."""
        sampler = DistributedSampler(dataset, num_replicas=self.dp_size, rank=self.mesh.get_local_rank("dp_shard"),
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)


def _sequence_parallel(enable: bool, mode: Optional[str], tp_size: int, pp_size: int, tp_plan: Optional[dict]) -> bool:
    """Whether the run splits activations over the sequence (``enable_sequence_parallelism``);
    refuses what elixir cannot do, naming the alternative."""
    if mode not in (None, "split_gather"):
        raise ValueError(f"sequence_parallelism_mode={mode!r} is not supported: elixir's sequence parallelism is "
                         "'split_gather' (torch's SequenceParallel over the tp ranks); pass it or leave it unset")
    if not enable:
        if mode is not None:
            note("HybridParallelPlugin(sequence_parallelism_mode=...) is ignored without enable_sequence_parallelism=True",
                 stacklevel=4)
        return False
    if tp_size == 1:  # ColossalAI drops it too: there is no tp group to split over
        note("HybridParallelPlugin(enable_sequence_parallelism=True) is ignored at tp_size=1 (it splits over tp)", stacklevel=4)
        return False
    if pp_size > 1:
        raise ValueError("enable_sequence_parallelism=True is not supported with pp_size > 1 yet: use pp_size=1 "
                         "(tensor x data parallel), or leave sequence parallelism off")
    if tp_plan is not None:
        raise ValueError("enable_sequence_parallelism=True builds elixir's sequence-parallel plan: with tp_plan={...} put "
                         "SequenceParallel / PrepareModuleInput entries in your plan instead and leave it False")
    return True


def _owner(optimizer: Any) -> Any:
    """The pipeline or module a boosted optimizer steps."""
    return optimizer.pipe if isinstance(optimizer, PipelineOptimizer) else optimizer.module


def _modules(model: nn.Module) -> list[ElixirModule]:
    return list(model.pipeline.modules) if isinstance(model, PipelineModel) else [model]


def _criterion_on_rows(criterion: Callable, batch: dict) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A pipeline loss ``fn(logits, rows)``: the rows of the batch a microbatch holds travel as the
    schedule's target, and ``criterion`` gets ColossalAI's ``(outputs, inputs)``."""
    # optional dependency: transformers (the model outputs ColossalAI's criteria read)
    from transformers.modeling_outputs import CausalLMOutput

    def fn(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        inputs = {k: v[rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
        labels = inputs.get("labels")
        out = CausalLMOutput(logits=logits, loss=causal_lm_loss(logits, labels) if labels is not None else None)
        return criterion(out, inputs)

    return fn
