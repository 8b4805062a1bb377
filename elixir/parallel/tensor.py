"""Tensor parallelism on torch's DTensor engine: plans for the model families users fine-tune.

:func:`tensor_parallel` applies torch's ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` (and ``SequenceParallel`` where a plan asks for it) over the ``tp`` dimension
of a ``DeviceMesh``, then re-ties the weights the model tied (``parallelize_module`` silently
unties them: each module's parameter is replaced by its own DTensor). The model can then be wrapped
by ``ElixirModule(model, plan, mesh=mesh)``: its chunks hold each rank's local shards
(:mod:`elixir.wrapper.dtensor_params`).

Plans (:func:`plan_for`):

- a Hugging Face model with its own ``base_model_tp_plan`` / ``_tp_plan`` (LLaMA, Mistral, Qwen2,
  Qwen3, ...): that plan, its style names translated to torch's styles (:data:`HF_STYLES`);
- GPT-2 (``Conv1D`` layers, a fused query/key/value projection), OPT and BERT: elixir's plans
  below. GPT-2's fused ``c_attn`` has its columns reordered before sharding so that each rank's
  slice holds its own heads' queries, keys and values (:func:`qkv_to_tp_order`; a full state dict
  of a parallelised GPT-2 is in that order: :func:`qkv_from_tp_order` undoes it);
- where the input and output embeddings are tied, both are sharded over the vocabulary (a
  vocab-parallel embedding and a column-parallel head, ``Shard(0)`` both), so the tie holds.

Any other model is refused with a message naming how to pass a plan: ``tensor_parallel(model,
mesh, plan={"layers.*.fc1": ColwiseParallel(), ...})`` (torch's own plan format).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from elixir import distributed as edist
from elixir.parallel.conv1d import Conv1DColwise, Conv1DRowwise
from elixir.plan.tensor_plans import (
    NoTensorParallelPlan,
    hf_style_plan,
    how_to_pass,
    loss_parallel_plan,
    pattern,
    sequence_parallel_plan,
    style_plan,
)

# A style that only all-reduces a replicated parameter's gradient over tp (Qwen3's q_norm/k_norm act
# on each rank's own heads): kept plain and given a gradient hook (see _grad_allreduce).
GRAD_ALLREDUCE = "replicated_with_grad_allreduce"


def _styles() -> dict[str, Any]:
    """Style names (:mod:`elixir.plan.tensor_plans`) -> torch's parallel styles."""
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel(),
        # sequence parallelism (plan/tensor_plans.sequence_parallel_plan): the residual stream stays a
        # Shard(1) DTensor (use_local_output=False) so the model sees the global sequence length
        "embedding_rowwise_seq": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "rowwise_seq": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "gather_seq_input": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
        "gather_seq_hidden_states": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                       use_local_output=True),
        "colwise_seq_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        # loss parallelism: logits stay a DTensor split over the vocabulary (vocab_parallel_lm_loss)
        "colwise_seq_head_vocab": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        "colwise_vocab": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        "conv1d_colwise": Conv1DColwise(),
        "conv1d_rowwise": Conv1DRowwise(),
        GRAD_ALLREDUCE: GRAD_ALLREDUCE,
    }


# elixir's own style names (its GPT-2, sequence- and loss-parallel plans), not Hugging Face's
_ELIXIR_STYLES = ("conv1d_colwise", "conv1d_rowwise", "embedding_rowwise_seq", "rowwise_seq", "gather_seq_input",
                  "gather_seq_hidden_states", "colwise_seq_head", "colwise_seq_head_vocab", "colwise_vocab")
HF_STYLES = tuple(k for k in _styles() if k not in _ELIXIR_STYLES)
"""The Hugging Face ``tp_plan`` style names elixir translates to torch's parallel styles."""


def _translate(model: nn.Module, plan: dict[str, str]) -> dict[str, Any]:
    styles = _styles()
    out: dict[str, Any] = {}
    for key, name in plan.items():
        if name not in styles:
            raise NoTensorParallelPlan(
                f"{type(model).__name__}'s own tensor-parallel plan uses the style {name!r} (for {key}), which elixir "
                f"does not translate to torch's styles (it does: {', '.join(HF_STYLES)}); {how_to_pass()}"
            )
        out[key] = styles[name]
    return out


