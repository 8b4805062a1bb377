"""Hugging Face checkpoint directories in and out of an ElixirModule, streamed shard by shard.

``load_pretrained(path, model, strict=True)`` reads ``model.safetensors``, or the sharded files
listed by ``model.safetensors.index.json``, into a wrapped model: each rank reads, through the
``safetensors`` library's lazy slices, only the rows its own shards (and replicated chunks, frozen
parameters and buffers) need, and converts dtypes on the fly (a bf16 checkpoint into fp32 masters).
It works at any world size and with chunks whose master is on disk (staged one chunk at a time).
Keys follow transformers: a tied weight saved once under either name fills every name; keys the
model's ``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected`` patterns name,
and the legacy ``rotary_emb.inv_freq`` / ``position_ids`` entries, are not reported; a checkpoint of
the base model loads into a model with a head and vice versa (the ``base_model_prefix``), and into a
PEFT model (``peft.get_peft_model``): the base weights fill the frozen chunks under their base names
(``base_model.model.`` and LoRA's ``.base_layer`` dropped), each rank reading only its shard's rows in
the chunk's dtype, and the adapters, which no base checkpoint holds, are not reported missing. Every rank
validates names, shapes and dtypes from the file headers first and agrees; with ``strict`` any
missing or unexpected key raises :class:`~elixir.checkpoint.CheckpointError` on every rank, before
anything is modified. Otherwise the report is returned, as ``load_state_dict`` returns it.

``save_pretrained(path, model, max_shard_size="5GB", dtype=None)`` writes the layout
``transformers.AutoModel*.from_pretrained`` reads: ``model.safetensors`` (one shard) or
``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``, and ``config.json`` when
the wrapped model has a config. Tied weights are saved once, under the source name
``all_tied_weights_keys`` gives (otherwise the first name). Files are assigned to ranks in turn;
for each file every rank takes part in gathering the chunks that cover it, one chunk at a time, and
only the file's writer keeps the values, so no rank ever holds more than one file's tensors plus
one gathered chunk (never the whole model). The directory is staged and renamed into place like
:func:`~elixir.checkpoint.save`'s (:mod:`elixir.checkpoint.atomic`).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from elixir.checkpoint import atomic
from elixir.checkpoint.errors import CheckpointError, agree
from elixir.checkpoint.format import Reader, write_tensors
from elixir.fileio import fsync_file
from elixir.offload.pipeline import staged
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.state_dict import chunk_values

__all__ = ["load_pretrained", "save_pretrained", "save_state_dict_pretrained", "LoadReport", "SAFE_WEIGHTS", "SAFE_INDEX"]

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
_LEGACY_UNEXPECTED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")

# safetensors' dtype codes, as ``get_slice(k).get_dtype()`` reports them
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_pretrained` found, in transformers' terms (keys of the wrapped model)."""

    missing_keys: list = field(default_factory=list)
    unexpected_keys: list = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# what the model holds, under HF's key conventions


def _model_keys(model: torch.nn.Module) -> dict[str, list[str]]:
    """State-dict keys of each distinct tensor of the (unwrapped) ``model``, grouped: first key ->
    every key naming it."""
    names: dict[int, list[str]] = {}
    for k, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(k)
    return {ks[0]: ks for ks in names.values()}


def _tensors(em: ElixirModule) -> dict[str, torch.Tensor]:
    return dict(em.module.state_dict(keep_vars=True))


def _patterns(model, attr: str) -> list[str]:
    pats = getattr(model, attr, None) or ()
    return [p for p in pats]


def _matches(key: str, pats: list[str]) -> bool:
    return any(re.search(p, key) for p in pats)


def _saved_name(model: torch.nn.Module, keys: list[str]) -> str:
    """The one name a tied tensor of the (unwrapped) ``model`` is saved under: the tie's source if
    the model names one."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for k in keys:
        if k not in tied:
            return k
    return keys[0]


def parse_size(size: Union[int, str]) -> int:
    """Bytes in ``size``: an int, or a string such as "5GB", "500MB", "2GiB" (as transformers)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B)\s*", str(size), re.I)
    if not m:
        raise ValueError(f"max_shard_size {size!r}: give bytes (int) or a string like '5GB' or '500MB'")
    units = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    return int(float(m.group(1)) * units[m.group(2).lower()])


# --------------------------------------------------------------------------------------------
# saving


