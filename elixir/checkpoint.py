"""Checkpoints of an ElixirModule and its ElixirOptimizer: sharded or full, atomic, reshardable.

``save(path, model, optimizer, extra=None, shard=True)`` and ``load(path, model, optimizer)``
(collective: call both on every rank; ``path`` must be on a file system every rank sees).

**Sharded** (``shard=True``): every rank writes ``rank{r}-of-{W}.safetensors`` holding its fp32
master slices and the matching elementwise optimizer state, each under a key naming the parameter
and the *global* ``[start, end)`` range it covers in the flattened parameter; replicated chunks,
frozen parameters and buffers are written once, by rank 0. Rank 0 writes ``index.json``: every
tensor's file, key, range and dtype, file sizes, a fingerprint of the model (names and shapes), the
optimizer's param groups by parameter name with its scalar state (``step``), the loss scaler, and
whether ``extra.pt`` exists. Loading reassembles whatever ranges the current plan needs, so a
checkpoint saved at world size N (or with another plan) loads at world size M.

**Full** (``shard=False``): rank 0 writes ``model.safetensors`` (Hugging Face compatible: tied
weights once, under the first name, as ``save_pretrained`` does; ``config.json`` too when the
model has a HF config), ``optimizer.pt`` (a torch optimizer state dict that loads into a plain
torch optimizer on the unwrapped model) and ``index.json``.

**Atomic**: everything goes into a temporary directory beside ``path``; files and directory are
fsynced, then the directory is renamed into place (an older checkpoint at ``path`` is first
renamed aside and removed after). A crash at any moment leaves the previous checkpoint loadable:
if it falls between the two renames, :func:`load` finds the renamed-aside copy.

**Bad input** (missing or truncated files, another model's checkpoint, a dtype that is not the
saved one, mismatched optimizer groups) raises :class:`CheckpointError` on every rank before
anything in the model or optimizer is modified.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from collections import defaultdict
from typing import Any, Optional

import torch

from elixir import distributed as edist
from elixir.offload.pipeline import disk_mapped
from elixir.wrapper import optim_state
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.optimizer import ElixirOptimizer

__all__ = ["CheckpointError", "save", "load", "consolidate", "FORMAT", "VERSION"]

FORMAT = "elixir-checkpoint"
VERSION = 1
INDEX = "index.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked; the message names the problem and fix."""


# --------------------------------------------------------------------------------------------
# small helpers


