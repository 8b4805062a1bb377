"""Tensor-parallel plans as data: which modules split over the tensor axis, by which style name.

One home for the rule that both the runtime and the search read:

- :func:`style_plan` gives a model's plan as ``{module path with * wildcards: style name}``: a
  Hugging Face model's own ``base_model_tp_plan`` / ``_tp_plan`` (LLaMA, Mistral, Qwen2, Qwen3,
  ...), or elixir's plan for GPT-2, OPT and BERT (:data:`FAMILY_PLANS`); where the input and output
  embeddings are tied, both split over the vocabulary so the tie holds.
  :func:`elixir.parallel.tensor.plan_for` translates the names to torch's ``ParallelStyle`` s.
- :func:`local_shapes` gives the shape each rank holds of every parameter under such a plan:
  what the search packs into chunks when it plans a tensor-parallel run (``elixir plan --tp``).

Style names are Hugging Face's (``colwise``, ``rowwise``, ...) plus ``conv1d_colwise`` /
``conv1d_rowwise`` for GPT-2's ``Conv1D`` layers (weight ``[in, out]``: the split dims swap).
Nothing here imports ``torch.distributed``: the plan is read on meta models.
"""

from __future__ import annotations

import re
from typing import Any, Optional

# the weight dim each style splits (of nn.Linear's [out, in]; nn.Embedding's [vocab, dim];
# Conv1D's [in, out]) and whether the bias splits with it (a row-wise layer's bias is added once,
# after the sum: it stays whole)
WEIGHT_SPLIT: dict[str, tuple[int, bool]] = {
    "colwise": (0, True),
    "colwise_rep": (0, True),
    "colwise_gather_output": (0, True),
    "rowwise": (1, False),
    "rowwise_rep": (1, False),
    "rowwise_split_input": (1, False),
    "embedding_rowwise": (0, False),
    "embedding_rowwise_seq": (0, False),
    "rowwise_seq": (1, False),
    "colwise_vocab": (0, True),
    "colwise_seq_head": (0, True),
    "colwise_seq_head_vocab": (0, True),
    "conv1d_colwise": (1, True),
    "conv1d_rowwise": (0, False),
}
# styles that split no parameter (activations only, or a gradient all-reduce over tp)
UNSPLIT_STYLES = ("sequence_parallel", "replicated_with_grad_allreduce", "gather_seq_input", "gather_seq_hidden_states")

_GPT2 = "transformer.h.*."
_OPT = "model.decoder.layers.*."
_BERT = "bert.encoder.layer.*."
FAMILY_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {_GPT2 + "attn.c_attn": "conv1d_colwise", _GPT2 + "attn.c_proj": "conv1d_rowwise",
             _GPT2 + "mlp.c_fc": "conv1d_colwise", _GPT2 + "mlp.c_proj": "conv1d_rowwise"},
    "opt": {**{_OPT + f"self_attn.{x}_proj": "colwise" for x in "qkv"},
            _OPT + "self_attn.out_proj": "rowwise", _OPT + "fc1": "colwise", _OPT + "fc2": "rowwise"},
    "bert": {**{_BERT + f"attention.self.{x}": "colwise" for x in ("query", "key", "value")},
             _BERT + "attention.output.dense": "rowwise", _BERT + "intermediate.dense": "colwise",
             _BERT + "output.dense": "rowwise"},
}
# model_type -> (input embedding, output head): split over the vocabulary together when tied
TIED_VOCAB: dict[str, tuple[str, str]] = {"gpt2": ("transformer.wte", "lm_head"),
                                          "opt": ("model.decoder.embed_tokens", "lm_head")}
TIED_VOCAB_STYLES = ("embedding_rowwise", "colwise_rep")  # (the embedding's, the head's)


class NoTensorParallelPlan(ValueError):
    """elixir has no tensor-parallel plan for this model (pass one)."""


def how_to_pass() -> str:
    """How a user passes a plan of their own (the end of every refusal)."""
    return ("pass a plan in torch's format: tensor_parallel(model, mesh, plan={'layers.*.fc1': ColwiseParallel(), "
            "'layers.*.fc2': RowwiseParallel(), ...}) (torch.distributed.tensor.parallel styles, keys are module "
            "paths with * for any layer index)")


def _tied(model: Any, emb: str, head: str) -> dict[str, str]:
    mods = dict(model.named_modules())
    if emb in mods and head in mods and mods[emb].weight is mods[head].weight:
        return dict(zip((emb, head), TIED_VOCAB_STYLES))
    return {}


def hf_style_plan(model: Any) -> Optional[dict[str, str]]:
    """The model's own Hugging Face plan (style names, keys from the model's root), or None."""
    cfg = getattr(model, "config", None)
    base = dict(getattr(cfg, "base_model_tp_plan", None) or {})
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    prefix = prefix + "." if prefix and hasattr(model, prefix) else ""
    plan = {prefix + k: v for k, v in base.items()}
    plan.update(dict(getattr(model, "_tp_plan", None) or {}))  # the model's resolved plan (head, embedding)
    plan.update(_tied(model, f"{prefix}embed_tokens", "lm_head"))
    return plan


