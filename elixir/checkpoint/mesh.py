"""Checkpoints of a model on a device mesh (tensor x pipeline x data parallel) that load at
another mesh layout: fp32 masters and optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``,
momentum, ...), saved at one ``(tp, pp, dp)`` and loaded at any other, world size 1 included.

``save_mesh(path, model, optimizer)`` writes one part per pipeline stage and tp rank
(``stage01-tp00/``: an elixir sharded checkpoint of that stage module, each of its dp ranks writing
its own shard, names the Hugging Face ones) and ``mesh.json`` (the layout, the parts, how each
tensor-parallel parameter is sharded, the tied names), all in one atomic directory.
``load_mesh(path, model, optimizer)`` reads it into a model at any layout: each stage module finds
its parameters by name in whichever parts hold them, and a tensor-parallel parameter's state is
put together whole from the saved tp shards and cut again for the reading tp rank
(:mod:`elixir.checkpoint.mesh_source`), one tensor at a time. :func:`elixir.checkpoint.load` reads a
mesh checkpoint into one ``ElixirModule`` the same way.

``model`` is an :class:`~elixir.wrapper.ElixirModule` (data and tensor parallel) or an
:class:`~elixir.parallel.ElixirPipeline`; ``optimizer`` its :class:`~elixir.wrapper.ElixirOptimizer`
or :class:`~elixir.parallel.PipelineOptimizer`. Both calls are collective over the whole world: a
failure on any rank is raised on every rank, and a load changes nothing unless every rank read
everything it needs.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional, Union

import torch

from elixir import distributed as edist
from elixir.checkpoint import atomic, layout
from elixir.checkpoint.errors import CheckpointError, agree
from elixir.checkpoint.install import commit_load
from elixir.checkpoint.mesh_source import MESH, MESH_FORMAT, MESH_VERSION, MeshSource, full_shape, target_cut
from elixir.checkpoint.save import write_sharded
from elixir.fileio import atomic_write_json
from elixir.offload.pipeline import disk_mapped
from elixir.parallel import ElixirPipeline, PipelineOptimizer
from elixir.parallel.tensor import is_fused_qkv
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.optimizer import ElixirOptimizer

MeshModel = Union[ElixirModule, ElixirPipeline]
MeshOptimizer = Union[ElixirOptimizer, PipelineOptimizer]
Parts = list[tuple[ElixirModule, Optional[ElixirOptimizer]]]


def mesh_parts(model: MeshModel, optimizer: Optional[MeshOptimizer] = None) -> Parts:
    """This rank's stage modules, each with its optimizer (None without one)."""
    modules = list(model.modules) if isinstance(model, ElixirPipeline) else [model]
    if not all(isinstance(m, ElixirModule) for m in modules):
        raise TypeError("a mesh checkpoint needs the ElixirModule or the ElixirPipeline (the boosted model's "
                        "model.pipeline), not the unwrapped model")
    if optimizer is None:
        return [(m, None) for m in modules]
    opts = list(optimizer.optimizers) if isinstance(optimizer, PipelineOptimizer) else [optimizer]
    if len(opts) != len(modules) or any(o.module is not m for o, m in zip(opts, modules)):
        raise ValueError("the optimizer steps other modules than the model given: pass the model the optimizer was built on")
    return list(zip(modules, opts))


def part_name(em: ElixirModule) -> str:
    """The directory of ``em``'s part: its pipeline stage and tp rank (``stage01-tp00``)."""
    return f"stage{getattr(em.module, 'index', 0):02d}-tp{em.mesh.coordinates.get('tp', 0):02d}"


def _tp_info(em: ElixirModule) -> dict[str, dict]:
    """How each of ``em``'s ``Shard``-placed tensor-parallel parameters is cut, by every name."""
    tpp = em.tensor_parallel
    out: dict[str, dict] = {}
    for name, t in (tpp.by_name.items() if tpp is not None else ()):
        dims = [p.dim for p in t.placements if getattr(p, "dim", None) is not None]
        if t.sharded and dims:
            out[name] = {"shape": list(t.shape), "dim": int(dims[0]), "qkv": t.mesh.size() > 1 and is_fused_qkv(name)}
    return out


