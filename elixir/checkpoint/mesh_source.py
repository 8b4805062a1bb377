"""A mesh checkpoint read back as logical tensors: every part (one pipeline stage at one tp rank)
of the layout it was saved at, put together per parameter, and cut again for the reading rank.

A part is an elixir sharded checkpoint of one stage module (:mod:`elixir.checkpoint.save`): its
entries name parameters by their Hugging Face names and give ``[start, end)`` ranges in the
flattened *local* tensor, which for a tensor-parallel parameter is that tp rank's shard.
``mesh.json`` says how each such parameter was sharded (full shape, ``Shard`` dimension, GPT-2's
fused ``c_attn`` reordered by tp rank). A value the reader needs cut as it was saved (the same tp
split, or no tp on either side) is read as the sharded loader reads it: only the ranges asked
for, from the saved shard of the reader's own tp rank. Otherwise the parameter (or one state tensor of it) is put together whole from
the saved tp shards, one tensor at a time, and this rank's shard is cut from it.

A plain elixir sharded checkpoint (``index.json`` and no ``mesh.json``) reads as a mesh
checkpoint of one part with no tensor axis, so a single-module checkpoint loads into a
tensor-parallel or pipelined model too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.tensor import Shard

from elixir.checkpoint.errors import CheckpointError
from elixir.checkpoint.format import Reader, dtype_of
from elixir.checkpoint.index import INDEX, Entry, Index, decode
from elixir.parallel.tensor import is_fused_qkv, qkv_from_tp_order, qkv_into_tp_order
from elixir.wrapper.module import ElixirModule

MESH = "mesh.json"
"""The file that marks a mesh checkpoint and describes its parts."""
MESH_FORMAT = "elixir-mesh-checkpoint"
MESH_VERSION = 1



@dataclass(frozen=True)
class Cut:
    """How the reading rank cuts its shard of parameter ``name`` from the whole tensor: piece
    ``rank`` of ``parts`` along ``dim`` (as DTensor's ``Shard`` cuts: ``torch.chunk``), GPT-2's
    fused ``c_attn`` first put in tp order."""

    name: str
    parts: int
    rank: int
    dim: int

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        if self.parts > 1 and is_fused_qkv(self.name):
            full = qkv_into_tp_order(full, self.parts)
        pieces = torch.chunk(full, self.parts, self.dim)
        return pieces[self.rank] if self.rank < len(pieces) else full.narrow(self.dim, 0, 0)

    def as_saved(self, info: Optional[dict], saved_tp: int) -> bool:
        """The checkpoint cut this parameter the same way (so this rank's shard is one saved part)."""
        return info is not None and saved_tp == self.parts and int(info["dim"]) == self.dim


def read_meta(root: str) -> dict:
    """``mesh.json`` of the checkpoint at ``root``, or the description of a plain sharded
    checkpoint as a mesh checkpoint of one part."""
    mpath = os.path.join(root, MESH)
    if not os.path.isfile(mpath):
        if not os.path.isfile(os.path.join(root, INDEX)):
            raise CheckpointError(
                f"{root} has neither {MESH} nor {INDEX}: not an elixir checkpoint, or an incomplete one (a directory of "
                "stageNN-tpNN folders without mesh.json was written by an older save_optimizer: load each folder with "
                "elixir.checkpoint.load at the layout it was saved at)")
        return {"layout": {"pp": 1, "dp_shard": 1, "tp": 1}, "parts": {".": {"stage": 0, "tp": 0}},
                "tensor_parallel": {}, "ties": []}
    try:
        with open(mpath) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath} is unreadable or truncated ({e})") from None
    if meta.get("format") != MESH_FORMAT or meta.get("version") != MESH_VERSION:
        raise CheckpointError(f"{mpath} is not a version-{MESH_VERSION} elixir mesh checkpoint description")
    if int(meta.get("layout", {}).get("dp_replicate", 1)) > 1:
        raise CheckpointError(f"{mpath} records a replica axis (dp_replicate {meta['layout']['dp_replicate']}): elixir's mesh "
                              "checkpoints have pp, dp_shard and tp axes only; save it again with dp_replicate folded "
                              "into dp_shard")
    return meta


def target_cut(em: ElixirModule, name: str) -> Optional[Cut]:
    """How ``em`` cuts its local shard of parameter ``name`` from the whole tensor (None: it holds
    the whole tensor)."""
    tpp = em.tensor_parallel
    t = tpp.by_name.get(name) if tpp is not None else None
    if t is None or not t.sharded:
        return None
    return Cut(name, t.mesh.size(), t.mesh.get_local_rank(), next(p.dim for p in t.placements if isinstance(p, Shard)))


def full_shape(em: ElixirModule, name: str, local: list[int]) -> list[int]:
    """The logical shape of ``em``'s parameter ``name`` (``local`` unless it is a DTensor shard)."""
    tpp = em.tensor_parallel
    t = tpp.by_name.get(name) if tpp is not None else None
    return list(t.shape) if t is not None else list(local)


class MeshSource:
    """Every part of a mesh checkpoint, indexed by parameter name (see the module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.meta = read_meta(root)
        self.tp_info: dict[str, dict] = self.meta.get("tensor_parallel", {})
        self.saved_tp = int(self.meta["layout"].get("tp", 1))
        self.indexes: dict[str, Index] = {}
        self.readers: dict[str, Reader] = {}
        # (kind or state key, name) -> {tp rank: (part, entries)}; (kind, name) -> {tp rank: local shape}
        self.pieces: dict[tuple[str, str], dict[int, tuple[str, list[Entry]]]] = {}
        self.shapes: dict[tuple[str, str], dict[int, list[int]]] = {}
        self.module: dict[str, tuple[str, Entry]] = {}
        self.scalars: dict[str, dict] = {}
        self.groups: list[dict] = []
        self.group_of: dict[str, int] = {}
        self.loss_scaler: Optional[dict] = None
        for part, where in self.meta["parts"].items():
            self._add_part(part, int(where["tp"]))
        self.alias = self._aliases()
        self._cache: tuple[Any, Optional[torch.Tensor]] = (None, None)

    def _add_part(self, part: str, tp: int) -> None:
        pdir = os.path.normpath(os.path.join(self.root, part))
        index = Index.read(pdir)
        if index.kind != "sharded":
            raise CheckpointError(f"part {part} of the mesh checkpoint is a full checkpoint; mesh checkpoints are sharded")
        self.indexes[part] = index
        self.readers[part] = Reader(pdir, lambda fname, i=index, d=pdir: i.check(d, fname))
        for kind in ("params", "frozen"):
            for name, shape in index.model.get(kind, {}).items():
                self.shapes.setdefault((kind, name), {})[tp] = list(shape)
        for (key, name), entries in index.pieces().items():
            self.pieces.setdefault((key, name), {}).setdefault(tp, (part, []))[1].extend(entries)
        for e in index.entries:
            if e.kind == "module":
                self.module.setdefault(e.name, (part, e))
        opt = index.optimizer
        if opt is not None:
            for name, sc in opt.get("scalars", {}).items():
                self.scalars.setdefault(name, sc)
            for gi, g in enumerate(opt["param_groups"]):
                if gi == len(self.groups):
                    self.groups.append({k: decode(v) for k, v in g.items() if k != "params"})
                for name in g["params"]:
                    self.group_of.setdefault(name, gi)
            self.loss_scaler = self.loss_scaler or index.loss_scaler

    def _aliases(self) -> dict[str, str]:
        """Each name of a tied group -> a name the checkpoint holds it under."""
        out = {}
        held = {name for (_, name) in self.shapes}
        for group in self.meta.get("ties", []):
            saved = next((n for n in group if n in held), None)
            if saved is not None:
                out.update({n: saved for n in group if n not in held})
        return out

    @property
    def has_optimizer(self) -> bool:
        return any(i.optimizer is not None for i in self.indexes.values())

    def saved_name(self, name: str) -> str:
        return self.alias.get(name, name)

    def shape(self, kind: str, name: str) -> Optional[list[int]]:
        """The logical (whole) shape the checkpoint holds ``name`` at, or None."""
        name = self.saved_name(name)
        info = self.tp_info.get(name)
        if info is not None:
            return list(info["shape"])
        local = self.shapes.get((kind, name))
        return next(iter(local.values())) if local else None

    def values(self, key: str, kind: str, name: str, start: int, end: int, cut: Optional[Cut],
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the reading rank's flattened local ``name`` (``key``:
        ``"param"``, ``"frozen"`` or a state key; ``kind``: ``"params"`` or ``"frozen"``, whose
        shapes it has), in the saved dtype or ``dtype``."""
        name = self.saved_name(name)
        src = self.pieces.get((key, name))
        what = f"{'parameter' if key == 'param' else key} of {name}"
        if not src:
            raise CheckpointError(f"{what} is missing from the checkpoint")
        info = self.tp_info.get(name)
        mine = cut.rank if cut is not None and cut.as_saved(info, self.saved_tp) else None
        if mine is not None and mine not in src:
            raise CheckpointError(f"{what}: the shard of tp rank {mine} is missing from the checkpoint (an incomplete copy?)")
        part, entries = src[mine if mine is not None else min(src)]
        dtype = dtype or dtype_of(entries[0].dtype)
        if mine is not None or (cut is None and info is None):  # cut as saved: only the ranges asked for
            return self.readers[part].assemble(entries, start, end, dtype, what)
        whole = self._whole(key, kind, name, dtype, what)
        local = cut(whole) if cut is not None else whole
        return local.reshape(-1)[start:end].clone()

    def _whole(self, key: str, kind: str, name: str, dtype: torch.dtype, what: str) -> torch.Tensor:
        """The whole tensor ``name`` (``key``), put together from its saved tp shards; the last one
        is kept (a parameter's fragments ask for it again)."""
        if self._cache[0] == (key, name, dtype):
            return self._cache[1]
        src, shapes = self.pieces[(key, name)], self.shapes.get((kind, name), {})
        info = self.tp_info.get(name)
        ranks = range(self.saved_tp) if info is not None else [min(src)]
        locals_ = []
        for r in ranks:
            if r not in src or r not in shapes:
                raise CheckpointError(f"{what}: the shard of tp rank {r} is missing from the checkpoint (an incomplete copy?)")
            part, entries = src[r]
            numel = int(torch.Size(shapes[r]).numel())
            locals_.append(self.readers[part].assemble(entries, 0, numel, dtype, what).view(shapes[r]))
        whole = locals_[0]
        if info is not None:
            whole = torch.cat(locals_, dim=int(info["dim"]))
            if info.get("qkv"):
                whole = qkv_from_tp_order(whole, self.saved_tp)
        self._cache = ((key, name, dtype), whole)
        return whole

    def whole(self, key: str, kind: str, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (``key``: ``"param"``, ``"frozen"`` or a state key), in its saved dtype."""
        src = self.pieces.get((key, name))
        if not src:
            raise CheckpointError(f"{key} of {name} is missing from the checkpoint")
        return self._whole(key, kind, name, dtype_of(src[min(src)][1][0].dtype), f"{key} of {name}")

    def state(self, name: str, start: int, end: int, cut: Optional[Cut]) -> Optional[dict]:
        """Parameter ``name``'s optimizer state over ``[start, end)`` of the local tensor, in the
        saved key order; None when it has none."""
        sc = self.scalars.get(self.saved_name(name))
        if not sc:
            return None
        return {k: decode(sc[k]) if k in sc else self.values(k, "params", name, start, end, cut)
                for k in sc["__order__"]}

    def module_tensor(self, name: str, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A buffer (or a parameter kept out of chunks), whole, or None when not saved."""
        found = self.module.get(name)
        if found is None:
            return None
        part, e = found
        return self.readers[part].read(e.file, e.key, dtype)


def consolidate_mesh(root: str) -> dict[str, Any]:
    """A mesh checkpoint as whole tensors (:func:`elixir.checkpoint.consolidate`): ``model`` by
    Hugging Face name (fp32 masters, frozen weights and buffers in their saved dtypes), and
    ``optimizer`` as ``{"state": {name: {key: whole tensor or scalar}}, "param_groups": [...]}``
    (each group's ``params`` are names)."""
    src = MeshSource(root)
    model: dict[str, torch.Tensor] = {}
    for kind, name in src.shapes:
        key = "param" if kind == "params" else "frozen"
        if (key, name) in src.pieces:
            model[name] = src.whole(key, kind, name).clone()
    for name, (part, e) in src.module.items():
        model[name] = src.readers[part].read(e.file, e.key, dtype_of(e.dtype)).view(e.shape)
    optim = None
    if src.has_optimizer:
        state = {name: {k: decode(sc[k]) if k in sc else src.whole(k, "params", name).clone() for k in sc["__order__"]}
                 for name, sc in src.scalars.items() if sc}
        names = [[n for n, gi in src.group_of.items() if gi == i] for i in range(len(src.groups))]
        optim = {"state": state, "param_groups": [dict(g, params=ns) for g, ns in zip(src.groups, names)]}
    return {"model": model, "optimizer": optim, "loss_scaler": src.loss_scaler, "extra": None}
