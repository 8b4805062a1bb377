"""A registry of named Hugging Face model configs, and building them on meta (no weights, no download).

``build_model("opt-175b")`` gives an OPT-175B on ``torch.device("meta")`` in well under a second;
a path to a ``config.json`` works wherever a name does. The search and plan CLIs reuse these.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn as nn

__all__ = [
    "ModelSpec",
    "REGISTRY",
    "model_names",
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
    _bert("bert-base", 768, 12, 12),
    _bert("bert-large", 1024, 24, 16),
]}


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
    return list(REGISTRY)


def load_config(name_or_path: Union[str, os.PathLike], **overrides: Any):
    """The HF config for a registry name or a ``config.json`` path (or a folder holding one)."""
    # optional dependency: transformers (the hf extra)
    from transformers import AutoConfig

    key = str(name_or_path)
    if key in REGISTRY:
        spec = REGISTRY[key]
        return AutoConfig.for_model(spec.model_type, **{**spec.fields, **overrides})
    path = os.path.join(key, "config.json") if os.path.isdir(key) else key
    if not os.path.isfile(path):
        raise UnknownModel(f"unknown model {key!r}: not a registry name ({', '.join(REGISTRY)}) nor a config.json path "
                           "(or a folder holding one); `elixir profile --list` lists the names")
    with open(path) as f:
        d = json.load(f)
    if "model_type" not in d:
        raise ValueError(f"{path} has no 'model_type' field; it is not a Hugging Face config.json")
    return AutoConfig.for_model(d.pop("model_type"), **{**d, **overrides})


def _is_masked_lm(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return config.model_type in ("bert", "roberta", "distilbert") or any("MaskedLM" in a for a in archs)


def build_model(name_or_path: Union[str, os.PathLike], device: Union[str, torch.device] = "meta",
                **overrides: Any) -> nn.Module:
    """Build the model (causal LM, or masked LM for BERT-like configs) on ``device`` (meta: no bytes)."""
    # optional dependency: transformers (the hf extra)
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    cfg = load_config(name_or_path, **overrides)
    cls = AutoModelForMaskedLM if _is_masked_lm(cfg) else AutoModelForCausalLM
    with torch.device(device):
        model = cls.from_config(cfg)
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