def style_plan(model: Any) -> dict[str, str]:
    """``model``'s tensor-parallel plan as style names (see the module docstring); raises
    :class:`NoTensorParallelPlan` naming how to pass one when there is none."""
    own = hf_style_plan(model)
    if own is not None:
        return own
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in FAMILY_PLANS:
        return {**FAMILY_PLANS[kind], **_tied(model, *TIED_VOCAB[kind])} if kind in TIED_VOCAB else dict(FAMILY_PLANS[kind])
    raise NoTensorParallelPlan(
        f"elixir has no tensor-parallel plan for {type(model).__name__} (model_type {kind!r}; it ships plans for "
        f"Hugging Face models with a base_model_tp_plan and for {', '.join(sorted(FAMILY_PLANS))}); {how_to_pass()}"
    )


# Sequence parallelism (torchtitan's LLaMA recipe): the residual stream between blocks is split over
# the sequence (Shard(1), kept a DTensor so the model sees the global sequence length: its rotary
# positions and causal mask); norms compute on their sequence slice; attention and the MLP gather
# the whole sequence at their input and their row-wise output projection reduce-scatters it back.
SP_FAMILIES = ("llama", "mistral", "qwen2")
_SP_LAYER = {"input_layernorm": "sequence_parallel", "post_attention_layernorm": "sequence_parallel",
             "self_attn": "gather_seq_hidden_states", "mlp": "gather_seq_input",
             **{f"self_attn.{x}_proj": "colwise" for x in "qkv"}, "self_attn.o_proj": "rowwise_seq",
             "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise_seq"}


def sequence_parallel_plan(model: Any, loss_parallel: bool = False) -> dict[str, str]:
    """The sequence-parallel plan (style names) of a LLaMA-style decoder (:data:`SP_FAMILIES`);
    with ``loss_parallel`` the head's logits stay split over the vocabulary (see
    :func:`elixir.parallel.tensor.causal_lm_loss`). Raises :class:`NoTensorParallelPlan` for
    another family, naming the alternatives."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in SP_FAMILIES:
        raise NoTensorParallelPlan(
            f"elixir has no sequence-parallel plan for {type(model).__name__} (model_type {kind!r}; it has one for "
            f"{', '.join(SP_FAMILIES)}): use tensor_parallel(model, mesh) without sequence_parallel (activations "
            f"replicated over tp), or {how_to_pass()} with SequenceParallel / PrepareModuleInput entries")
    base = "model."
    plan = {base + "embed_tokens": "embedding_rowwise_seq", base + "norm": "sequence_parallel",
            "lm_head": "colwise_seq_head_vocab" if loss_parallel else "colwise_seq_head"}
    plan.update({f"{base}layers.*.{k}": v for k, v in _SP_LAYER.items()})
    return plan


def loss_parallel_plan(plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with its head (``lm_head``) keeping the logits split over the vocabulary."""
    if plan.get("lm_head") not in ("colwise", "colwise_rep", "colwise_gather_output", "colwise_vocab"):
        raise NoTensorParallelPlan(f"loss parallelism needs a column-parallel lm_head in the plan (got "
                                   f"{plan.get('lm_head')!r}): pass loss_parallel=False")
    return {**plan, "lm_head": "colwise_vocab"}


def pattern(key: str) -> re.Pattern:
    """A plan key (module path, ``*`` for one path component) as a regular expression."""
    return re.compile(re.escape(key).replace(r"\*", r"[^.]+"))


def local_shapes(params: tuple[tuple[str, tuple[int, ...]], ...], plan: dict[str, str],
                 tp: int) -> dict[str, tuple[int, ...]]:
    """The shape one of ``tp`` ranks holds of each ``(name, shape)`` parameter under ``plan``
    (style names): the split dim divided by ``tp`` (rounded up, as torch's ``Shard`` places the
    remainder), every other parameter whole. Raises ValueError on a style it does not know."""
    rules = [(pattern(k), v) for k, v in plan.items()]
    out = {}
    for name, shape in params:
        module, _, leaf = name.rpartition(".")
        style = next((v for rx, v in rules if rx.fullmatch(module)), None)
        out[name] = tuple(shape)
        if style is None or style in UNSPLIT_STYLES or tp == 1:
            continue
        if style not in WEIGHT_SPLIT:
            raise ValueError(f"tensor-parallel style {style!r} (for {module}) is not one elixir knows: "
                             f"{', '.join([*WEIGHT_SPLIT, *UNSPLIT_STYLES])}")
        dim, bias_splits = WEIGHT_SPLIT[style]
        if leaf == "bias":  # 1-D: split with its layer's outputs, or whole
            dim = 0 if bias_splits else None
        if dim is None or dim >= len(shape):
            continue
        out[name] = tuple(-(-d // tp) if i == dim else d for i, d in enumerate(shape))
    return out


__all__ = ["FAMILY_PLANS", "TIED_VOCAB", "WEIGHT_SPLIT", "UNSPLIT_STYLES", "NoTensorParallelPlan", "how_to_pass",
           "hf_style_plan", "style_plan", "pattern", "local_shapes", "SP_FAMILIES", "sequence_parallel_plan",
           "loss_parallel_plan"]
