"""Split a Hugging Face decoder into pipeline stages by layer (manual stage modules).

:func:`split_decoder` cuts a causal-LM decoder into ``num_stages`` contiguous runs of layers and
builds the stage modules this rank holds. The first stage also holds the input embeddings (and
GPT-2's position embeddings), the last the final norm and the output head. Each stage keeps the
Hugging Face parameter names of what it holds (layers sit in a ``ModuleDict`` keyed by their index
in the whole model), so a stage's state dict is a slice of the model's: checkpoints of stages put
together are the model's own.

A stage computes the causal mask itself with transformers' ``create_causal_mask`` (no padding
mask crosses a stage boundary), so eager attention keeps its mask as SDPA does. Families:

- LLaMA-style (``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``,
  ``lm_head``: LLaMA, Mistral, Qwen2, Qwen3, ...);
- GPT-2 (``transformer.wte/wpe/drop/h/ln_f``, ``lm_head``).

A weight tied between stages (GPT-2's ``wte`` and ``lm_head``) stays one parameter per stage; the
pipeline sums its gradient over the stages that hold it (:mod:`elixir.parallel.pipeline_optim`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn


class NoPipelineSplit(ValueError):
    """elixir cannot split this model into pipeline stages."""


@dataclass(frozen=True)
class Family:
    """Where a decoder family keeps its parts (attribute paths from the causal-LM model)."""

    name: str
    base: str  # the base model's attribute ("model", "transformer")
    layers: str  # the ModuleList of decoder layers, under base
    embed: tuple[str, ...]  # input-side modules of the first stage, under base
    final: tuple[str, ...]  # output-side modules of the last stage, under base
    shared: tuple[str, ...] = ()  # parameter-free helpers every stage holds (rotary embedding)


LLAMA = Family("llama", "model", "layers", ("embed_tokens",), ("norm",), ("rotary_emb",))
GPT2 = Family("gpt2", "transformer", "h", ("wte", "wpe", "drop"), ("ln_f",))


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` of ``model``; refuses a model elixir cannot split, naming what it can."""
    for fam in (LLAMA, GPT2):
        base = getattr(model, fam.base, None)
        if base is not None and isinstance(getattr(base, fam.layers, None), nn.ModuleList) \
                and hasattr(model, "lm_head") and all(hasattr(base, a) for a in fam.embed + fam.final + fam.shared):
            return fam
    raise NoPipelineSplit(
        f"elixir cannot split {type(model).__name__} into pipeline stages: it splits causal-LM decoders laid out "
        "like LLaMA (model.embed_tokens / model.layers / model.norm / lm_head: LLaMA, Mistral, Qwen2, Qwen3) or "
        "GPT-2 (transformer.wte / transformer.h / transformer.ln_f / lm_head). For another model, build your "
        "stage modules yourself and pass them to ElixirPipeline(stages=...)"
    )