def hf_plan(model: nn.Module) -> Optional[dict[str, Any]]:
    """The model's own Hugging Face tensor-parallel plan in torch's styles, or None without one.
    A style elixir does not translate raises, naming the ones it does."""
    plan = hf_style_plan(model)
    return None if plan is None else _translate(model, plan)


# per-module attributes that count heads or widths of one rank, divided by tp after sharding
_ATTRS = {
    "gpt2": {"attn": ("num_heads", "split_size", "embed_dim")},
    "opt": {"self_attn": ("num_heads", "embed_dim")},
    "bert": {"attention.self": ("num_attention_heads", "all_head_size")},
}


def plan_for(model: nn.Module, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, Any]:
    """The tensor-parallel plan elixir applies to ``model`` (:func:`elixir.plan.tensor_plans.style_plan`,
    or :func:`~elixir.plan.tensor_plans.sequence_parallel_plan` with ``sequence_parallel``; with
    ``loss_parallel`` the head's logits stay split over the vocabulary) in torch's styles; raises
    :class:`NoTensorParallelPlan` naming how to pass one when it has none."""
    if sequence_parallel:
        return _translate(model, sequence_parallel_plan(model, loss_parallel))
    plan = style_plan(model)
    return _translate(model, loss_parallel_plan(plan) if loss_parallel else plan)