def _dtype_str(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint index")
    return dt


def _encode(v: Any, what: str) -> Any:
    """JSON form of a hyper-parameter or scalar state value."""
    if isinstance(v, torch.Tensor):
        return {"__tensor__": v.detach().cpu().tolist(), "dtype": _dtype_str(v.dtype)}
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x, what) for x in v]}
    if isinstance(v, list):
        return [_encode(x, what) for x in v]
    if isinstance(v, dict):
        return {"__dict__": [[_encode(k, what), _encode(x, what)] for k, x in v.items()]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise CheckpointError(f"cannot store {what} of type {type(v).__name__} in a checkpoint index")


def _decode(v: Any) -> Any:
    if isinstance(v, dict):
        if "__tensor__" in v:
            return torch.tensor(v["__tensor__"], dtype=_dtype(v["dtype"]))
        if "__tuple__" in v:
            return tuple(_decode(x) for x in v["__tuple__"])
        if "__dict__" in v:
            return {_decode(k): _decode(x) for k, x in v["__dict__"]}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def _check_extra(obj: Any, where: str = "extra") -> None:
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _check_extra(x, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, x in obj.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where} has a key of type {type(k).__name__}; use str or int keys")
            _check_extra(x, f"{where}[{k!r}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__name__}; extra may hold only dicts, lists, tuples, tensors, numbers, "
        "strings and None (store e.g. a scheduler's state_dict(), not the scheduler)"
    )


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


_ST_CODES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> int:
    """Write ``tensors`` as a safetensors file straight from their memory (views included: no
    staging copy), fsync it, and return its size. The layout is the safetensors format: an 8-byte
    little-endian header length, the JSON header (padded to 8 bytes), then the raw data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        code = _ST_CODES.get(t.dtype)
        if code is None:
            raise CheckpointError(f"cannot store {name!r} of dtype {t.dtype} in safetensors")
        t = t.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        blobs.append(t)
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t in blobs:
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    return os.path.getsize(path)


def _agree(em: ElixirModule, error: Optional[str]) -> None:
    """Raise CheckpointError on every rank if any rank reports an error (one collective)."""
    errors = edist.all_gather_object(error, em.group) if em.world_size > 1 else [error]
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        raise CheckpointError(e if em.world_size == 1 else f"rank {r}: {e}")


def _aside_names(path: str) -> tuple[str, str]:
    parent, name = os.path.split(os.path.abspath(path))
    return parent, name


def _fingerprint(em: ElixirModule) -> dict:
    return {
        "params": {s.name: list(s.shape) for s in em.slots},
        "tensors": {k: list(v.shape) for k, v in _module_tensors(em).items()},
    }


def _module_tensors(em: ElixirModule) -> dict[str, torch.Tensor]:
    """State-dict entries not held in chunks (frozen params, buffers), once each, by first key."""
    managed = {id(p) for p in em.params}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, t in em.module.state_dict(keep_vars=True).items():
        if id(t) in managed or id(t) in seen:
            continue
        seen.add(id(t))
        out[k] = t
    return out


def _frag_range(em: ElixirModule, f) -> tuple[str, int, int]:
    start = optim_state.fragment_start(em, f)
    return em.slots[f.param_index].name, start, start + (f.hi - f.lo)


def _writes_fragment(em: ElixirModule, f) -> bool:
    """Replicated chunks are identical everywhere: only rank 0 writes them."""
    return em.chunks[f.chunk].spec.sharded or em.rank == 0


def _optimizer_meta(eo: ElixirOptimizer, em: ElixirModule) -> dict:
    frozen_names = {id(p): n for n, p in em.module.named_parameters()}
    groups = []
    for group, entries in zip(eo.optim.param_groups, eo.layout.groups):
        g = {k: _encode(v, f"hyper-parameter {k!r}") for k, v in group.items() if k not in ("params", "param_names")}
        g["params"] = [em.slots[e].name if isinstance(e, int) else frozen_names.get(id(e), "?") for e in entries]
        groups.append(g)
    return {"class": type(eo.optim).__name__, "param_groups": groups}


# --------------------------------------------------------------------------------------------
# save


def save(
    path: str,
    model: ElixirModule,
    optimizer: Optional[ElixirOptimizer] = None,
    extra: Any = None,
    shard: bool = True,
) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``, ``extra``) to the directory ``path``,
    atomically. Collective: call on every rank. See the module docstring for the layout."""
    if not isinstance(model, ElixirModule):
        raise TypeError("checkpoint.save needs the ElixirModule")
    if optimizer is not None and optimizer.module is not model:
        raise ValueError("the optimizer wraps another ElixirModule than the model given")
    _check_extra(extra)
    em = model
    parent, name = _aside_names(path)
    tmp = None
    error = None
    if em.rank == 0:
        try:
            target = os.path.join(parent, name)
            if os.path.exists(target) and not os.path.isfile(os.path.join(target, INDEX)):
                raise CheckpointError(
                    f"{target} exists and is not an elixir checkpoint (no {INDEX}); refusing to replace it — "
                    "choose another path or remove it yourself"
                )
            os.makedirs(parent, exist_ok=True)
            debris = glob.glob(os.path.join(parent, f".{name}.tmp-*"))  # left by a save that crashed
            if os.path.isfile(os.path.join(target, INDEX)):  # the target is whole: older copies are debris too
                debris += glob.glob(os.path.join(parent, f".{name}.old-*"))
            for stale in debris:
                shutil.rmtree(stale, ignore_errors=True)
            tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
            os.mkdir(tmp)
        except (OSError, CheckpointError) as e:
            error = str(e)
    tmp, error = edist.broadcast_object((tmp, error), 0, em.group) if em.world_size > 1 else (tmp, error)
    if error:
        raise CheckpointError(error)
    try:
        if shard:
            with disk_mapped(em, optimizer):  # disk-placed masters and state: mapped from the file
                error = _save_sharded(tmp, em, optimizer, extra)
        else:
            error = _save_full(tmp, em, optimizer, extra)
        if em.rank == 0 and not error:
            try:
                _fsync_dir(tmp)
                _commit(tmp, os.path.join(parent, name))
            except OSError as e:
                error = f"could not move the checkpoint into place at {path}: {e}"
        _agree(em, error)
    except BaseException:
        if em.rank == 0 and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(tmp: str, target: str) -> None:
    parent, name = os.path.split(target)
    if os.path.exists(target):
        aside = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
        os.rename(target, aside)
        os.rename(tmp, target)
        _fsync_dir(parent)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, target)
        _fsync_dir(parent)


