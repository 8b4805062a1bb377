"""A registry of named Hugging Face model configs, and building them on meta (no weights, no download).

``build_model("opt-175b")`` gives an OPT-175B on ``torch.device("meta")`` in well under a second;
a path to a ``config.json`` works wherever a name does. The search and plan CLIs reuse these.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from rich.table import Table

__all__ = [
    "ModelSpec",
    "REGISTRY",
    "model_names",
    "registry_table",
    "registry_name",
    "suggest_names",
    "config_fields",
    "parameter_floor",
    "load_config",
    "build_model",
    "make_batch",
    "lm_step_fn",
    "enable_checkpointing",
]


@dataclass(frozen=True)
class ModelSpec:
    """A named config: the HF ``model_type`` and the config fields that differ from its defaults."""

    name: str
    model_type: str
    fields: dict = field(default_factory=dict)


def _gpt2(name: str, n_embd: int, n_layer: int, n_head: int) -> ModelSpec:
    return ModelSpec(name, "gpt2", dict(n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab_size=50257, n_positions=1024))


def _opt(name: str, hidden: int, layers: int, heads: int, proj: Optional[int] = None, pre_ln: bool = True) -> ModelSpec:
    return ModelSpec(name, "opt", dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=4 * hidden,
        vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=proj or hidden,
        do_layer_norm_before=pre_ln, pad_token_id=1,
    ))


def _llama(name: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> ModelSpec:
    return ModelSpec(name, "llama", dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ))


def _llama3(name: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> ModelSpec:
    return ModelSpec(name, "llama", dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False,
    ))


def _mistral(name: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> ModelSpec:
    return ModelSpec(name, "mistral", dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
        sliding_window=4096, tie_word_embeddings=False,
    ))


def _qwen2(name: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, tie: bool = False) -> ModelSpec:
    return ModelSpec(name, "qwen2", dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=152064 if not tie else 151936, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=tie,
    ))


def _qwen3(name: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, tie: bool = False) -> ModelSpec:
    return ModelSpec(name, "qwen3", dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=tie,
    ))


def _bert(name: str, hidden: int, layers: int, heads: int) -> ModelSpec:
    return ModelSpec(name, "bert", dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden,
        vocab_size=30522, max_position_embeddings=512,
    ))


REGISTRY: dict[str, ModelSpec] = {s.name: s for s in [
    _gpt2("gpt2", 768, 12, 12),
    _gpt2("gpt2-medium", 1024, 24, 16),
    _gpt2("gpt2-large", 1280, 36, 20),
    _gpt2("gpt2-xl", 1600, 48, 25),
    _opt("opt-125m", 768, 12, 12),
    _opt("opt-350m", 1024, 24, 16, proj=512, pre_ln=False),
    _opt("opt-1.3b", 2048, 24, 32),
    _opt("opt-2.7b", 2560, 32, 32),
    _opt("opt-6.7b", 4096, 32, 32),
    _opt("opt-13b", 5120, 40, 40),
    _opt("opt-30b", 7168, 48, 56),
    _opt("opt-66b", 9216, 64, 72),
    _opt("opt-175b", 12288, 96, 96),
    _llama("llama-7b", 4096, 11008, 32, 32, 32),
    _llama("llama-13b", 5120, 13824, 40, 40, 40),
    _llama("llama-70b", 8192, 28672, 80, 64, 8),
    _llama("llama-2-7b", 4096, 11008, 32, 32, 32),
    _llama("llama-2-13b", 5120, 13824, 40, 40, 40),
    _llama("llama-2-70b", 8192, 28672, 80, 64, 8),
    _llama3("llama-3-8b", 4096, 14336, 32, 32, 8),
    _llama3("llama-3-70b", 8192, 28672, 80, 64, 8),
    _mistral("mistral-7b", 4096, 14336, 32, 32, 8),
    _qwen2("qwen2.5-0.5b", 896, 4864, 24, 14, 2, tie=True),
    _qwen2("qwen2.5-7b", 3584, 18944, 28, 28, 4),
    _qwen2("qwen2.5-72b", 8192, 29568, 80, 64, 8),
    _qwen3("qwen3-0.6b", 1024, 3072, 28, 16, 8, tie=True),
    _qwen3("qwen3-8b", 4096, 12288, 36, 32, 8),
    _qwen3("qwen3-32b", 5120, 25600, 64, 64, 8),
    _bert("bert-base", 768, 12, 12),
    _bert("bert-large", 1024, 24, 16),
]}
"""The built-in model configs by name (`elixir plan --list-models` prints them)."""


# Small variants of four registry models (3 layers, width 128, vocab 512): real-weight runs that
# take seconds on a CPU, for accuracy tests and benchmarks. ``build_model(name, **SMALL_OVERRIDES[name])``.
SMALL_OVERRIDES: dict[str, dict[str, int]] = {
    "gpt2": dict(n_embd=128, n_layer=3, n_head=4, vocab_size=512, n_positions=128),
    "opt-125m": dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, ffn_dim=512, vocab_size=512,
                     max_position_embeddings=128, word_embed_proj_dim=128),
    "llama-7b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=128),
    "bert-base": dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, intermediate_size=512,
                      vocab_size=512, max_position_embeddings=128),
}


class UnknownModel(KeyError):
    """A model name that is neither in the registry nor a path to a ``config.json``."""

    def __str__(self) -> str:  # KeyError quotes its message
        return str(self.args[0]) if self.args else ""


def model_names() -> list[str]:
    """The registry's names, in its order (families together, smallest first)."""
    return list(REGISTRY)