def _check_divisible(model: nn.Module, tp: int) -> None:
    cfg = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads", "n_head", "intermediate_size", "ffn_dim", "n_inner"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks needs {attr} ({v}) to divide by {tp}")


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, attr))
    return [h for h in holders.values() if len(h) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Make every holder of a tied group hold the first holder's (parallelised) parameter again."""
    for group in groups:
        m0, a0 = group[0]
        keep = m0._parameters[a0]
        for m, a in group[1:]:
            p = m._parameters[a]
            if type(p) is not type(keep) or getattr(p, "placements", None) != getattr(keep, "placements", None):
                raise ValueError(
                    f"tied parameter {a0} is parallelised differently in two modules ({getattr(keep, 'placements', 'plain')} "
                    f"vs {getattr(p, 'placements', 'plain')}): give both the same placement in the plan, or untie them"
                )
            m._parameters[a] = keep


def _grad_allreduce(model: nn.Module, pattern: str, tp_mesh: Any) -> None:
    """Parameters of the modules matching ``pattern`` stay plain and replicated; their gradient is
    summed over tp before it accumulates (each rank's contribution comes from its own heads)."""
    group = tp_mesh.get_group()

    def summed(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        edist.all_reduce(g, group)
        return g

    rx = pattern(pattern)
    for name, m in model.named_modules():
        if rx.fullmatch(name):
            for p in m.parameters(recurse=False):
                p.register_hook(summed)


def _adjust_attributes(model: nn.Module, attrs: dict[str, tuple[str, ...]], tp: int) -> None:
    for name, m in model.named_modules():
        for suffix, names in attrs.items():
            if name == suffix or name.endswith("." + suffix):
                for a in names:
                    if isinstance(getattr(m, a, None), int):
                        setattr(m, a, getattr(m, a) // tp)


def _tp_dim(mesh: Any) -> Any:
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        return mesh
    for n in ("tp", "tensor"):
        if n in names:
            return mesh[n]
    raise ValueError(f"tensor_parallel needs a 1-D mesh or a DeviceMesh with a 'tp' dimension, got dimensions {names}")


def tensor_parallel(model: nn.Module, mesh: Any, plan: Optional[dict[str, Any]] = None,
                    sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    """Parallelise ``model`` over the ``tp`` dimension of ``mesh`` (a ``DeviceMesh``: 1-D, or
    named with a ``tp`` dimension) with ``plan`` (torch's format: module path with ``*`` wildcards ->
    ``ParallelStyle``; default :func:`plan_for` with ``sequence_parallel`` / ``loss_parallel``: the
    activations between blocks split over the sequence; the logits left split over the vocabulary,
    for :func:`causal_lm_loss`). Every rank must pass the same model (same values: rank 0 of each
    tp group's are scattered). Returns the model, parallelised in place, with tied weights tied
    again. Collective over the tp group."""
    tp_mesh = _tp_dim(mesh)
    tp = tp_mesh.size()
    own_attrs: dict[str, tuple[str, ...]] = {}
    if plan is None:
        plan = plan_for(model, sequence_parallel, loss_parallel)
        own_attrs = _ATTRS.get(getattr(getattr(model, "config", None), "model_type", None), {})
        _check_divisible(model, tp)
    if tp == 1:
        return model
    tied = _tied_groups(model)
    styles = {k: v for k, v in plan.items() if isinstance(v, ParallelStyle)}
    for key, v in plan.items():
        if v == GRAD_ALLREDUCE:
            _grad_allreduce(model, key, tp_mesh)
        elif not isinstance(v, ParallelStyle):
            raise TypeError(f"plan entry {key!r}: {v!r} is not a torch ParallelStyle; {how_to_pass()}")
    for name, m in model.named_modules():
        if name.endswith("attn.c_attn") and any(isinstance(s, Conv1DColwise) and pattern(k).fullmatch(name)
                                                for k, s in styles.items()):
            qkv_to_tp_order(m, tp)
    parallelize_module(model, tp_mesh, styles)
    _adjust_attributes(model, own_attrs, tp)
    _retie(tied)
    return model


def qkv_to_tp_order(conv: nn.Module, tp: int) -> None:
    """Reorder a fused ``[q | k | v]`` projection's output columns (a GPT-2 ``Conv1D``: weight
    ``[in, 3E]``) into ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` by tp rank, so that a contiguous
    column shard holds one rank's heads of all three."""
    with torch.no_grad():
        conv.weight.copy_(_reorder(conv.weight, tp, to_tp=True))
        if conv.bias is not None:
            conv.bias.copy_(_reorder(conv.bias, tp, to_tp=True))


def qkv_into_tp_order(t: torch.Tensor, tp: int) -> torch.Tensor:
    """:func:`qkv_to_tp_order` on a full weight or bias tensor (last dim ``3E``): a checkpoint's
    value made ready to be split over tp."""
    return _reorder(t, tp, to_tp=True)


def is_fused_qkv(name: str) -> bool:
    """The parameter ``name`` is GPT-2's fused ``c_attn`` (reordered for tensor parallelism)."""
    return name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias")


def qkv_from_tp_order(t: torch.Tensor, tp: int) -> torch.Tensor:
    """The inverse of :func:`qkv_to_tp_order` on a full weight or bias (last dim ``3E``)."""
    return _reorder(t, tp, to_tp=False)


def _reorder(t: torch.Tensor, tp: int, to_tp: bool) -> torch.Tensor:
    e3 = t.shape[-1]
    lead = t.shape[:-1]
    if to_tp:  # [3, tp, E/tp] -> [tp, 3, E/tp]
        return t.reshape(*lead, 3, tp, e3 // (3 * tp)).transpose(-3, -2).reshape(*lead, e3)
    return t.reshape(*lead, tp, 3, e3 // (3 * tp)).transpose(-3, -2).reshape(*lead, e3)


def distribute_like(t: torch.Tensor, mesh: Any, placements: tuple) -> torch.Tensor:
    """This rank's local piece of the full tensor ``t`` under ``placements`` on ``mesh`` (for
    comparing a parallelised model with a plain one)."""
    return distribute_tensor(t, mesh, list(placements), src_data_rank=None).to_local()


__all__ = ["tensor_parallel", "plan_for", "hf_plan", "NoTensorParallelPlan", "qkv_to_tp_order",
           "qkv_from_tp_order", "qkv_into_tp_order", "is_fused_qkv", "distribute_like", "HF_STYLES", "Shard", "Replicate"]
