"""Read a checkpoint back, at any world size and with any plan: validate and read everything on
every rank first, agree, and only then modify the model and optimizer."""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch

from elixir import distributed as edist
from elixir.checkpoint import atomic, layout, quantised
from elixir.checkpoint.errors import CheckpointError, agree
from elixir.checkpoint.format import Reader, dtype_of
from elixir.checkpoint.index import Index, decode
from elixir.checkpoint.install import commit_load
from elixir.checkpoint.mesh import load_mesh
from elixir.checkpoint.mesh_source import MESH
from elixir.offload.pipeline import disk_mapped
from elixir.wrapper import lowbit_state, optim_state
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.optimizer import ElixirOptimizer


def load(path: str, model: ElixirModule, optimizer: Optional[ElixirOptimizer] = None, strict: bool = True) -> Any:
    """Load a checkpoint written by :func:`~elixir.checkpoint.save` (at any world size, with any
    plan) into ``model`` and ``optimizer``; return the saved ``extra`` (None if none). Collective:
    call on every rank. Nothing is modified unless every rank validated and read everything it needs.
    A mesh checkpoint (:func:`~elixir.checkpoint.save_mesh`, any tensor/pipeline layout) is read
    at this module's layout (:func:`~elixir.checkpoint.load_mesh`)."""
    if not isinstance(model, ElixirModule):
        raise TypeError("checkpoint.load needs the ElixirModule")
    if _is_mesh(path):  # saved on a device mesh (save_mesh): read at this module's layout
        load_mesh(path, model, optimizer, strict)
        return None
    em = model
    states = optimizer.fragment_states if optimizer is not None else None
    with edist.where(f"step {em.iteration}, checkpoint load"), \
            disk_mapped(em.disk_store, states, writable=True) as mapped:  # disk-placed masters: mapped, written in place
        plan = _load_staged(path, em, optimizer, strict, mapped)
    return plan["extra"]


def _is_mesh(path: str) -> bool:
    try:
        return os.path.isfile(os.path.join(atomic.resolve(path), MESH))
    except CheckpointError:  # no checkpoint there: the sharded path says so
        return False


def _load_staged(path: str, em: ElixirModule, optimizer: Optional[ElixirOptimizer], strict: bool,
                 mapped: dict[int, torch.Tensor]) -> dict:
    error = None
    plan = None
    try:
        root = atomic.resolve(path)
        index = Index.read(root, check_files=False)
        _check_model(index, em, strict)  # first: an index from another model is named as such
        index.check_present(root)
        if optimizer is not None and index.optimizer is None:
            raise CheckpointError("the checkpoint holds no optimizer state; call load(path, model) without the optimizer")
        plan = (_prepare_sharded if index.kind == "sharded" else _prepare_full)(root, index, em, optimizer, mapped)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:
        error = f"reading the checkpoint failed: {type(e).__name__}: {e}"
    agree(em.group, em.world_size, error)
    commit_load(em, optimizer, plan, mapped)
    return plan


def _check_model(index: Index, em: ElixirModule, strict: bool) -> None:
    mine = layout.fingerprint(em)
    theirs = index.model
    problems = []
    if "frozen" in theirs:  # frozen weights saved (an adapter-only checkpoint has none)
        a, b = theirs["frozen"], mine.get("frozen", {})
        shapes = [f"{n}: {a[n]} saved, {b[n]} here" for n in b if n in a and list(a[n]) != list(b[n])]
        if shapes:
            problems.append("frozen shapes differ: " + "; ".join(shapes[:5]))
    for kind in ("params", "tensors"):
        a, b = theirs.get(kind, {}), mine[kind]
        missing = [n for n in b if n not in a]
        unexpected = [n for n in a if n not in b]
        shapes = [f"{n}: {a[n]} saved, {b[n]} here" for n in b if n in a and list(a[n]) != list(b[n])]
        if shapes:
            problems.append("shapes differ: " + "; ".join(shapes[:5]))
        if strict and (missing or unexpected):
            problems.append(f"{kind} missing from the checkpoint {missing[:5]}, unknown to the model {unexpected[:5]}")
    if problems:
        raise CheckpointError(
            "the checkpoint does not match this model (another model's checkpoint?): " + " | ".join(problems)
        )


def _group_check(index: Index, eo: ElixirOptimizer, em: ElixirModule) -> list[dict]:
    saved_cls, cls = index.optimizer.get("class"), type(eo.optim).__name__
    if saved_cls != cls:
        warnings.warn(
            f"elixir: optimizer state saved by {saved_cls} is loaded into {cls}; its state keys must mean the "
            "same (e.g. CPUAdam <-> AdamW)", stacklevel=4,
        )
    lowbit_state.warn_format_change(index.optimizer.get("state_format"), eo, "checkpoint load")
    saved = index.optimizer["param_groups"]
    current = layout.optimizer_meta(eo, em)["param_groups"]
    if len(saved) != len(current):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} param groups, this one {len(current)}")
    for gi, (s, c) in enumerate(zip(saved, current)):
        if s["params"] != c["params"]:
            diff = [n for n in s["params"] if n not in c["params"]][:3] + [n for n in c["params"] if n not in s["params"]][:3]
            raise CheckpointError(f"param group {gi} holds other parameters in the checkpoint than here (e.g. {diff}, or another order)")
    return [{k: decode(v) for k, v in g.items()} for g in saved]