def registry_name(name: str) -> Optional[str]:
    """The registry name that ``name`` spells, ignoring case (``LLaMA-7B`` is ``llama-7b``); None if none."""
    key = str(name).strip().lower()
    return key if key in REGISTRY else None


def suggest_names(name: str, n: int = 3) -> list[str]:
    """The registry names closest to ``name`` (difflib), best first."""
    key = str(name).strip().lower()
    return difflib.get_close_matches(key, list(REGISTRY), n=n, cutoff=0.5)


def registry_table() -> Table:
    """The registry's names as a table, one family (HF ``model_type``) a row."""
    families: dict[str, list[str]] = {}
    for spec in REGISTRY.values():
        families.setdefault(spec.model_type, []).append(spec.name)
    t = Table(title="built-in models", title_justify="left",
              caption="Names are case-insensitive; a config.json path or a model folder works too.")
    t.add_column("family", no_wrap=True)
    t.add_column("names")
    for family, names in families.items():
        t.add_row(family, ", ".join(names))
    return t


def unknown_model_message(name: str) -> str:
    """A short message for a name that is neither a registry name nor a config path."""
    close = suggest_names(name)
    hint = ""
    if close:
        hint = f" Did you mean {close[0]}?" if len(close) == 1 else f" Did you mean {', '.join(close[:-1])} or {close[-1]}?"
    return (f"unknown model {name!r}.{hint}\n"
            "  Give a built-in name (`elixir plan --list-models` lists them), a config.json path\n"
            "  or a folder holding one (a local Hugging Face model directory).")


def config_fields(name_or_path: Union[str, os.PathLike], **overrides: Any) -> tuple[str, dict]:
    """``(model_type, fields)`` of a registry name or a ``config.json`` path (or a folder holding
    one), ``overrides`` applied, as written: no defaults filled in, and no transformers import."""
    key = str(name_or_path)
    path = os.path.join(key, "config.json") if os.path.isdir(key) else key
    if os.path.isfile(path):
        with open(path) as f:
            d = json.load(f)
        if "model_type" not in d:
            raise ValueError(f"{path} has no 'model_type' field; it is not a Hugging Face config.json")
        model_type, fields = d.pop("model_type"), d
    elif registry_name(key) is not None:
        spec = REGISTRY[registry_name(key)]
        model_type, fields = spec.model_type, dict(spec.fields)
    else:
        raise UnknownModel(unknown_model_message(key))
    return model_type, _fit_per_layer_fields(fields, overrides)


def load_config(name_or_path: Union[str, os.PathLike], **overrides: Any):
    """The HF config for a registry name or a ``config.json`` path (or a folder holding one)."""
    # optional dependency: transformers (the hf extra)
    from transformers import AutoConfig

    model_type, fields = config_fields(name_or_path, **overrides)
    return AutoConfig.for_model(model_type, **fields)


# The families whose every layer holds attention projections (q, k, v, o) and a two-matrix-or-more
# MLP, and whose word embedding is vocab x hidden (OPT's: x word_embed_proj_dim): the families
# parameter_floor counts. Others (mixtures of experts, hybrids with attention-free layers) get None.
_FLOOR_FAMILIES = ("gpt2", "opt", "llama", "mistral", "qwen2", "qwen3", "bert")
_GATED_MLP = ("llama", "mistral", "qwen2", "qwen3")  # gate, up and down projections


def _first_int(fields: dict, *keys: str) -> Optional[int]:
    return next((fields[k] for k in keys if isinstance(fields.get(k), int)), None)