def _ties(model: MeshModel, parts: Parts) -> list[list[str]]:
    """The names that are one weight: tied within a module, or across pipeline stages."""
    out = [list(pair) for pair in getattr(model, "tied", [])]
    for em, _ in parts:
        names: dict[int, list[str]] = {}
        for n, p in em.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        out.extend(ns for ns in names.values() if len(ns) > 1)
    return out


def _layout(model: MeshModel) -> dict[str, int]:
    """The layout ``mesh.json`` records; a replica axis is refused (each replica would write the
    same shards, and a load could not tell the replicas' parts apart)."""
    lay = model.layout if isinstance(model, ElixirPipeline) else model.mesh.layout
    if lay.dp_replicate > 1:
        raise CheckpointError(f"a mesh checkpoint has pp, dp_shard and tp axes; this model runs on {lay.describe()}, "
                              "with a replica axis: fold dp_replicate into dp_shard, or save one replica's model "
                              "with elixir.checkpoint.save from a process group of that replica's ranks")
    return {"pp": lay.pp, "dp_shard": lay.dp_shard, "tp": lay.tp}


def save_mesh(path: str, model: MeshModel, optimizer: Optional[MeshOptimizer] = None) -> None:
    """Write ``model``'s (and ``optimizer``'s) mesh checkpoint to the directory ``path``, atomically
    (see the module docstring). Collective over the whole world."""
    parts = mesh_parts(model, optimizer)
    lay = _layout(model)  # before any collective: the layout is the same on every rank
    rank, world = edist.get_rank(), edist.get_world_size()
    mine = {"parts": {part_name(em): {"stage": getattr(em.module, "index", 0), "tp": em.mesh.coordinates.get("tp", 0)}
                      for em, _ in parts},
            "tensor_parallel": {k: v for em, _ in parts for k, v in _tp_info(em).items()}, "ties": _ties(model, parts)}
    with edist.where(f"step {parts[0][0].iteration}, mesh checkpoint save"), \
            atomic.collective_save(path, None, world, rank, markers=(MESH,)) as stage:
        error = None
        for em, eo in parts:  # each part's dp group agrees within: keep going, so every group finishes its own
            try:
                sub = os.path.join(stage.tmp, part_name(em))
                os.makedirs(sub, exist_ok=True)
                error = write_sharded(sub, em, eo, codes=False) or error  # 8-bit moments as fp32: tp cuts re-slice them
            except Exception as e:  # CheckpointError from the part's own agreement, or this rank's failure
                error = error or f"writing part {part_name(em)} failed: {type(e).__name__}: {e}"
        metas = agree(None, world, error, mine)
        if rank == 0:
            try:
                atomic_write_json(os.path.join(stage.tmp, MESH), _merge(metas, lay))
            except OSError as e:
                stage.error = f"writing {MESH} failed: {e}"


def _merge(metas: list[dict], lay: dict[str, int]) -> dict:
    out: dict[str, Any] = {"format": MESH_FORMAT, "version": MESH_VERSION, "layout": lay, "parts": {},
                           "tensor_parallel": {}, "ties": []}
    for m in metas:
        out["parts"].update(m["parts"])
        out["tensor_parallel"].update(m["tensor_parallel"])
        out["ties"].extend(t for t in m["ties"] if t not in out["ties"])
    return out


