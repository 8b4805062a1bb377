"""Write a checkpoint: sharded (one file per rank) or full (Hugging Face compatible), atomically."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

from elixir import distributed as edist
from elixir.checkpoint import atomic
from elixir.checkpoint import format as tensor_files
from elixir.checkpoint.checksum import file_checksum
from elixir.checkpoint.errors import CheckpointError, agree
from elixir.checkpoint.index import Entry, Index, encode
from elixir.checkpoint.layout import (
    fingerprint,
    frag_range,
    fragments,
    frozen_pieces,
    module_tensors,
    optimizer_meta,
    writes_fragment,
)
from elixir.fileio import fsync_file
from elixir.offload.pipeline import disk_mapped
from elixir.offload.state_binding import is_elementwise
from elixir.optim import lowbit
from elixir.optim.nvme import materialized
from elixir.wrapper import lowbit_state
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.optimizer import ElixirOptimizer
from elixir.wrapper.state_dict import warn_dequantised


def save(
    path: str,
    model: ElixirModule,
    optimizer: Optional[ElixirOptimizer] = None,
    extra: Any = None,
    shard: bool = True,
    frozen: bool = True,
) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``, ``extra``) to the directory ``path``,
    atomically. Collective: call on every rank. See :mod:`elixir.checkpoint` for the layout.

    ``frozen=False`` leaves out the weights of the frozen chunks (an adapter-only checkpoint, as
    PEFT's ``save_pretrained`` writes: load the base weights first, e.g. with
    :func:`~elixir.checkpoint.load_pretrained`, then this); loading it leaves frozen weights as
    they are. Frozen chunks stored quantised (``MixedPrecisionPolicy(frozen="nf4")``) are written
    dequantised to the compute dtype, with a warning naming the precision change; loading them
    quantises them again (the same values to within the format's rounding, not bitwise the same
    codes). ``frozen=False`` is the lossless save of such a run."""
    if not isinstance(model, ElixirModule):
        raise TypeError("checkpoint.save needs the ElixirModule")
    if optimizer is not None and optimizer.module is not model:
        raise ValueError("the optimizer wraps another ElixirModule than the model given")
    _check_extra(extra)
    em = model
    with edist.where(f"step {em.iteration}, checkpoint save"), \
            atomic.collective_save(path, em.group, em.world_size, em.rank) as stage:
        if shard:
            stage.error = write_sharded(stage.tmp, em, optimizer, extra, frozen)
        else:
            stage.error = _save_full(stage.tmp, em, optimizer, extra, frozen)


def write_sharded(tmp: str, em: ElixirModule, eo: Optional[ElixirOptimizer], extra: Any = None,
                  frozen: bool = True, codes: bool = True) -> Optional[str]:
    """Write ``em``'s sharded checkpoint into the directory ``tmp`` (each rank its file, rank 0 of
    ``em.group`` the index); returns rank 0's error, if any. Collective over ``em.group``.
    ``codes``: 8-bit moments as their codes and block scales (False: as the fp32 they decode to)."""
    states = eo.fragment_states if eo is not None else None
    # disk-placed masters and state: mapped from the file; moments the inner optimizer keeps on
    # its own disk (nvme_offload_fraction): read back for the save
    nvme = materialized(eo.optim) if eo is not None else contextlib.nullcontext()
    with disk_mapped(em.disk_store, states) as mapped, nvme:
        return _save_sharded(tmp, em, eo, extra, mapped, frozen, codes)


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


def _save_torch(obj: Any, path: str) -> int:
    torch.save(obj, path)
    fsync_file(path)
    return os.path.getsize(path)


