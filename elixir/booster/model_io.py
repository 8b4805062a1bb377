"""Reading model checkpoints in Hugging Face's safetensors layout (``model.safetensors`` or shards
plus ``model.safetensors.index.json``, transformers' key conversions applied) for
:meth:`Booster.load_model`, and ColossalAI's single-file checkpoints (``shard=False``: one
safetensors or ``torch.save`` file). Writing the directory layout
is :func:`elixir.checkpoint.save_pretrained`'s (and ``save_state_dict_pretrained`` for DDP/FSDP2);
the single file is :func:`write_file`'s."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from elixir import checkpoint
from elixir import distributed as edist

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _is_safetensors(path: str) -> bool:
    """Whether ``path`` starts as a safetensors file does (an 8-byte header length, then JSON)."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def write_file(path: str, state: dict[str, torch.Tensor], use_safetensors: bool) -> None:
    """``state`` as the single file ``path`` (safetensors, or ``torch.save``), staged and renamed
    into place. Tensors sharing memory (tied weights) are stored once, under their first name, as
    safetensors requires; :func:`fill_tied` restores the other names on load."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    if use_safetensors:
        seen: set = set()
        once = {}
        for k, v in state.items():
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else None
            if key is not None and key in seen:
                continue
            seen.add(key)
            once[k] = v.detach().contiguous()
        save_file(once, tmp)
    else:
        torch.save(state, tmp)
    os.replace(tmp, path)


def read(path: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint ``path`` under ``model``'s names: a directory in the HF layout
    (single file or index plus shards; transformers' key conversions applied by
    :func:`elixir.checkpoint.read_pretrained`), or a single safetensors or ``torch.save`` file."""
    if os.path.isfile(path):
        return load_file(path) if _is_safetensors(path) else torch.load(path, map_location="cpu", weights_only=True)
    if not (os.path.isfile(os.path.join(path, INDEX)) or os.path.isfile(os.path.join(path, SINGLE))):
        raise FileNotFoundError(f"{path!r} holds neither {SINGLE} nor {INDEX}; was it written by Booster.save_model?")
    return checkpoint.read_pretrained(path, model)


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