def load_mesh(path: str, model: MeshModel, optimizer: Optional[MeshOptimizer] = None, strict: bool = True) -> None:
    """Load a mesh checkpoint (or a plain sharded one) saved at any layout into ``model`` and
    ``optimizer`` (see the module docstring). Collective over the whole world; nothing is changed
    unless every rank read everything it needs."""
    parts = mesh_parts(model, optimizer)
    where = f"step {parts[0][0].iteration}, mesh checkpoint load"
    with edist.where(where), contextlib.ExitStack() as stack:
        mapped = [stack.enter_context(disk_mapped(em.disk_store, eo.fragment_states if eo is not None else None,
                                                  writable=True)) for em, eo in parts]
        plans, error = [], None
        try:
            source = MeshSource(atomic.resolve(path))
            plans = [read_part(source, em, eo, m, strict) for (em, eo), m in zip(parts, mapped)]
        except CheckpointError as e:
            error = str(e)
        except Exception as e:
            error = f"reading the mesh checkpoint failed: {type(e).__name__}: {e}"
        agree(None, edist.get_world_size(), error)
        for (em, eo), m, plan in zip(parts, mapped, plans):
            commit_load(em, eo, plan, m)


def _check_model(source: MeshSource, em: ElixirModule, strict: bool) -> None:
    problems, missing = [], []
    fp = layout.fingerprint(em)
    for kind in ("params", "frozen"):
        for name, local in fp.get(kind, {}).items():
            saved, here = source.shape(kind, name), full_shape(em, name, local)
            if saved is None:
                missing.append(name)
            elif list(saved) != here:
                problems.append(f"{name}: {saved} saved, {here} here")
    if problems:
        raise CheckpointError("the checkpoint does not match this model (another model's checkpoint?): shapes differ: "
                              + "; ".join(problems[:5]))
    if strict and missing:
        raise CheckpointError(f"parameters missing from the checkpoint: {missing[:5]} (another model's checkpoint? "
                              "load with strict=False to leave them as they are)")


def _groups(source: MeshSource, em: ElixirModule, eo: ElixirOptimizer) -> list[dict]:
    """The saved param groups' hyper-parameters, after checking each of this optimizer's
    parameters sits in the group of the same index as when saved."""
    if not source.has_optimizer:
        raise CheckpointError("the checkpoint holds no optimizer state; load the model without the optimizer")
    current = layout.optimizer_meta(eo, em)["param_groups"]
    if len(current) != len(source.groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(source.groups)} param groups, this one "
                              f"{len(current)}: build the optimizer with the param groups it was saved with")
    for gi, g in enumerate(current):
        moved = [n for n in g["params"] if source.group_of.get(source.saved_name(n), gi) != gi]
        if moved:
            raise CheckpointError(f"param group {gi} holds {moved[:3]}, which the checkpoint has in another group: build "
                                  "the optimizer with the param groups it was saved with")
    return [dict(g, params=[]) for g in source.groups]


def read_part(source: MeshSource, em: ElixirModule, eo: Optional[ElixirOptimizer], mapped: dict[int, torch.Tensor],
              strict: bool = True) -> dict:
    """Everything ``em`` (and ``eo``) need from ``source``, read but not installed: the plan
    :func:`~elixir.checkpoint.install.commit_load` takes."""
    _check_model(source, em, strict)
    values, frozen = [], []
    for f in layout.fragments(em, eo, mapped):
        name, start, end = layout.frag_range(em, f)
        if source.shape("params", name) is not None:
            values.append((f, source.values("param", "params", name, start, end, target_cut(em, name))))
    for p in layout.frozen_pieces(em):
        if source.shape("frozen", p.name) is not None:
            frozen.append((p, source.values("frozen", "frozen", p.name, p.start, p.end, target_cut(em, p.name))))
    module = {}
    for k, t in layout.module_tensors(em).items():
        v = source.module_tensor(k, t.dtype)
        if v is not None:
            module[k] = v
    opt = None
    if eo is not None:
        groups = _groups(source, em, eo)
        state = []
        for f in eo.fragments:
            name, start, end = layout.frag_range(em, f)
            st = source.state(name, start, end, target_cut(em, name))
            if st is not None:
                state.append((f, st))
        opt = {"state": state, "groups": groups}
    return {"values": values, "frozen": frozen, "module": module, "opt": opt, "scaler": source.loss_scaler, "extra": None}
