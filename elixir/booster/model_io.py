"""Model checkpoints in Hugging Face's safetensors layout: ``model.safetensors`` or shards plus
``model.safetensors.index.json`` (and ``config.json`` for an HF model), so ``from_pretrained``
reads what :meth:`Booster.save_model` writes. Files are written by ``huggingface_hub``."""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
import torch.nn as nn
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file

from elixir import distributed as edist

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def write(state: dict[str, torch.Tensor], path: str, shard: bool, size_per_shard_mb: float, hf_model: Optional[nn.Module]) -> None:
    """Rank 0: write ``state`` to the directory ``path`` (replaced atomically)."""
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    max_shard = max(1, int(size_per_shard_mb * 2**20)) if shard else 2**62  # bytes
    save_torch_state_dict(state, tmp, max_shard_size=max_shard, safe_serialization=True)
    config = getattr(hf_model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(tmp)
    if os.path.isdir(path):
        old = path.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


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