def _save_sharded(tmp: str, em: ElixirModule, eo: Optional[ElixirOptimizer], extra: Any) -> Optional[str]:
    """Write this rank's file; rank 0 also the index. Returns rank 0's error, if any."""
    error = None
    meta: dict[str, Any] = {}
    try:
        fname = f"rank{em.rank:05d}-of-{em.world_size:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        entries = []
        scalars: dict[str, dict] = {}
        frags = eo.fragments if eo is not None else _fragments_without_optimizer(em)
        state = eo.optim.state if eo is not None else {}
        for f in frags:
            if not _writes_fragment(em, f):
                continue
            pname, start, end = _frag_range(em, f)
            key = f"param/{pname}/{start}"
            tensors[key] = em.chunks[f.chunk].master[f.lo : f.hi]  # written from the master's memory
            entries.append({"kind": "param", "name": pname, "start": start, "end": end, "key": key, "dtype": "float32"})
            st = state.get(f.tensor) or {}
            for k, v in st.items():
                if optim_state._elementwise(v, f.hi - f.lo):
                    skey = f"state/{k}/{pname}/{start}"
                    tensors[skey] = v.detach().reshape(-1)
                    entries.append({"kind": "state", "state_key": k, "name": pname, "start": start, "end": end,
                                    "key": skey, "dtype": _dtype_str(v.dtype)})
                else:
                    scalars.setdefault(pname, {})[k] = _encode(v, f"optimizer state {k!r}")
            if st:
                # key order of this parameter's state (so loading rebuilds it identically)
                scalars.setdefault(pname, {})["__order__"] = list(st.keys())
        if em.rank == 0:
            for k, t in _module_tensors(em).items():
                key = f"module/{k}"
                tensors[key] = t.detach()
                entries.append({"kind": "module", "name": k, "key": key, "dtype": _dtype_str(t.dtype), "shape": list(t.shape)})
        size = _write_tensors(os.path.join(tmp, fname), tensors)
        for e in entries:
            e["file"] = fname
        meta = {"file": fname, "size": size, "entries": entries, "scalars": scalars}
    except Exception as e:  # report to every rank instead of leaving them in a collective
        error = f"writing this rank's shard failed: {type(e).__name__}: {e}"
    metas = edist.all_gather_object((meta, error), em.group) if em.world_size > 1 else [(meta, error)]
    bad = [(r, err) for r, (_, err) in enumerate(metas) if err]
    if bad:
        raise CheckpointError(f"rank {bad[0][0]}: {bad[0][1]}")
    if em.rank != 0:
        return None
    try:
        _write_sharded_index(tmp, em, eo, extra, metas)
    except Exception as e:
        return f"writing the checkpoint index failed: {type(e).__name__}: {e}"
    return None


def _write_sharded_index(tmp: str, em: ElixirModule, eo: Optional[ElixirOptimizer], extra: Any, metas: list) -> None:
    all_scalars: dict[str, dict] = {}
    for m, _ in metas:
        for pname, d in m["scalars"].items():
            all_scalars.setdefault(pname, {}).update(d)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "kind": "sharded",
        "world_size": em.world_size,
        "model": _fingerprint(em),
        "files": {m["file"]: m["size"] for m, _ in metas},
        "entries": [e for m, _ in metas for e in m["entries"]],
        "optimizer": None if eo is None else {**_optimizer_meta(eo, em), "scalars": all_scalars},
        "loss_scaler": None if eo is None or eo.scaler is None else eo.scaler.state_dict(),
        "extra": extra is not None,
    }
    if extra is not None:
        torch.save(extra, os.path.join(tmp, "extra.pt"))
        _fsync_file(os.path.join(tmp, "extra.pt"))
        index["files"]["extra.pt"] = os.path.getsize(os.path.join(tmp, "extra.pt"))
    _write_json(os.path.join(tmp, INDEX), index)


