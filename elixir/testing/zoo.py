"""A zoo of small models for tests, built from configs with no download.

Each :class:`ZooCase` knows how to build its model (deterministically, from a seed), make a batch
for a given step, and compute the loss. Hard cases each carry one thing that breaks naive ZeRO-3
runtimes: tied weights, frozen parameters, a parameter unused in some steps, a parameter used twice
in one forward, buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 128
SEQ = 16


@dataclass(frozen=True)
class ZooCase:
    """One model of the zoo.

    Attributes:
        name: short id used in test ids.
        build: ``build(**overrides) -> nn.Module``; call under ``torch.manual_seed`` for determinism.
        make_batch: ``make_batch(batch_size, step) -> dict[str, Tensor]``, deterministic in ``step``.
        loss: ``loss(model, batch) -> scalar Tensor`` (a per-sample mean).
        batch_independent: True when the loss on a batch is the mean of per-sample losses, so a
            data-parallel split of the batch gives exactly the full-batch gradient.
    """

    name: str
    build: Callable[..., nn.Module]
    make_batch: Callable[[int, int], dict]
    loss: Callable[[nn.Module, dict], torch.Tensor]
    batch_independent: bool = True
    tags: tuple = field(default_factory=tuple)

    def step_fn(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """Forward and backward of one training step; returns the loss (the tracer's ``step_fn``)."""
        loss = self.loss(model, batch)
        loss.backward()
        return loss


def _gen(step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * salt + step)


def _token_batch(batch_size: int, step: int, seq: int = SEQ, vocab: int = VOCAB) -> dict:
    ids = torch.randint(0, vocab, (batch_size, seq), generator=_gen(step, 1))
    return {"input_ids": ids}


def _lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


# ---------------------------------------------------------------------------------------------
# Hugging Face models (tiny configs)


def build_gpt2(dropout: float = 0.0, n_layer: int = 2, n_embd: int = 32, n_head: int = 2, vocab: int = VOCAB, **kw):
    # optional dependency: transformers (the hf extra)
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **kw,
    )
    return GPT2LMHeadModel(cfg)


def build_opt(dropout: float = 0.0, **kw):
    # optional dependency: transformers (the hf extra)
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=dropout, attention_dropout=dropout,
        pad_token_id=1, **kw,
    )
    return OPTForCausalLM(cfg)


def build_llama(**kw):
    # optional dependency: transformers (the hf extra)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, **kw,
    )
    return LlamaForCausalLM(cfg)


def build_bert(dropout: float = 0.0, **kw):
    # optional dependency: transformers (the hf extra)
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **kw,
    )
    return BertForMaskedLM(cfg)


# ---------------------------------------------------------------------------------------------
# small conv net and hard-case toys


class ConvNet(nn.Module):
    """Conv + GroupNorm + pooling + linear head (batch independent)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def _image_batch(batch_size: int, step: int) -> dict:
    g = _gen(step, 2)
    return {"x": torch.randn(batch_size, 3, 8, 8, generator=g), "y": torch.randint(0, 10, (batch_size,), generator=g)}


def _vector_batch(batch_size: int, step: int, dim: int = 16, classes: int = 8) -> dict:
    g = _gen(step, 3)
    return {
        "x": torch.randn(batch_size, dim, generator=g),
        "y": torch.randint(0, classes, (batch_size,), generator=g),
        "step": torch.tensor(step),
    }


def _ce_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


class TiedLM(nn.Module):
    """Embedding and output projection share one weight."""

    def __init__(self, vocab: int = VOCAB, dim: int = 24):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h + self.mlp(h)
        return self.head(h)


def _tied_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["input_ids"].reshape(-1))


class FrozenLoRA(nn.Module):
    """A frozen base (LoRA-style) with small trainable adapters and a trainable head."""

    def __init__(self, dim: int = 16, rank: int = 4, classes: int = 8):
        super().__init__()
        self.base1 = nn.Linear(dim, dim)
        self.base2 = nn.Linear(dim, dim)
        for p in (*self.base1.parameters(), *self.base2.parameters()):
            p.requires_grad_(False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = torch.tanh(self.base1(x) + self.lora_b(self.lora_a(x)))
        return self.head(torch.tanh(self.base2(h)))


class RoutedExperts(nn.Module):
    """MoE-like routing: expert 2 is used only on odd steps, and ``never_used`` never gets a gradient."""

    def __init__(self, dim: int = 16, classes: int = 8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.never_used = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x, step: int = 0):
        h = torch.relu(self.inp(x))
        h = self.experts[0](h) + self.experts[1](h)
        if step % 2 == 1:
            h = h + self.experts[2](h)
        return self.head(h)


def _routed_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"], int(batch["step"])), batch["y"])


class SharedTwice(nn.Module):
    """One Linear applied twice in the same forward."""

    def __init__(self, dim: int = 16, classes: int = 8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.shared = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.head(h)


class BufferNet(nn.Module):
    """BatchNorm running statistics plus a constant registered buffer.

    Batch-norm statistics depend on the whole batch, so data-parallel runs match a full-batch
    reference only at world size 1 (``batch_independent=False``).
    """

    def __init__(self, dim: int = 16, classes: int = 8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.inp(x))) * self.scale)


ZOO: dict[str, ZooCase] = {
    c.name: c
    for c in [
        ZooCase("gpt2", build_gpt2, _token_batch, _lm_loss, tags=("hf", "tied")),
        ZooCase("opt", build_opt, _token_batch, _lm_loss, tags=("hf", "tied")),
        ZooCase("llama", build_llama, _token_batch, _lm_loss, tags=("hf",)),
        ZooCase("bert", build_bert, _token_batch, _lm_loss, tags=("hf", "tied")),
        ZooCase("convnet", ConvNet, _image_batch, _ce_loss, tags=("conv",)),
        ZooCase("tied", TiedLM, _token_batch, _tied_loss, tags=("toy", "tied")),
        ZooCase("frozen", FrozenLoRA, _vector_batch, _ce_loss, tags=("toy", "frozen")),
        ZooCase("routed", RoutedExperts, _vector_batch, _routed_loss, tags=("toy", "unused")),
        ZooCase("shared", SharedTwice, _vector_batch, _ce_loss, tags=("toy", "shared")),
        ZooCase("buffers", BufferNet, _vector_batch, _ce_loss, batch_independent=False, tags=("toy", "buffers")),
    ]
}


def get_case(name: str) -> ZooCase:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; choose from {sorted(ZOO)}") from None


def build_model(name: str, seed: int = 0, **overrides) -> nn.Module:
    """Build zoo model ``name`` with deterministic initial weights."""
    case = get_case(name)
    torch.manual_seed(seed)
    return case.build(**overrides)