def _save_sharded(tmp: str, em: ElixirModule, eo: Optional[ElixirOptimizer], extra: Any,
                  mapped: dict[int, torch.Tensor], frozen: bool = True, codes: bool = True) -> Optional[str]:
    """Write this rank's file; rank 0 also the index. Returns rank 0's error, if any. ``mapped``:
    the masters of disk chunks, mapped from the offload file."""
    error = None
    meta: dict[str, Any] = {}
    try:
        fname = f"rank{em.rank:05d}-of-{em.world_size:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        entries = []
        scalars: dict[str, dict] = {}
        state = eo.optim.state if eo is not None else {}
        for f in fragments(em, eo, mapped):
            if not writes_fragment(em, f):
                continue
            pname, start, end = frag_range(em, f)
            key = f"param/{pname}/{start}"
            master = mapped.get(f.chunk, em.chunks[f.chunk].master)
            tensors[key] = master[f.lo : f.hi]  # written from the master's memory
            entries.append(Entry("param", pname, key, tensor_files.dtype_name(master.dtype), fname, start, end))
            # each format as it is (8-bit moments as codes and scales: checkpoint/quantised.py), or with
            # codes=False (a mesh checkpoint, whose reader reassembles tensor-parallel cuts) decoded to fp32
            st = (state.get(f.tensor) if codes else lowbit_state.export_state(eo, state.get(f.tensor), f.hi - f.lo)) or {}
            for k, v in st.items():
                if is_elementwise(v, f.hi - f.lo) or k in lowbit.SCALE_KEYS:
                    skey = f"state/{k}/{pname}/{start}"
                    tensors[skey] = v.detach().reshape(-1)
                    entries.append(Entry("state", pname, skey, tensor_files.dtype_name(v.dtype), fname, start, end, state_key=k))
                else:
                    scalars.setdefault(pname, {})[k] = encode(v, f"optimizer state {k!r}")
            if st:
                # key order of this parameter's state (so loading rebuilds it identically)
                scalars.setdefault(pname, {})["__order__"] = list(st.keys())
        values: dict[int, torch.Tensor] = {}  # a quantised chunk's shard, dequantised once
        for fp in frozen_pieces(em, writers_only=True) if frozen else ():
            key = f"frozen/{fp.name}/{fp.start}"
            chunk = em.all_chunks[fp.chunk]
            if chunk.spec.frozen_format is not None:
                if fp.chunk not in values:
                    warn_dequantised(chunk, "the checkpoint")
                    with chunk.shard_access(write=False) as shard:
                        values = {fp.chunk: shard}
                tensors[key] = values[fp.chunk][fp.lo : fp.hi].clone()
            elif chunk.spec.shard_on_disk:  # read in and copied (a disk shard is not resident)
                with chunk.shard_access(write=False) as shard:
                    tensors[key] = shard[fp.lo : fp.hi].clone()
            else:
                tensors[key] = fp.view(em)
            entries.append(Entry("frozen", fp.name, key, tensor_files.dtype_name(tensors[key].dtype), fname, fp.start, fp.end))
        if em.rank == 0:
            for k, t in module_tensors(em).items():
                key = f"module/{k}"
                tensors[key] = t.detach()
                entries.append(Entry("module", k, key, tensor_files.dtype_name(t.dtype), fname, shape=list(t.shape)))
        size = tensor_files.write_tensors(os.path.join(tmp, fname), tensors)
        crc = file_checksum(os.path.join(tmp, fname))  # each rank its own file, in parallel
        meta = {"file": fname, "size": size, "checksum": crc, "entries": entries, "scalars": scalars}
    except Exception as e:  # report to every rank instead of leaving them in a collective
        error = f"writing this rank's shard failed: {type(e).__name__}: {e}"
    metas = agree(em.group, em.world_size, error, meta)
    if em.rank != 0:
        return None
    try:
        _write_sharded_index(tmp, em, eo, extra, metas, frozen)
    except Exception as e:
        return f"writing the checkpoint index failed: {type(e).__name__}: {e}"
    return None


def _write_sharded_index(tmp: str, em: ElixirModule, eo: Optional[ElixirOptimizer], extra: Any, metas: list,
                         frozen: bool = True) -> None:
    all_scalars: dict[str, dict] = {}
    for m in metas:
        for pname, d in m["scalars"].items():
            all_scalars.setdefault(pname, {}).update(d)
    index = Index(
        kind="sharded",
        world_size=em.world_size,
        model=fingerprint(em, frozen),
        files={m["file"]: m["size"] for m in metas},
        checksums={m["file"]: m["checksum"] for m in metas},
        entries=[e for m in metas for e in m["entries"]],
        optimizer=None if eo is None else {**optimizer_meta(eo, em), "scalars": all_scalars},
        loss_scaler=None if eo is None or eo.scaler is None else eo.scaler.state_dict(),
        extra=extra is not None,
    )
    if extra is not None:
        index.files["extra.pt"] = _save_torch(extra, os.path.join(tmp, "extra.pt"))
        index.checksums["extra.pt"] = file_checksum(os.path.join(tmp, "extra.pt"))
    index.write(tmp)


def _save_full(tmp: str, em: ElixirModule, eo: Optional[ElixirOptimizer], extra: Any, frozen: bool = True) -> Optional[str]:
    """Gather (collective) and write on rank 0. Returns rank 0's error, if any."""
    sd = em.state_dict(rank0_only=True)
    osd = eo.state_dict(rank0_only=True) if eo is not None else None
    error = None
    if em.rank == 0:
        try:
            files = {}
            seen: dict[int, str] = {}
            tensors = {}
            skip = set() if frozen else {id(p) for p in em.frozen_map.params}
            for k, t in em.module.state_dict(keep_vars=True).items():
                if id(t) in seen or id(t) in skip:  # a tied alias: saved once, under the first name (as HF does)
                    continue
                seen[id(t)] = k
                tensors[k] = sd[k].contiguous()
            files["model.safetensors"] = tensor_files.write_tensors(os.path.join(tmp, "model.safetensors"), tensors)
            config = getattr(em.module, "config", None)
            if config is not None and hasattr(config, "to_json_file"):
                config.to_json_file(os.path.join(tmp, "config.json"))
                fsync_file(os.path.join(tmp, "config.json"))
            scaler = None
            if osd is not None:
                scaler = osd.pop("loss_scaler", None)
                files["optimizer.pt"] = _save_torch(osd, os.path.join(tmp, "optimizer.pt"))
            if extra is not None:
                files["extra.pt"] = _save_torch(extra, os.path.join(tmp, "extra.pt"))
            Index(
                kind="full",
                world_size=em.world_size,
                model=fingerprint(em, frozen),
                files=files,
                aliases={k: seen[id(t)] for k, t in em.module.state_dict(keep_vars=True).items()
                         if id(t) in seen and seen[id(t)] != k},
                optimizer=None if eo is None else optimizer_meta(eo, em),
                loss_scaler=scaler,
                extra=extra is not None,
                checksums={f: file_checksum(os.path.join(tmp, f)) for f in files},
            ).write(tmp)
        except Exception as e:
            error = f"writing the full checkpoint failed: {type(e).__name__}: {e}"
    return error