def _fragments_without_optimizer(em: ElixirModule) -> list:
    """This rank's fragments when no optimizer is given (same cut as ElixirOptimizer's)."""
    from elixir.wrapper.optimizer import Fragment

    out = []
    for c in em.chunks:
        lo, n = c.spec.shard_offset, c.spec.shard_numel
        for i in em._chunk_params[c.index]:
            s = em.slots[i]
            a, b = max(lo, s.offset), min(lo + n, s.offset + s.numel)
            if a < b:
                out.append(Fragment(i, c.index, a - lo, b - lo, c.master[a - lo : b - lo]))
    return out


def _save_full(tmp: str, em: ElixirModule, eo: Optional[ElixirOptimizer], extra: Any) -> Optional[str]:
    """Gather (collective) and write on rank 0. Returns rank 0's error, if any."""
    sd = em.state_dict(rank0_only=True)
    osd = eo.state_dict(rank0_only=True) if eo is not None else None
    error = None
    if em.rank == 0:
        try:
            files = {}
            seen: dict[int, str] = {}
            tensors = {}
            for k, t in em.module.state_dict(keep_vars=True).items():
                if id(t) in seen:  # a tied alias: saved once, under the first name (as HF does)
                    continue
                seen[id(t)] = k
                tensors[k] = sd[k].contiguous()
            files["model.safetensors"] = _write_tensors(os.path.join(tmp, "model.safetensors"), tensors)
            config = getattr(em.module, "config", None)
            if config is not None and hasattr(config, "to_json_file"):
                config.to_json_file(os.path.join(tmp, "config.json"))
                _fsync_file(os.path.join(tmp, "config.json"))
            scaler = None
            if osd is not None:
                scaler = osd.pop("loss_scaler", None)
                torch.save(osd, os.path.join(tmp, "optimizer.pt"))
                _fsync_file(os.path.join(tmp, "optimizer.pt"))
                files["optimizer.pt"] = os.path.getsize(os.path.join(tmp, "optimizer.pt"))
            if extra is not None:
                torch.save(extra, os.path.join(tmp, "extra.pt"))
                _fsync_file(os.path.join(tmp, "extra.pt"))
                files["extra.pt"] = os.path.getsize(os.path.join(tmp, "extra.pt"))
            index = {
                "format": FORMAT,
                "version": VERSION,
                "kind": "full",
                "world_size": em.world_size,
                "model": _fingerprint(em),
                "files": files,
                "aliases": {k: seen[id(t)] for k, t in em.module.state_dict(keep_vars=True).items() if seen[id(t)] != k},
                "optimizer": None if eo is None else {**_optimizer_meta(eo, em)},
                "loss_scaler": scaler,
                "extra": extra is not None,
            }
            _write_json(os.path.join(tmp, INDEX), index)
        except Exception as e:
            error = f"writing the full checkpoint failed: {type(e).__name__}: {e}"
    return error


# --------------------------------------------------------------------------------------------
# load