def save_pretrained(
    path: str,
    model: ElixirModule,
    max_shard_size: Union[int, str] = "5GB",
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory at ``path`` (see the module
    docstring), with floating tensors in ``dtype`` (default: chunked parameters as their fp32
    masters, other tensors as they are). Collective: call on every rank."""
    if not isinstance(model, ElixirModule):
        raise TypeError("save_pretrained needs the ElixirModule")
    em = model
    limit = parse_size(max_shard_size)
    tensors = _tensors(em)
    keys = _keys_to_save(em.module)
    slot_of = {s.name: s for s in em.slots + em.frozen_map.slots}
    pname = {id(em.params[s.index]): s.name for s in em.slots}
    pname.update({id(em.frozen_map.params[s.index]): s.name for s in em.frozen_map.slots})

    def out_dtype(k: str) -> torch.dtype:
        t = tensors[k]
        base = torch.float32 if id(t) in pname and not em.frozen_map.slot_of(t) else t.dtype
        return dtype if dtype is not None and t.is_floating_point() else base

    files, names = _split(keys, lambda k: tensors[k].numel() * torch.empty((), dtype=out_dtype(k)).element_size(), limit)

    def finish(tmp: str) -> None:  # rank 0, once every file is written: the index and config, last
        total = sum(tensors[k].numel() * torch.empty((), dtype=out_dtype(k)).element_size() for f in files for k in f)
        _write_meta(tmp, em.module, files, names, total, dtype)

    with atomic.collective_save(path, em.group, em.world_size, em.rank, (CONFIG, SAFE_WEIGHTS, SAFE_INDEX),
                                finish) as stage:
        tmp, error = stage.tmp, None
        em.cache.release_all()
        for fi, fkeys in enumerate(files):
            writer = fi % em.world_size
            mine = em.rank == writer
            out: dict[str, torch.Tensor] = {}
            by_chunk: dict[int, list[str]] = {}
            for k in fkeys:
                t = tensors[k]
                if id(t) in pname:
                    by_chunk.setdefault(slot_of[pname[id(t)]].chunk, []).append(k)
                elif mine:
                    out[k] = t.detach().to("cpu", out_dtype(k)).contiguous()
            for ci in sorted(by_chunk):  # one gathered chunk at a time (collective)
                full = chunk_values(em, em.all_chunks[ci])
                if mine:
                    for k in by_chunk[ci]:
                        s = slot_of[pname[id(tensors[k])]]
                        out[k] = full[s.offset : s.offset + s.numel].view(s.shape).to(out_dtype(k), copy=True)
                del full
            if mine and error is None:
                try:
                    write_tensors(os.path.join(tmp, names[fi]), {k: out[k] for k in fkeys})
                except (OSError, CheckpointError) as e:
                    error = f"writing {names[fi]} failed: {e}"
            del out
        agree(em.group, em.world_size, error)  # every rank's files were written


def _keys_to_save(model: torch.nn.Module) -> list[str]:
    """The keys a checkpoint of ``model`` holds: each tensor once (tied weights under their source
    name), less the model's ``_keys_to_ignore_on_save``, in state-dict order."""
    keys = [_saved_name(model, ks) for ks in _model_keys(model).values()]
    ignore = _patterns(model, "_keys_to_ignore_on_save")
    return [k for k in keys if not _matches(k, ignore)]


def _split(keys: list[str], nbytes, limit: int) -> tuple[list[list[str]], list[str]]:
    """Keys in files of at most ``limit`` bytes (``nbytes(key)`` each), in order, a new file when
    the next tensor would pass the limit (as HF); and the files' names."""
    files: list[list[str]] = [[]]
    size = 0
    for k in keys:
        n = nbytes(k)
        if files[-1] and size + n > limit:
            files.append([])
            size = 0
        files[-1].append(k)
        size += n
    nfiles = len(files)
    names = [SAFE_WEIGHTS] if nfiles == 1 else [f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors" for i in range(nfiles)]
    return files, names


def save_state_dict_pretrained(
    path: str, state: dict[str, torch.Tensor], model: torch.nn.Module, max_shard_size: Union[int, str] = "5GB",
) -> None:
    """Write a full ``state`` dict of the unwrapped ``model`` (a model not run by elixir: DDP's,
    FSDP2's gathered one) in the same layout as :func:`save_pretrained`: each tensor once (tied
    weights under one name), HF's file split and index, ``config.json``, staged and renamed into
    place. Not collective: one process writes."""
    limit = parse_size(max_shard_size)
    keys = [k for k in _keys_to_save(model) if k in state]
    tensors = {k: state[k].detach().to("cpu").contiguous() for k in keys}
    files, names = _split(keys, lambda k: tensors[k].numel() * tensors[k].element_size(), limit)
    tmp = atomic.staging_dir(path, markers=(CONFIG, SAFE_WEIGHTS, SAFE_INDEX))
    try:
        for fkeys, name in zip(files, names):
            write_tensors(os.path.join(tmp, name), {k: tensors[k] for k in fkeys})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        _write_meta(tmp, model, files, names, total, None)
        atomic.commit(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_meta(tmp, model, files, names, total: int, dtype) -> None:
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for i, f in enumerate(files) for k in f}}
        p = os.path.join(tmp, SAFE_INDEX)
        with open(p, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        fsync_file(p)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        if dtype is not None:  # from_pretrained(dtype="auto") should get the saved dtype
            config = copy.deepcopy(config)
            config.dtype = dtype
        config.to_json_file(os.path.join(tmp, CONFIG))
        fsync_file(os.path.join(tmp, CONFIG))


# --------------------------------------------------------------------------------------------
# loading


def _checkpoint_files(root: str) -> dict[str, str]:
    """Saved key -> file name."""
    idx = os.path.join(root, SAFE_INDEX)
    if os.path.isfile(idx):
        with open(idx) as f:
            try:
                return dict(json.load(f)["weight_map"])
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{idx} is not a safetensors index ({e})") from None
    single = os.path.join(root, SAFE_WEIGHTS)
    if os.path.isfile(single):
        reader = Reader(root)
        return {k: SAFE_WEIGHTS for k in reader.handle(SAFE_WEIGHTS).keys()}
    raise CheckpointError(
        f"{root} holds neither {SAFE_WEIGHTS} nor {SAFE_INDEX}: not a Hugging Face safetensors checkpoint "
        "(convert .bin weights with transformers first)"
    )


def _peft_base(module) -> Optional[torch.nn.Module]:
    """The base model of a PEFT model (``peft.PeftModel``), or None for any other module."""
    if hasattr(module, "peft_config") and callable(getattr(module, "get_base_model", None)):
        return module.get_base_model()
    return None


def _base_key(key: str) -> str:
    """A PEFT model's key as the base model names it: without the ``base_model.model.`` prefix and
    the ``base_layer`` that LoRA wraps each adapted layer in."""
    key = key[len("base_model.model."):] if key.startswith("base_model.model.") else key
    return key.replace(".base_layer.", ".")


def _prefix_map(em: ElixirModule, saved: dict[str, str], model_keys: set[str]) -> dict[str, str]:
    """Model key -> saved key, adding or removing the ``base_model_prefix`` when that is what
    makes the names meet (a base model's checkpoint into a model with a head, and back). For a
    PEFT model the base model's checkpoint fills the frozen weights under their base names."""
    base = _peft_base(em.module)
    if base is not None:
        as_base: dict[str, str] = {}
        for k in model_keys:
            as_base.setdefault(_base_key(k), k)
        inner = _match_prefix(getattr(base, "base_model_prefix", "") or "", saved, set(as_base))
        return {as_base[k]: v for k, v in inner.items()}
    return _match_prefix(getattr(em.module, "base_model_prefix", "") or "", saved, model_keys)


def _match_prefix(prefix: str, saved: dict[str, str], model_keys: set[str]) -> dict[str, str]:
    direct = {k: k for k in saved if k in model_keys}
    if not prefix or len(direct) == len(saved):
        return direct
    add = {f"{prefix}.{k}": k for k in saved if f"{prefix}.{k}" in model_keys}
    strip = {k[len(prefix) + 1:]: k for k in saved if k.startswith(prefix + ".") and k[len(prefix) + 1:] in model_keys}
    return max((direct, add, strip), key=len)


def load_pretrained(path: str, model: ElixirModule, strict: bool = True) -> LoadReport:
    """Load the Hugging Face checkpoint directory ``path`` into ``model`` (see the module
    docstring). Collective: call on every rank. Returns the missing and unexpected keys."""
    if not isinstance(model, ElixirModule):
        raise TypeError("load_pretrained needs the ElixirModule")
    em = model
    error, plan, report = None, None, None
    try:
        plan, report = _plan_load(os.path.abspath(path), em, strict)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # a corrupt header, an unreadable file: the same error on every rank
        error = f"reading the checkpoint at {path} failed: {type(e).__name__}: {e}"
    agree(em.group, em.world_size, error)
    _apply(em, *plan)
    em.publish_updates()  # ZeRO-1/2 chunks: every rank wrote its slice of the payload
    return report


def _plan_load(root: str, em: ElixirModule, strict: bool):
    if not os.path.isdir(root):
        raise CheckpointError(f"no checkpoint directory at {root}")
    saved = _checkpoint_files(root)
    groups = _model_keys(em.module)
    tensors = _tensors(em)
    all_keys = {k for ks in groups.values() for k in ks}
    to_saved = _prefix_map(em, saved, all_keys)
    used_saved = set()
    source: dict[str, tuple[str, str]] = {}  # first model key -> (file, saved key)
    missing = []
    for first, ks in groups.items():
        hit = next((k for k in ks if k in to_saved), None)
        if hit is None:
            missing.extend(ks)
            continue
        for k in ks:
            if k in to_saved:
                used_saved.add(to_saved[k])
        sk = to_saved[hit]
        source[first] = (saved[sk], sk)
    unexpected = [k for k in saved if k not in used_saved]
    missing = [k for k in missing if not _matches(k, _patterns(em.module, "_keys_to_ignore_on_load_missing"))]
    tied = getattr(em.module, "all_tied_weights_keys", None) or {}
    missing = [k for k in missing if k not in tied]  # a tie's target is filled by its source
    if _peft_base(em.module) is not None:  # the adapters: initialised by PEFT, not in a base checkpoint
        trainable = {n for n, p in em.module.named_parameters() if p.requires_grad}
        missing = [k for k in missing if k not in trainable]
    skip_unexpected = _patterns(em.module, "_keys_to_ignore_on_load_unexpected") + list(_LEGACY_UNEXPECTED)
    unexpected = [k for k in unexpected if not _matches(k, skip_unexpected)]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint at {root} does not match the model: missing keys {sorted(missing)[:12]}"
            f"{' ...' if len(missing) > 12 else ''}, unexpected keys {sorted(unexpected)[:12]}"
            f"{' ...' if len(unexpected) > 12 else ''} (pass strict=False to load the keys that match)"
        )
    reader = Reader(root)
    problems = []
    for first, (fname, sk) in source.items():
        sl = reader.handle(fname).get_slice(sk)
        shape, want = tuple(sl.get_shape()), tuple(tensors[first].shape)
        if shape != want:
            problems.append(f"{sk}: shape {shape} in the checkpoint, {want} in the model")
        got = _DTYPES.get(sl.get_dtype())
        if got is None or got.is_floating_point != tensors[first].is_floating_point():
            problems.append(f"{sk}: dtype {sl.get_dtype()} in the checkpoint cannot fill a {tensors[first].dtype} tensor")
    if problems:
        raise CheckpointError("the checkpoint does not fit the model: " + "; ".join(problems[:8]))
    return (reader, source, tensors), LoadReport(sorted(missing), sorted(unexpected))


def _rows(reader: Reader, fname: str, key: str, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened tensor ``key``, reading only the rows that hold them."""
    sl = reader.handle(fname).get_slice(key)
    shape = list(sl.get_shape())
    if len(shape) == 0:
        return sl[:].reshape(-1)[start:end]
    row = 1
    for d in shape[1:]:
        row *= d
    r0, r1 = start // row, -(-end // row)
    return sl[r0:r1].reshape(-1)[start - r0 * row : end - r0 * row]


def _apply(em: ElixirModule, reader: Reader, source: dict, tensors: dict) -> None:
    pname = {id(em.params[s.index]): s for s in em.slots}
    by_param = {pname[id(tensors[k])].index: v for k, v in source.items() if id(tensors[k]) in pname}
    fmap = em.frozen_map
    fname_of = {id(fmap.params[s.index]): s for s in fmap.slots}
    by_frozen = {fname_of[id(tensors[k])].index: v for k, v in source.items() if id(tensors[k]) in fname_of}
    with torch.no_grad():
        em.cache.release_all()  # gathered payloads would be stale
        for first, (fname, sk) in source.items():  # unchunked frozen parameters and buffers: whole, every rank
            t = tensors[first]
            if id(t) not in pname and id(t) not in fname_of:
                t.copy_(reader.handle(fname).get_tensor(sk).to(t.dtype))
        for chunk in em.frozen_chunks:  # this rank's rows only, straight into the shard, in its dtype
            pieces = [p for p in fmap.shard_pieces(chunk.spec) if p.param_index in by_frozen]
            if not pieces:
                continue
            with chunk.shard_access(write=True) as shard:  # a disk shard: staged, written back
                for piece in pieces:
                    fname, sk = by_frozen[piece.param_index]
                    src = _rows(reader, fname, sk, piece.start, piece.start + piece.hi - piece.lo)
                    shard[piece.lo : piece.hi].copy_(src)
        for chunk in em.chunks:
            spec = chunk.spec
            lo, hi = spec.shard_offset, spec.shard_offset + spec.shard_numel
            todo = [i for i in em.param_map.by_chunk[chunk.index] if i in by_param]
            if not todo:
                continue
            # a disk master (and a disk shard): staged, written back
            with staged(em.disk_store, [chunk.index]), chunk.shard_access(write=True):
                for i in todo:
                    s = em.slots[i]
                    a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                    if a >= b:
                        continue
                    fname, sk = by_param[i]
                    src = _rows(reader, fname, sk, a - s.offset, b - s.offset)
                    chunk.master[a - lo : b - lo].copy_(src)  # converts (bf16 file -> fp32 master)
                    if chunk.shard is not chunk.master:
                        chunk.shard[a - lo : b - lo].copy_(src)