def load_extra(root: str, index: Index) -> Any:
    """The ``extra`` saved with the checkpoint, or None."""
    if not index.extra:
        return None
    index.check(root, "extra.pt")
    try:
        return torch.load(os.path.join(root, "extra.pt"), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"extra.pt is unreadable: {e}") from None


def scalar_state(reader: Reader, pieces: dict, scalars: dict, pname: str, start: int, end: int,
                 keep_codes: bool = False) -> dict:
    """One parameter's optimizer state over ``[start, end)`` of it, in the saved key order. 8-bit
    moments come as saved (codes and block scales) when ``keep_codes`` and the range is a saved
    piece's, else as the fp32 values they decode to (:mod:`elixir.checkpoint.quantised`)."""
    st = {}
    q = quantised.read_moments(reader, pieces, pname, start, end, keep_codes) if quantised.is_quantised(pieces, pname) else None
    for k in scalars["__order__"]:
        if k in scalars:
            st[k] = decode(scalars[k])
        elif q is not None and k in quantised.QUANT_KEYS:
            if k in q:
                st[k] = q[k]
        else:
            found = pieces.get((k, pname), [])
            if not found:
                raise CheckpointError(f"optimizer state {k!r} of {pname} is missing from the checkpoint")
            st[k] = reader.assemble(found, start, end, dtype_of(found[0].dtype), f"state {k} of {pname}")
    return st


def _prepare_sharded(root: str, index: Index, em: ElixirModule, eo: Optional[ElixirOptimizer],
                     mapped: dict[int, torch.Tensor]) -> dict:
    reader = Reader(root, lambda fname: index.check(root, fname))
    pieces = index.pieces()
    module_entries = {e.name: e for e in index.entries if e.kind == "module"}
    saved_params = index.model["params"]
    values = []  # (fragment, fp32 values)
    for f in layout.fragments(em, eo, mapped):
        pname, start, end = layout.frag_range(em, f)
        if pname not in saved_params:
            continue  # strict=False
        found = pieces.get(("param", pname), [])
        saved = dtype_of(found[0].dtype) if found else torch.float32  # fp32, or a bf16 master (issue 33)
        values.append((f, reader.assemble(found, start, end, saved, f"parameter {pname}")))
    frozen = []  # (frozen piece, values in the saved dtype)
    for fp in layout.frozen_pieces(em) if "frozen" in index.model else ():
        found = pieces.get(("frozen", fp.name), [])
        if not found:
            continue  # strict=False, or a name the checkpoint does not hold
        frozen.append((fp, reader.assemble(found, fp.start, fp.end, dtype_of(found[0].dtype), f"frozen parameter {fp.name}")))
    module_vals = {}
    for k, t in layout.module_tensors(em).items():
        e = module_entries.get(k)
        if e is None:
            continue
        module_vals[k] = reader.read(e.file, e.key, t.dtype)
    opt = None
    if eo is not None:
        groups = _group_check(index, eo, em)
        scalars = index.optimizer["scalars"]
        new_state = []
        for f in eo.fragments:
            pname, start, end = layout.frag_range(em, f)
            sc = scalars.get(pname)
            if sc:
                new_state.append((f, scalar_state(reader, pieces, sc, pname, start, end, keep_codes=True)))
        opt = {"state": new_state, "groups": groups}
    return {"values": values, "frozen": frozen, "module": module_vals, "opt": opt, "scaler": index.loss_scaler,
            "extra": load_extra(root, index)}


def _prepare_full(root: str, index: Index, em: ElixirModule, eo: Optional[ElixirOptimizer],
                  mapped: dict[int, torch.Tensor]) -> dict:
    reader = Reader(root, lambda fname: index.check(root, fname))
    h = reader.handle("model.safetensors")
    keys = set(h.keys())

    def key_of(name: str) -> str:
        k = index.aliases.get(name, name)
        if k not in keys:
            raise CheckpointError(f"{name} is missing from model.safetensors")
        return k

    values = []
    for f in layout.fragments(em, eo, mapped):
        pname, start, end = layout.frag_range(em, f)
        if pname not in index.model["params"]:
            continue  # strict=False
        values.append((f, reader.read_flat("model.safetensors", key_of(pname), torch.float32, start, end)))
    frozen = []
    for fp in layout.frozen_pieces(em) if "frozen" in index.model else ():
        k = key_of(fp.name)
        frozen.append((fp, reader.read_flat("model.safetensors", k, reader.dtype("model.safetensors", k), fp.start, fp.end)))
    module_vals = {k: reader.read("model.safetensors", key_of(k), t.dtype) for k, t in layout.module_tensors(em).items()}
    opt = None
    if eo is not None:
        _group_check(index, eo, em)
        index.check(root, "optimizer.pt")
        try:
            osd = torch.load(os.path.join(root, "optimizer.pt"), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointError(f"optimizer.pt is unreadable or truncated: {e}") from None
        try:
            optim_state.check_groups(eo, osd["param_groups"])
        except optim_state.OptimStateMismatch as e:
            raise CheckpointError(str(e)) from None
        opt = {"full": osd}
    return {"values": values, "frozen": frozen, "module": module_vals, "opt": opt, "scaler": index.loss_scaler,
            "extra": load_extra(root, index)}