def _resolve(path: str) -> str:
    """``path``, or the renamed-aside previous checkpoint when a save died between its renames."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        return target
    parent, name = os.path.split(target)
    aside = sorted(glob.glob(os.path.join(parent, f".{name}.old-*")), key=os.path.getmtime)
    aside = [a for a in aside if os.path.isfile(os.path.join(a, INDEX))]
    if aside:
        import warnings

        warnings.warn(f"elixir: {path} is missing (a save was interrupted); loading the previous checkpoint {aside[-1]}", stacklevel=3)
        return aside[-1]
    raise CheckpointError(f"no checkpoint at {path}")


def _read_index(root: str) -> dict:
    ipath = os.path.join(root, INDEX)
    try:
        with open(ipath) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{root} has no {INDEX}: not an elixir checkpoint, or an incomplete one") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ipath} is unreadable or truncated ({e})") from None
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{ipath} is not an elixir checkpoint index")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{ipath} has format version {index.get('version')}; this elixir reads version {VERSION}")
    for fname, size in index["files"].items():
        fp = os.path.join(root, fname)
        if not os.path.isfile(fp):
            raise CheckpointError(f"checkpoint file {fname} is missing from {root} (an incomplete copy?)")
        actual = os.path.getsize(fp)
        if actual != size:
            raise CheckpointError(f"checkpoint file {fname} has {actual} bytes, the index says {size}: truncated or replaced")
    return index


def _check_model(index: dict, em: ElixirModule, strict: bool) -> None:
    mine = _fingerprint(em)
    theirs = index["model"]
    problems = []
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


class _Reader:
    """Open safetensors files lazily; read slices with dtype checks."""

    def __init__(self, root: str):
        self.root = root
        self._files: dict[str, Any] = {}

    def handle(self, fname: str):
        from safetensors import safe_open

        h = self._files.get(fname)
        if h is None:
            try:
                h = safe_open(os.path.join(self.root, fname), framework="pt")
            except Exception as e:
                raise CheckpointError(f"checkpoint file {fname} is corrupt or truncated: {e}") from None
            self._files[fname] = h
        return h

    def read(self, fname: str, key: str, expect: torch.dtype, lo: Optional[int] = None, hi: Optional[int] = None) -> torch.Tensor:
        h = self.handle(fname)
        try:
            sl = h.get_slice(key)
        except Exception:
            raise CheckpointError(f"tensor {key!r} is missing from {fname}") from None
        got = _SAFETENSORS_DTYPES.get(sl.get_dtype())
        if got != expect:
            raise CheckpointError(
                f"tensor {key!r} in {fname} has dtype {sl.get_dtype()}, expected {_dtype_str(expect)}: mismatched "
                "dtype (convert the checkpoint explicitly, or load the matching one)"
            )
        return sl[lo:hi] if lo is not None else sl[:]

    def read_flat(self, fname: str, key: str, expect: torch.dtype, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``key``, reading whole rows only."""
        sl = self.handle(fname).get_slice(key)
        shape = list(sl.get_shape())
        if len(shape) <= 1:
            return self.read(fname, key, expect, start, end).reshape(-1)
        row = 1
        for d in shape[1:]:
            row *= d
        r0, r1 = start // row, -(-end // row)
        rows = self.read(fname, key, expect, r0, r1).reshape(-1)
        return rows[start - r0 * row : end - r0 * row].clone()


_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _assemble(reader: _Reader, pieces: list[dict], start: int, end: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    """Values ``[start, end)`` of a flattened tensor from saved ``pieces`` (global ranges)."""
    for e in pieces:  # the common case, same layout as saved: one piece, no staging copy
        if e["start"] == start and e["end"] == end and _dtype(e["dtype"]) == dtype:
            return reader.read(e["file"], e["key"], dtype)
    out = torch.empty(end - start, dtype=dtype)
    covered = 0
    for e in pieces:
        a, b = max(start, e["start"]), min(end, e["end"])
        if a >= b:
            continue
        if _dtype(e["dtype"]) != dtype:
            raise CheckpointError(f"{what}: saved as {e['dtype']}, expected {_dtype_str(dtype)} (mismatched dtype)")
        out[a - start : b - start] = reader.read(e["file"], e["key"], dtype, a - e["start"], b - e["start"])
        covered += b - a
    if covered != end - start:
        raise CheckpointError(f"{what}: the checkpoint covers {covered} of the {end - start} elements [{start}, {end}) (a shard is missing)")
    return out


def load(path: str, model: ElixirModule, optimizer: Optional[ElixirOptimizer] = None, strict: bool = True) -> Any:
    """Load a checkpoint written by :func:`save` (at any world size, with any plan) into ``model``
    and ``optimizer``; return the saved ``extra`` (None if none). Collective: call on every rank.
    Nothing is modified unless every rank validated and read everything it needs."""
    if not isinstance(model, ElixirModule):
        raise TypeError("checkpoint.load needs the ElixirModule")
    em = model
    with disk_mapped(em, optimizer, writable=True):  # disk-placed masters: mapped, written in place
        plan = _load_staged(path, em, optimizer, strict)
    return plan["extra"]


def _load_staged(path: str, em: ElixirModule, optimizer: Optional[ElixirOptimizer], strict: bool) -> dict:
    error = None
    plan = None
    try:
        root = _resolve(path)
        index = _read_index(root)
        _check_model(index, em, strict)
        if optimizer is not None and index["optimizer"] is None:
            raise CheckpointError("the checkpoint holds no optimizer state; call load(path, model) without the optimizer")
        plan = (_prepare_sharded if index["kind"] == "sharded" else _prepare_full)(root, index, em, optimizer)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:
        error = f"reading the checkpoint failed: {type(e).__name__}: {e}"
    _agree(em, error)
    _commit_load(em, optimizer, plan)
    return plan


def _group_check(index: dict, eo: ElixirOptimizer, em: ElixirModule) -> list[dict]:
    saved_cls, cls = index["optimizer"].get("class"), type(eo.optim).__name__
    if saved_cls != cls:
        import warnings

        warnings.warn(
            f"elixir: optimizer state saved by {saved_cls} is loaded into {cls}; its state keys must mean the "
            "same (e.g. CPUAdam <-> AdamW)", stacklevel=4,
        )
    saved = index["optimizer"]["param_groups"]
    current = _optimizer_meta(eo, em)["param_groups"]
    if len(saved) != len(current):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} param groups, this one {len(current)}")
    for gi, (s, c) in enumerate(zip(saved, current)):
        if s["params"] != c["params"]:
            diff = [n for n in s["params"] if n not in c["params"]][:3] + [n for n in c["params"] if n not in s["params"]][:3]
            raise CheckpointError(f"param group {gi} holds other parameters in the checkpoint than here (e.g. {diff}, or another order)")
    return [{k: _decode(v) for k, v in g.items()} for g in saved]


