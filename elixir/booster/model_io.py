"""Helpers of :meth:`Booster.load_model` / ``save_model`` for Hugging Face's safetensors layout.
Reading is :func:`elixir.checkpoint.read_pretrained`'s (transformers' key conversions applied),
writing :func:`elixir.checkpoint.save_pretrained`'s (and ``save_state_dict_pretrained`` for DDP/FSDP2)."""

from __future__ import annotations

import torch
import torch.nn as nn

from elixir import distributed as edist

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def fill_tied(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Add the names of tied parameters the file stored once (safetensors keeps one name per
    shared tensor) under every name the model has for them."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out = dict(state)
    for group in names.values():
        have = [n for n in group if n in out]
        if have:
            for n in group:
                out.setdefault(n, out[have[0]])
    return out


def barrier() -> None:
    if edist.is_initialized() and edist.get_world_size() > 1:
        edist.barrier()
