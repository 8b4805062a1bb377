"""Reading model checkpoints in Hugging Face's safetensors layout (``model.safetensors`` or shards
plus ``model.safetensors.index.json``) for :meth:`Booster.load_model`. Writing is
:func:`elixir.checkpoint.save_pretrained`'s (and ``save_state_dict_pretrained`` for DDP/FSDP2)."""

from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
from safetensors.torch import load_file

from elixir import distributed as edist

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory ``path`` (single file or index plus shards)."""
    if os.path.isfile(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, SINGLE)):
        files = [SINGLE]
    else:
        raise FileNotFoundError(f"{path!r} holds neither {SINGLE} nor {INDEX}; was it written by Booster.save_model?")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(os.path.join(path, name)))
    return out


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