def _load_extra(root: str, index: dict) -> Any:
    if not index.get("extra"):
        return None
    try:
        return torch.load(os.path.join(root, "extra.pt"), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"extra.pt is unreadable: {e}") from None


def _prepare_sharded(root: str, index: dict, em: ElixirModule, eo: Optional[ElixirOptimizer]) -> dict:
    reader = _Reader(root)
    by_name: dict[tuple, list] = defaultdict(list)
    module_entries = {}
    for e in index["entries"]:
        if e["kind"] == "param":
            by_name[("param", e["name"])].append(e)
        elif e["kind"] == "state":
            by_name[(e["state_key"], e["name"])].append(e)
        else:
            module_entries[e["name"]] = e
    frags = eo.fragments if eo is not None else _fragments_without_optimizer(em)
    saved_params = index["model"]["params"]
    values = []  # (fragment, fp32 values)
    for f in frags:
        pname, start, end = _frag_range(em, f)
        if pname not in saved_params:
            continue  # strict=False
        values.append((f, _assemble(reader, by_name[("param", pname)], start, end, torch.float32, f"parameter {pname}")))
    module_vals = {}
    for k, t in _module_tensors(em).items():
        e = module_entries.get(k)
        if e is None:
            continue
        module_vals[k] = reader.read(e["file"], e["key"], t.dtype)
    opt = None
    if eo is not None:
        groups = _group_check(index, eo, em)
        scalars = index["optimizer"]["scalars"]
        new_state = []
        for f in eo.fragments:
            pname, start, end = _frag_range(em, f)
            sc = scalars.get(pname)
            if not sc:
                continue
            st = {}
            for k in sc["__order__"]:
                if k in sc:
                    st[k] = _decode(sc[k])
                else:
                    pieces = by_name.get((k, pname), [])
                    if not pieces:
                        raise CheckpointError(f"optimizer state {k!r} of {pname} is missing from the checkpoint")
                    st[k] = _assemble(reader, pieces, start, end, _dtype(pieces[0]["dtype"]), f"state {k} of {pname}")
            new_state.append((f, st))
        opt = {"state": new_state, "groups": groups}
    return {"values": values, "module": module_vals, "opt": opt, "scaler": index.get("loss_scaler"), "extra": _load_extra(root, index)}