def parameter_floor(name_or_path: Union[str, os.PathLike], **overrides: Any) -> Optional[int]:
    """At most the model's parameter count, from its config's fields alone (no transformers, no
    model built): the word embedding once (tied or not) and per layer the attention projections
    and MLP matrices (three in the gated families), each ``hidden x`` its stated width, and an
    untied LM head where the config says ``tie_word_embeddings: false``; biases, norms and position
    embeddings are left out, and so is a width or an untying the config does not state (no
    default is looked up). None for a family it does not know (:data:`_FLOOR_FAMILIES`) or a
    config without hidden size, layer count, heads or vocabulary."""
    model_type, f = config_fields(name_or_path, **overrides)
    hidden = _first_int(f, "hidden_size", "n_embd", "d_model")
    layers = _first_int(f, *_LAYER_COUNT_FIELDS)
    heads = _first_int(f, "num_attention_heads", "n_head")
    vocab = _first_int(f, "vocab_size")
    if model_type not in _FLOOR_FAMILIES or None in (hidden, layers, heads, vocab) or heads < 1:
        return None
    head_dim = _first_int(f, "head_dim") or hidden // heads
    kv_heads = _first_int(f, "num_key_value_heads") or heads
    inner = _first_int(f, "intermediate_size", "ffn_dim", "n_inner") or (4 * hidden if model_type == "gpt2" else 0)
    mlp = 3 if model_type in _GATED_MLP else 2
    embed = vocab * min(hidden, _first_int(f, "word_embed_proj_dim") or hidden)
    embeddings = 2 if f.get("tie_word_embeddings") is False else 1  # an untied head only where the config says so
    return embeddings * embed + layers * (hidden * head_dim * 2 * (heads + kv_heads) + mlp * hidden * inner)


# Config fields that hold one entry per layer: a layer-count override must cut them to match,
# or transformers refuses the config (Qwen3's and Gemma3's ``layer_types``).
_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
_PER_LAYER_FIELDS = ("layer_types", "no_rope_layers")


def _fit_per_layer_fields(fields: dict, overrides: dict) -> dict:
    """``{**fields, **overrides}``, with per-layer lists cut (or cycled) to an overridden layer count."""
    out = {**fields, **overrides}
    n = next((overrides[k] for k in _LAYER_COUNT_FIELDS if isinstance(overrides.get(k), int)), None)
    if n is None:
        return out
    for k in _PER_LAYER_FIELDS:
        v = fields.get(k)
        if k not in overrides and isinstance(v, list) and v and len(v) != n:
            out[k] = [v[i % len(v)] for i in range(n)]
    return out


def _is_masked_lm(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return config.model_type in ("bert", "roberta", "distilbert") or any("MaskedLM" in a for a in archs)


def build_model(name_or_path: Union[str, os.PathLike], device: Union[str, torch.device] = "meta",
                **overrides: Any) -> nn.Module:
    """Build the model (causal LM, or masked LM for BERT-like configs) on ``device`` (meta: no bytes)."""
    # optional dependency: transformers (the hf extra)
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    cfg = load_config(name_or_path, **overrides)
    masked = _is_masked_lm(cfg)
    cls = AutoModelForMaskedLM if masked else AutoModelForCausalLM
    with torch.device(device):
        model = cls.from_config(cfg)
    if getattr(model, "loss_type", "") is None:
        # A class whose name transformers cannot map to a loss (GPT2LMHeadModel) gets the loss that
        # transformers falls back to anyway, named, so it does not print "`loss_type=None` was set
        # in the config but it is unrecognized" on every trace.
        model.loss_type = "ForMaskedLM" if masked else "ForCausalLM"
    return model.train()


def make_batch(model: nn.Module, batch: int, seq: int, device: Union[str, torch.device] = "meta") -> dict:
    """A language-modelling batch ``{"input_ids", "labels"}`` of shape ``(batch, seq)``."""
    cfg = model.config
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if limit is not None and seq > limit:
        raise ValueError(f"seq {seq} exceeds the model's {limit} positions")
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if torch.device(device).type != "meta":
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    return {"input_ids": ids, "labels": ids}


def lm_step_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    """One forward and backward of the LM loss (the tracer's ``step_fn``)."""
    loss = model(**batch).loss
    loss.backward()
    return loss


def enable_checkpointing(model: nn.Module, reentrant: bool = False) -> nn.Module:
    """Turn on HF gradient checkpointing of every layer (reentrant or not), through
    ``activation_checkpointing_enable`` where transformers has it (its older name warns)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()
