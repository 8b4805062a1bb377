"""A Hugging Face checkpoint of a model on a device mesh (tensor x pipeline x data parallel),
written with no rank gathering the whole model.

:func:`save_pretrained_mesh` writes the layout ``from_pretrained`` reads (safetensors files of at
most ``max_shard_size``, ``model.safetensors.index.json``, ``config.json``). Each pipeline stage
writes the files of its own tensors; within a stage, the files go in turn to the stage's ranks
(its dp x tp group). For each file, every rank of the stage takes part in gathering what covers
it: one chunk at a time over dp (as :func:`~elixir.checkpoint.save_pretrained` does), then each
tensor-parallel parameter whole over tp (GPT-2's fused ``c_attn`` back in its own column order);
only the file's writer keeps the values. So a rank holds at most one file's tensors, one gathered
chunk and one whole tensor. Rank 0 writes the index and config last; the directory is staged and
renamed into place (:mod:`elixir.checkpoint.atomic`), and a failure on any rank is raised on every
rank. A weight tied across stages (GPT-2's ``wte`` / ``lm_head``) is one parameter on each of
the two stages and is written under both names (each stage reads its own back); a weight tied
within a module is written once, as Hugging Face writes it.
"""

from __future__ import annotations

import os
from typing import Union

import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.checkpoint import atomic, hf_conversion
from elixir.checkpoint.errors import CheckpointError, agree
from elixir.checkpoint.format import write_tensors
from elixir.checkpoint.mesh import MeshModel, mesh_parts
from elixir.checkpoint.pretrained import (
    CONFIG,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    _file_names,
    _keys_to_save,
    _plan_files,
    _write_meta,
    parse_size,
)
from elixir.parallel.tensor import is_fused_qkv, qkv_from_tp_order
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.state_dict import chunk_values

Plan = tuple[list[list[str]], list[dict]]  # a stage's files (model keys) and their saved keys -> (shape, dtype)


def _stage(em: ElixirModule) -> int:
    return int(getattr(em.module, "index", 0))


def _slots(em: ElixirModule) -> tuple[dict, dict]:
    """Slot by parameter name, and parameter name by id of the parameter (trainable and frozen)."""
    slot_of = {s.name: s for s in em.slots + em.frozen_map.slots}
    name_of = {id(em.params[s.index]): s.name for s in em.slots}
    name_of.update({id(em.frozen_map.params[s.index]): s.name for s in em.frozen_map.slots})
    return slot_of, name_of


def _stage_shapes(em: ElixirModule, keep: set[str]) -> dict[str, tuple[tuple, torch.dtype]]:
    """The stage's keys to save, with their whole shapes and saved dtypes (chunked trainable
    parameters: their fp32 masters)."""
    tensors = em.module.state_dict(keep_vars=True)
    _, name_of = _slots(em)
    tpp = em.tensor_parallel
    shapes = {}
    for k, t in tensors.items():
        if k not in keep:
            continue
        name = name_of.get(id(t))
        whole = tpp.by_name.get(name) if tpp is not None and name is not None else None
        trainable = name is not None and not em.frozen_map.slot_of(t)
        shapes[k] = (tuple(whole.shape if whole is not None else t.shape), torch.float32 if trainable else t.dtype)
    return shapes


def _whole(em: ElixirModule, name: str, local: torch.Tensor) -> torch.Tensor:
    """Parameter ``name`` whole over tp (collective over the tp group; other names as they are)."""
    tpp = em.tensor_parallel
    if tpp is None or name not in tpp.by_name:
        return local
    t = tpp.by_name[name]
    whole = tpp.full_tensor(name, local).detach().cpu()
    n = t.mesh.size()
    return qkv_from_tp_order(whole, n) if n > 1 and is_fused_qkv(name) else whole


def _gather_file(em: ElixirModule, keys: list[str], dtypes: dict[str, torch.dtype], writer: bool) -> dict:
    """One file's tensors, whole (collective over the stage's dp and tp groups); kept by the writer only."""
    tensors = em.module.state_dict(keep_vars=True)
    slot_of, name_of = _slots(em)
    out: dict[str, torch.Tensor] = {}
    gathered: tuple = (None, None)  # (chunk index, its values): one chunk at a time
    for k in keys:
        t = tensors[k]
        name = name_of.get(id(t))
        if name is None:  # a buffer, or a parameter kept out of chunks
            if writer:
                out[k] = t.detach().to("cpu", dtypes[k]).contiguous()
            continue
        s = slot_of[name]
        if gathered[0] != s.chunk:
            gathered = (None, None)
            gathered = (s.chunk, chunk_values(em, em.all_chunks[s.chunk]))
        whole = _whole(em, name, gathered[1][s.offset : s.offset + s.numel].view(s.shape))
        if writer:
            out[k] = whole.to("cpu", dtypes[k], copy=True)
    return out


def save_pretrained_mesh(path: str, model: MeshModel, hf_model: nn.Module,
                         max_shard_size: Union[int, str] = "5GB") -> None:
    """Write ``model`` (an :class:`~elixir.wrapper.ElixirModule` or
    :class:`~elixir.parallel.ElixirPipeline`, on any mesh layout) as a Hugging Face checkpoint
    directory at ``path`` (see the module docstring). ``hf_model``: the Hugging Face model it
    was built from (its names, ties and config). Collective over the whole world."""
    rank, world = edist.get_rank(), edist.get_world_size()
    limit = parse_size(max_shard_size)
    tied = list(getattr(model, "tied", []))
    # a weight tied across stages is two parameters here: both names written, so that each stage
    # loads its own (transformers' from_pretrained reads either)
    keep = set(_keys_to_save(hf_model)) | {n for pair in tied for n in pair}
    mods = [em for em, _ in mesh_parts(model)]
    mine, error, shapes = {}, None, {}
    try:
        shapes = {_stage(em): _stage_shapes(em, keep) for em in mods}
        mine = {s: _plan_files(hf_model, list(sh), sh, limit) for s, sh in shapes.items()}
    except Exception as e:
        error = f"planning the files of stage {[_stage(em) for em in mods]} failed: {type(e).__name__}: {e}"
    plans: dict[int, Plan] = {}
    for p in agree(None, world, error, mine):
        plans.update(p)
    order = [(s, i) for s in sorted(plans) for i in range(len(plans[s][0]))]
    names = dict(zip(order, _file_names(len(order))))

    def finish(tmp: str) -> None:  # rank 0, once every file is written: the index and config, last
        _write_meta(tmp, hf_model, [plans[s][1][i] for s, i in order], [names[o] for o in order], None)

    with atomic.collective_save(path, None, world, rank, (CONFIG, SAFE_WEIGHTS, SAFE_INDEX), finish) as staged:
        error = None
        for em in mods:
            files = plans[_stage(em)][0]
            lay, coords = em.mesh.layout, em.mesh.coordinates
            position, group = coords.get("dp_shard", 0) * lay.tp + coords.get("tp", 0), lay.dp_shard * lay.tp
            for i, fkeys in enumerate(files):
                writer = i % group == position
                out = _gather_file(em, fkeys, {k: shapes[_stage(em)][k][1] for k in fkeys}, writer)
                if writer and error is None:
                    try:  # under the checkpoint's keys: transformers' conversions reverted
                        write_tensors(os.path.join(staged.tmp, names[(_stage(em), i)]),
                                      hf_conversion.to_checkpoint(hf_model, out))
                    except (OSError, CheckpointError) as e:
                        error = f"writing {names[(_stage(em), i)]} failed: {e}"
                del out
        agree(None, world, error)  # every rank's files were written

