"""Read a checkpoint into full tensors offline: no model, no process group."""

from __future__ import annotations

import os
from typing import Any

import torch

from elixir.checkpoint import atomic
from elixir.checkpoint.format import Reader, dtype_of
from elixir.checkpoint.index import Index, decode
from elixir.checkpoint.load import load_extra, scalar_state
from elixir.checkpoint.mesh_source import MESH, consolidate_mesh


def consolidate(path: str) -> dict[str, Any]:
    """Read a checkpoint (sharded or full) into full tensors in this process, with no model and no
    process group: ``{"model": state dict (canonical names; fp32 params, buffers, frozen params
    in their saved dtype),
    "optimizer": torch-format state dict or None, "loss_scaler": ..., "extra": ...}``. The
    optimizer dict is indexed like the optimizer that was saved, so it loads into a plain torch
    optimizer built the same way on the unwrapped model. A mesh checkpoint
    (:func:`~elixir.checkpoint.save_mesh`) comes back by name instead (:func:`~elixir.checkpoint.mesh_source.consolidate_mesh`)."""
    root = atomic.resolve(path)
    if os.path.isfile(os.path.join(root, MESH)):  # saved on a mesh: whole tensors by Hugging Face name
        return consolidate_mesh(root)
    index = Index.read(root)
    reader = Reader(root, lambda fname: index.check(root, fname))
    if index.kind == "full":
        h = reader.handle("model.safetensors")
        model = {k: h.get_tensor(k) for k in h.keys()}
        optim = None
        if index.optimizer is not None:
            index.check(root, "optimizer.pt")
            optim = torch.load(os.path.join(root, "optimizer.pt"), map_location="cpu", weights_only=True)
        return {"model": model, "optimizer": optim, "loss_scaler": index.loss_scaler, "extra": load_extra(root, index)}
    pieces = index.pieces()
    model: dict[str, torch.Tensor] = {}
    shapes = index.model["params"]
    for name, shape in shapes.items():
        numel = int(torch.Size(shape).numel())
        found = pieces.get(("param", name), [])
        saved = dtype_of(found[0].dtype) if found else torch.float32  # fp32, or a bf16 master (issue 33): widened exactly
        model[name] = reader.assemble(found, 0, numel, saved, f"parameter {name}").float().view(shape)
    for name, shape in index.model.get("frozen", {}).items():  # frozen chunks' weights, in their saved dtype
        found = pieces.get(("frozen", name), [])
        numel = int(torch.Size(shape).numel())
        model[name] = reader.assemble(found, 0, numel, dtype_of(found[0].dtype) if found else torch.float32,
                                      f"frozen parameter {name}").view(shape)
    for e in index.entries:
        if e.kind == "module":
            model[e.name] = reader.read(e.file, e.key, dtype_of(e.dtype)).view(e.shape)
    optim = None
    if index.optimizer is not None:
        meta = index.optimizer
        state: dict[int, dict] = {}
        groups = []
        idx = 0
        for g in meta["param_groups"]:
            ids = []
            for name in g["params"]:
                sc = meta["scalars"].get(name)
                if sc:
                    numel = int(torch.Size(shapes[name]).numel())
                    st = scalar_state(reader, pieces, sc, name, 0, numel)
                    state[idx] = {k: (v.view(shapes[name]) if k not in sc else v) for k, v in st.items()}
                ids.append(idx)
                idx += 1
            groups.append({**{k: decode(v) for k, v in g.items() if k != "params"}, "params": ids})
        optim = {"state": state, "param_groups": groups}
    return {"model": model, "optimizer": optim, "loss_scaler": index.loss_scaler, "extra": load_extra(root, index)}