def _prepare_full(root: str, index: dict, em: ElixirModule, eo: Optional[ElixirOptimizer]) -> dict:
    reader = _Reader(root)
    aliases: dict[str, str] = index.get("aliases", {})
    h = reader.handle("model.safetensors")
    keys = set(h.keys())

    def key_of(name: str) -> str:
        k = aliases.get(name, name)
        if k not in keys:
            raise CheckpointError(f"{name} is missing from model.safetensors")
        return k

    values = []
    frags = eo.fragments if eo is not None else _fragments_without_optimizer(em)
    for f in frags:
        pname, start, end = _frag_range(em, f)
        if pname not in index["model"]["params"]:
            continue  # strict=False
        values.append((f, reader.read_flat("model.safetensors", key_of(pname), torch.float32, start, end)))
    module_vals = {k: reader.read("model.safetensors", key_of(k), t.dtype) for k, t in _module_tensors(em).items()}
    opt = None
    if eo is not None:
        _group_check(index, eo, em)
        try:
            osd = torch.load(os.path.join(root, "optimizer.pt"), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointError(f"optimizer.pt is unreadable or truncated: {e}") from None
        try:
            optim_state.check_groups(eo, osd["param_groups"])
        except optim_state.OptimStateMismatch as e:
            raise CheckpointError(str(e)) from None
        opt = {"full": osd}
    return {"values": values, "module": module_vals, "opt": opt, "scaler": index.get("loss_scaler"), "extra": _load_extra(root, index)}


def _commit_load(em: ElixirModule, eo: Optional[ElixirOptimizer], plan: dict) -> None:
    with torch.no_grad():
        em.cache.release_all()
        for f, v in plan["values"]:
            c = em.chunks[f.chunk]
            c.master[f.lo : f.hi].copy_(v)
            if c.shard is not c.master:
                c.shard[f.lo : f.hi].copy_(v)
        tensors = _module_tensors(em)
        for k, v in plan["module"].items():
            tensors[k].data.copy_(v)
    if eo is not None and plan["opt"] is not None:
        if "full" in plan["opt"]:
            optim_state.scatter_full_state(eo, plan["opt"]["full"])
        else:
            new_state = {}
            for f, st in plan["opt"]["state"]:
                new_state[f.tensor] = {
                    k: (v.to(f.tensor.device) if isinstance(v, torch.Tensor) and v.dim() >= 1 else v) for k, v in st.items()
                }
            optim_state.install_state(eo, new_state, plan["opt"]["groups"])
        if eo.scaler is not None and plan["scaler"] is not None:
            eo.scaler.load_state_dict(plan["scaler"])
        eo.zero_grad()


# --------------------------------------------------------------------------------------------
# offline consolidation


def consolidate(path: str) -> dict[str, Any]:
    """Read a checkpoint (sharded or full) into full tensors in this process, with no model and no
    process group: ``{"model": state dict (canonical names; fp32 params, buffers, frozen params),
    "optimizer": torch-format state dict or None, "loss_scaler": ..., "extra": ...}``. The
    optimizer dict is indexed like the optimizer that was saved, so it loads into a plain torch
    optimizer built the same way on the unwrapped model."""
    root = _resolve(path)
    index = _read_index(root)
    reader = _Reader(root)
    if index["kind"] == "full":
        h = reader.handle("model.safetensors")
        model = {k: h.get_tensor(k) for k in h.keys()}
        optim = None
        if index["optimizer"] is not None:
            optim = torch.load(os.path.join(root, "optimizer.pt"), map_location="cpu", weights_only=True)
        return {"model": model, "optimizer": optim, "loss_scaler": index.get("loss_scaler"), "extra": _load_extra(root, index)}
    by_name: dict[tuple, list] = defaultdict(list)
    model: dict[str, torch.Tensor] = {}
    for e in index["entries"]:
        if e["kind"] == "param":
            by_name[("param", e["name"])].append(e)
        elif e["kind"] == "state":
            by_name[(e["state_key"], e["name"])].append(e)
    shapes = index["model"]["params"]
    for name, shape in shapes.items():
        numel = int(torch.Size(shape).numel())
        model[name] = _assemble(reader, by_name[("param", name)], 0, numel, torch.float32, f"parameter {name}").view(shape)
    for e in index["entries"]:
        if e["kind"] == "module":
            model[e["name"]] = reader.read(e["file"], e["key"], _dtype(e["dtype"])).view(e["shape"])
    optim = None
    if index["optimizer"] is not None:
        meta = index["optimizer"]
        state: dict[int, dict] = {}
        groups = []
        idx = 0
        for g in meta["param_groups"]:
            ids = []
            for name in g["params"]:
                sc = meta["scalars"].get(name)
                if sc:
                    numel = int(torch.Size(shapes[name]).numel())
                    st = {}
                    for k in sc["__order__"]:
                        if k in sc:
                            st[k] = _decode(sc[k])
                        else:
                            pieces = by_name[(k, name)]
                            full = _assemble(reader, pieces, 0, numel, _dtype(pieces[0]["dtype"]), f"state {k} of {name}")
                            st[k] = full.view(shapes[name])
                    state[idx] = st
                ids.append(idx)
                idx += 1
            groups.append({**{k: _decode(v) for k, v in g.items() if k != "params"}, "params": ids})
        optim = {"state": state, "param_groups": groups}
    return {"model": model, "optimizer": optim, "loss_scaler": index.get("loss_scaler"), "extra": _load_extra(root, index)}