def layer_ranges(num_layers: int, num_stages: int, sizes: Optional[list[int]] = None) -> list[range]:
    """Contiguous layer ranges, ``sizes`` long each, or as even as can be (earlier stages take the
    remainder)."""
    if sizes is not None:
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1:
            raise NoPipelineSplit(f"layers per stage {list(sizes)}: {num_stages} positive counts summing to the model's "
                                  f"{num_layers} layers")
        starts = [sum(sizes[:i]) for i in range(num_stages)]
        return [range(a, a + n) for a, n in zip(starts, sizes)]
    if num_layers < num_stages:
        raise NoPipelineSplit(f"{num_layers} decoder layers cannot fill {num_stages} pipeline stages (one layer each at least)")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class DecoderStage(nn.Module):
    """Stage ``index`` of ``num_stages`` of a decoder: input ids (first stage) or hidden states in,
    hidden states or logits (last stage) out."""

    def __init__(self, model: nn.Module, fam: Family, index: int, num_stages: int, layers: range) -> None:
        super().__init__()
        self.family, self.index, self.num_stages = fam, index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.config = model.config
        src = getattr(model, fam.base)
        base = nn.Module()
        for name in fam.shared + (fam.embed if self.is_first else ()) + (fam.final if self.is_last else ()):
            setattr(base, name, getattr(src, name))
        setattr(base, fam.layers, nn.ModuleDict({str(i): getattr(src, fam.layers)[i] for i in layers}))
        setattr(self, fam.base, base)
        if self.is_last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = getattr(self, self.family.base)
        fam = self.family.name
        if self.is_first:
            h = base.embed_tokens(x) if fam == "llama" else base.wte(x)
        else:
            h = x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if self.is_first and fam == "gpt2":
            h = base.drop(h + base.wpe(pos))
        mask = _causal_mask(self.config, h, pos)
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": pos}
        if fam == "llama":
            kwargs["position_embeddings"] = base.rotary_emb(h, position_ids=pos)
        for layer in getattr(base, self.family.layers).values():
            out = layer(h, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
        if self.is_last:
            h = self.lm_head(base.norm(h) if fam == "llama" else base.ln_f(h))
        return h


def _causal_mask(config: Any, h: torch.Tensor, pos: torch.Tensor) -> Optional[torch.Tensor]:
    """The mask the whole model would build with no padding mask: None under SDPA (its own causal
    flag), the explicit causal mask under eager attention (which would otherwise attend everywhere)."""
    # optional dependency: transformers (stages split Hugging Face models only)
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config=config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)


def split_decoder(model: nn.Module, num_stages: int, stage_ids: Optional[list[int]] = None,
                  layers_per_stage: Optional[list[int]] = None) -> list[DecoderStage]:
    """The stage modules ``stage_ids`` (default: all) of ``model`` cut into ``num_stages`` stages by
    layer (:func:`layer_ranges`, or ``layers_per_stage`` layers each). They share ``model``'s
    modules (nothing is copied)."""
    fam = family_of(model)
    layers = getattr(getattr(model, fam.base), fam.layers)
    ranges = layer_ranges(len(layers), num_stages, layers_per_stage)
    ids = list(range(num_stages)) if stage_ids is None else list(stage_ids)
    return [DecoderStage(model, fam, s, num_stages, ranges[s]) for s in ids]


def tied_names(model: nn.Module, num_stages: int, layers_per_stage: Optional[list[int]] = None) -> list[tuple[str, str]]:
    """Pairs (name on the first stage, name on the last stage) of parameters tied across them
    (GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``). Only a tie between the first and
    the last stage is supported; any other cross-stage tie raises."""
    if num_stages == 1:
        return []
    stages = split_decoder(model, num_stages, layers_per_stage=layers_per_stage)
    owners: dict[int, list[tuple[int, str]]] = {}
    for s in stages:
        for name, p in s.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), []).append((s.index, name))
    out = []
    for holders in owners.values():
        where = sorted({i for i, _ in holders})
        if len(where) < 2:
            continue
        if where != [0, num_stages - 1]:
            raise NoPipelineSplit(f"a parameter is tied across pipeline stages {where} ({holders}); elixir sums a tied "
                                  "parameter's gradient between the first and the last stage only")
        first = next(n for i, n in holders if i == 0)
        last = next(n for i, n in holders if i == num_stages - 1)
        out.append((first, last))
    return out


def release_unheld(model: nn.Module, stages: list[nn.Module]) -> int:
    """Replace every parameter of ``model`` that none of ``stages`` holds (the other ranks' layers)
    by a meta tensor of its shape, freeing its memory; returns how many elements were freed. The
    model keeps its names and shapes (for saving); only ``stages`` can run."""
    held = {id(p) for s in stages for p in s.parameters()}
    freed = 0
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and id(p) not in held and p.device.type != "meta":
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                freed += p.numel()
    return freed
