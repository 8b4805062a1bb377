"""A PEFT model inside an ElixirModule saved as PEFT saves it: ``adapter_config.json`` and
``adapter_model.safetensors`` (``PeftModel.from_pretrained(base, path)`` loads it), not the whole
model under PEFT's key names.

Which tensors PEFT keeps is PEFT's own rule (``get_peft_model_state_dict``: the adapters of each
adapter name, ``modules_to_save``, embedding layers when it decides to save them), so it is run
first on meta placeholders of every tensor to learn the keys it picks; only the chunks holding
those are gathered (one at a time, every rank taking part: the adapters, not the frozen base),
and rank 0 calls ``PeftModel.save_pretrained`` with that state dict into a staging directory
that is renamed into place (:mod:`elixir.checkpoint.atomic`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Optional

import torch

from elixir.checkpoint import atomic
from elixir.wrapper.state_dict import chunk_values

if TYPE_CHECKING:
    from elixir.wrapper.module import ElixirModule

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_keys(peft_model: torch.nn.Module) -> Optional[set[str]]:
    """The state-dict keys of ``peft_model`` that PEFT's ``save_pretrained`` writes (every adapter),
    found by PEFT's own selection run on meta placeholders; None when that selection returns
    tensors other than the ones it was given (then everything is gathered)."""
    # optional dependency: peft
    from peft.utils import get_peft_model_state_dict

    placeholders = {k: torch.empty(t.shape, dtype=t.dtype, device="meta")
                    for k, t in peft_model.state_dict(keep_vars=True).items()}
    key_of = {id(v): k for k, v in placeholders.items()}
    keys: set[str] = set()
    for name in peft_model.peft_config:
        picked = get_peft_model_state_dict(peft_model, state_dict=placeholders, adapter_name=name)
        for v in picked.values():
            k = key_of.get(id(v))
            if k is None:
                return None
            keys.add(k)
    return keys


def gather_tensors(em: ElixirModule, module: torch.nn.Module, keys: set[str]) -> dict[str, torch.Tensor]:
    """Full values of ``keys`` of ``module`` (a module inside ``em``), gathering only the chunks
    that hold them, one at a time. Collective (every rank passes the same keys); every rank gets them."""
    tensors = module.state_dict(keep_vars=True)
    where = {}  # id(param) -> (chunk index, slot)
    for pmap in (em.param_map, em.frozen_map):
        for s in pmap.slots:
            where[id(pmap.params[s.index])] = (s.chunk, s)
    out: dict[str, torch.Tensor] = {}
    by_chunk: dict[int, list[str]] = {}
    for k in sorted(keys):
        hit = where.get(id(tensors[k]))
        if hit is None:
            out[k] = tensors[k].detach().to("cpu", copy=True)
        else:
            by_chunk.setdefault(hit[0], []).append(k)
    em.cache.release_all()
    for ci in sorted(by_chunk):
        full = chunk_values(em, em.all_chunks[ci])
        for k in by_chunk[ci]:
            s = where[id(tensors[k])][1]
            out[k] = full[s.offset : s.offset + s.numel].view(s.shape).clone()
        del full
    return out


def save_adapter(path: str, em: ElixirModule, peft_model: torch.nn.Module) -> None:
    """Write the adapters of ``peft_model`` (a PEFT model inside ``em``) at ``path`` as
    ``PeftModel.save_pretrained`` does. Collective: call on every rank."""
    keys = adapter_keys(peft_model)
    if keys is None:
        warnings.warn("elixir: PEFT's adapter selection could not be run on placeholders; gathering every tensor "
                      "of the model to save its adapters", stacklevel=3)
        keys = set(peft_model.state_dict(keep_vars=True))
    with atomic.collective_save(path, em.group, em.world_size, em.rank, (ADAPTER_CONFIG, ADAPTER_WEIGHTS)) as stage:
        values = gather_tensors(em, peft_model, keys)
        if em.rank == 0:
            state = {k: values.get(k, torch.empty(t.shape, dtype=t.dtype, device="meta"))
                     for k, t in peft_model.state_dict(keep_vars=True).items()}
            try:  # PEFT's own writer: adapter_config.json, adapter_model.safetensors, README.md
                type(peft_model).save_pretrained(peft_model, stage.tmp, state_dict=state)
            except (OSError, ValueError, RuntimeError) as e:
                stage.error = f"PEFT's save_pretrained into {path} failed: {type(e).__name__}: {e}"
