"""Hugging Face checkpoint directories in and out of an ElixirModule, streamed shard by shard.

``load_pretrained(path, model, strict=True, submodule=None)`` reads ``model.safetensors``, or the
sharded files listed by ``model.safetensors.index.json``, into a wrapped model: each rank reads,
through the ``safetensors`` library's lazy slices, only the rows its own shards (and replicated
chunks, frozen parameters and buffers) need, and converts dtypes on the fly (a bf16 checkpoint into
fp32 masters). It works at any world size and with chunks whose master is on disk (staged one
chunk at a time). Keys follow transformers: its per-model conversion rules
(:mod:`elixir.checkpoint.hf_conversion`: GPT-NeoX's ``embed_out``, MoE experts stored one by one and
fused into 3-D tensors, each rank reading only the expert rows its shard covers) are applied as
``from_pretrained`` applies them; a tied weight saved once under either name fills every name; keys
the model's ``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected`` patterns
name, and the legacy ``rotary_emb.inv_freq`` / ``position_ids`` entries, are not reported; a
checkpoint of the base model loads into a model with a head and vice versa (the
``base_model_prefix``), and into a PEFT model (``peft.get_peft_model``): the base weights fill the
frozen chunks under their base names (``base_model.model.`` and LoRA's ``.base_layer`` dropped), each
rank reading only its shard's rows in the chunk's dtype, and the adapters, which no base checkpoint
holds, are not reported missing. The module loaded is the Hugging Face model inside the wrapped
one (:mod:`elixir.checkpoint.hf_target`: a LightningModule's ``self.model`` is found by itself, or
named with ``submodule=``). Every rank validates names, shapes and dtypes from the file headers
first and agrees; with ``strict`` any missing or unexpected key raises
:class:`~elixir.checkpoint.CheckpointError` on every rank, before anything is modified. Otherwise
the report is returned, as ``load_state_dict`` returns it.

``save_pretrained(path, model, max_shard_size="5GB", dtype=None, submodule=None)`` writes the layout
``transformers.AutoModel*.from_pretrained`` reads: ``model.safetensors`` (one shard) or
``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``, and ``config.json`` when
the model has a config; under the checkpoint's keys (transformers' conversions reverted: experts
split again, ``embed_out`` for GPT-NeoX). Tied weights are saved once, under the source name
``all_tied_weights_keys`` gives (otherwise the first name). Files are assigned to ranks in turn;
for each file every rank takes part in gathering the chunks that cover it, one chunk at a time, and
only the file's writer keeps the values, so no rank ever holds more than one file's tensors plus
one gathered chunk (never the whole model). A PEFT model is saved as PEFT saves it: its adapters
(``adapter_config.json`` + ``adapter_model.safetensors``, :mod:`elixir.checkpoint.peft_adapter`).
The directory is staged and renamed into place like :func:`~elixir.checkpoint.save`'s
(:mod:`elixir.checkpoint.atomic`).
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

from elixir import distributed as edist
from elixir.checkpoint import atomic, hf_conversion
from elixir.checkpoint.errors import CheckpointError, agree
from elixir.checkpoint.format import Reader, write_tensors
from elixir.checkpoint.hf_target import base_key, peft_base, resolve
from elixir.checkpoint.peft_adapter import save_adapter
from elixir.fileio import fsync_file
from elixir.offload.pipeline import staged
from elixir.progress import Progress
from elixir.wrapper import lowbit_state
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.state_dict import chunk_values

__all__ = ["load_pretrained", "save_pretrained", "save_state_dict_pretrained", "read_pretrained", "LoadReport", "SAFE_WEIGHTS", "SAFE_INDEX"]

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
    """What :func:`load_pretrained` found, in transformers' terms (keys of the loaded module)."""

    missing_keys: list = field(default_factory=list)
    unexpected_keys: list = field(default_factory=list)


def _need_wrapper(model, what: str) -> ElixirModule:
    if isinstance(model, ElixirModule):
        return model
    raise TypeError(
        f"{what} needs the ElixirModule (got {type(model).__name__}): the wrapped model is only there once a "
        "plan has been applied. In Lightning that is trainer.strategy.elixir_module, from setup on: "
        "configure_model runs before the wrapping, so pass ElixirStrategy(pretrained=dir) instead, or load in "
        "on_fit_start (docs/integrations.md)"
    )


# --------------------------------------------------------------------------------------------
# what the model holds, under HF's key conventions


def _model_keys(model: torch.nn.Module) -> dict[str, list[str]]:
    """State-dict keys of each distinct tensor of the (unwrapped) ``model``, grouped: first key ->
    every key naming it."""
    names: dict[int, list[str]] = {}
    for k, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(k)
    return {ks[0]: ks for ks in names.values()}


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


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= int(d)
    return n


# --------------------------------------------------------------------------------------------
# saving


def save_pretrained(
    path: str,
    model: ElixirModule,
    max_shard_size: Union[int, str] = "5GB",
    dtype: Optional[torch.dtype] = None,
    submodule: Optional[str] = None,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory at ``path`` (see the module
    docstring), with floating tensors in ``dtype`` (default: chunked parameters as their fp32
    masters, other tensors as they are). ``submodule``: the attribute path of the Hugging Face model
    inside the wrapped module (default: found by itself, :func:`~elixir.checkpoint.hf_target.resolve`).
    Collective: call on every rank."""
    em = _need_wrapper(model, "save_pretrained")
    target, _ = resolve(em.module, submodule)
    if peft_base(target) is not None:
        save_adapter(path, em, target)
        return
    limit = parse_size(max_shard_size)
    tensors = dict(target.state_dict(keep_vars=True))
    keys = _keys_to_save(target)
    slot_of = {s.name: s for s in em.slots + em.frozen_map.slots}
    pname = {id(em.params[s.index]): s.name for s in em.slots}
    pname.update({id(em.frozen_map.params[s.index]): s.name for s in em.frozen_map.slots})

    def out_dtype(k: str) -> torch.dtype:
        t = tensors[k]
        base = torch.float32 if id(t) in pname and not em.frozen_map.slot_of(t) else t.dtype
        return dtype if dtype is not None and t.is_floating_point() else base

    shapes = {k: (tuple(tensors[k].shape), out_dtype(k)) for k in keys}
    files, saved = _plan_files(target, keys, shapes, limit)
    names = _file_names(len(files))

    def finish(tmp: str) -> None:  # rank 0, once every file is written: the index and config, last
        _write_meta(tmp, target, saved, names, dtype)

    with atomic.collective_save(path, em.group, em.world_size, em.rank, (CONFIG, SAFE_WEIGHTS, SAFE_INDEX),
                                finish) as stage:
        tmp, error = stage.tmp, None
        em.cache.release_all()
        for fi, fkeys in enumerate(files):
            mine = em.rank == fi % em.world_size
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
                try:  # under the checkpoint's keys: transformers' conversions reverted
                    write_tensors(os.path.join(tmp, names[fi]), hf_conversion.to_checkpoint(target, {k: out[k] for k in fkeys}))
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


def _plan_files(model: torch.nn.Module, keys: list[str], shapes: dict, limit: int) -> tuple[list[list[str]], list[dict]]:
    """Model keys in files of at most ``limit`` bytes, in order, a new file when the next group of
    tensors would pass the limit (as HF); the tensors transformers reverts together (a fused
    expert tensor's parts) stay in one file. With each file, its checkpoint keys -> (shape, dtype)."""
    files: list[list[str]] = [[]]
    size = 0
    for group in hf_conversion.save_groups(model, keys, shapes):
        n = sum(_nbytes(*shapes[k]) for k in group)
        if files[-1] and size + n > limit:
            files.append([])
            size = 0
        files[-1].extend(group)
        size += n
    return files, [hf_conversion.checkpoint_shapes(model, f, shapes) for f in files]


def _file_names(nfiles: int) -> list[str]:
    return [SAFE_WEIGHTS] if nfiles == 1 else [f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors" for i in range(nfiles)]


def save_state_dict_pretrained(
    path: str, state: dict[str, torch.Tensor], model: torch.nn.Module, max_shard_size: Union[int, str] = "5GB",
) -> None:
    """Write a full ``state`` dict of the unwrapped ``model`` (a model not run by elixir: DDP's,
    FSDP2's gathered one) in the same layout as :func:`save_pretrained`: each tensor once (tied
    weights under one name), under the checkpoint's keys, HF's file split and index,
    ``config.json``, staged and renamed into place. Not collective: one process writes."""
    limit = parse_size(max_shard_size)
    keys = [k for k in _keys_to_save(model) if k in state]
    tensors = {k: state[k].detach().to("cpu").contiguous() for k in keys}
    shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
    files, saved = _plan_files(model, keys, shapes, limit)
    names = _file_names(len(files))
    tmp = atomic.staging_dir(path, markers=(CONFIG, SAFE_WEIGHTS, SAFE_INDEX))
    try:
        for fkeys, name in zip(files, names):
            write_tensors(os.path.join(tmp, name), hf_conversion.to_checkpoint(model, {k: tensors[k] for k in fkeys}))
        _write_meta(tmp, model, saved, names, None)
        atomic.commit(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_meta(tmp, model, saved: list[dict], names: list[str], dtype) -> None:
    """The index (several files) and ``config.json`` of a save whose files hold ``saved``."""
    if len(saved) > 1:
        total = sum(_nbytes(*v) for f in saved for v in f.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for i, f in enumerate(saved) for k in f}}
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
    hint = (" (a PEFT adapter directory: load_pretrained reads its base model's checkpoint)"
            if os.path.isfile(os.path.join(root, "adapter_config.json")) else " (convert .bin weights with transformers first)")
    raise CheckpointError(
        f"{root} holds neither {SAFE_WEIGHTS} nor {SAFE_INDEX}: not a Hugging Face safetensors checkpoint{hint}"
    )


def _headers(reader: Reader, saved: dict[str, str]) -> dict[str, hf_conversion.Stored]:
    """Every saved tensor's shape and dtype, from the file headers."""
    out = {}
    for k, fname in saved.items():
        try:
            sl = reader.handle(fname).get_slice(k)
        except CheckpointError:
            raise
        except Exception:
            raise CheckpointError(f"tensor {k!r} is missing from {fname}") from None
        dt = _DTYPES.get(sl.get_dtype())
        if dt is None:
            raise CheckpointError(f"{k}: dtype {sl.get_dtype()} in the checkpoint, which elixir cannot read")
        out[k] = hf_conversion.Stored(fname, k, tuple(sl.get_shape()), dt)
    return out


def read_pretrained(path: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the Hugging Face checkpoint directory ``path``, whole, under the names of the
    (unwrapped) ``model``: transformers' conversions applied as in :func:`load_pretrained`; a key no
    conversion renames keeps its name. For a model not run by elixir (DDP's, FSDP2's); not collective."""
    root = os.path.abspath(path)
    saved = _checkpoint_files(root)
    reader = Reader(root)
    keymap = hf_conversion.map_checkpoint(model, _headers(reader, saved), set(model.state_dict(keep_vars=True)),
                                          hf_conversion.load_transforms(model))
    return {name: src.read_all(reader) for name, src in keymap.sources.items()}


def _names(target: torch.nn.Module, model_keys: set[str]) -> tuple[torch.nn.Module, dict[str, str]]:
    """The Hugging Face model whose names a checkpoint uses, and its name -> model key: the target's
    own keys, or for a PEFT model its base model's (``base_model.model.`` and ``.base_layer`` dropped)."""
    base = peft_base(target)
    if base is None:
        return target, {k: k for k in model_keys}
    as_base: dict[str, str] = {}
    for k in sorted(model_keys):
        as_base.setdefault(base_key(k), k)
    return base, as_base


def _match_prefix(prefix: str, saved: dict, model_keys: set[str]) -> dict[str, str]:
    """Model key -> saved key, adding or removing the ``base_model_prefix`` when that is what
    makes the names meet (a base model's checkpoint into a model with a head, and back)."""
    direct = {k: k for k in saved if k in model_keys}
    if not prefix or len(direct) == len(saved):
        return direct
    add = {f"{prefix}.{k}": k for k in saved if f"{prefix}.{k}" in model_keys}
    strip = {k[len(prefix) + 1:]: k for k in saved if k.startswith(prefix + ".") and k[len(prefix) + 1:] in model_keys}
    return max((direct, add, strip), key=len)


def load_pretrained(path: str, model: ElixirModule, strict: bool = True, submodule: Optional[str] = None) -> LoadReport:
    """Load the Hugging Face checkpoint directory ``path`` into ``model`` (see the module
    docstring). ``submodule``: the attribute path of the Hugging Face model inside the wrapped
    module (default: found by itself). Collective: call on every rank. Returns the missing and
    unexpected keys."""
    em = _need_wrapper(model, "load_pretrained")
    error, plan, report = None, None, None
    try:
        target, _ = resolve(em.module, submodule)
        plan, report = _plan_load(os.path.abspath(path), target, strict)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # a corrupt header, an unreadable file: the same error on every rank
        error = f"reading the checkpoint at {path} failed: {type(e).__name__}: {e}"
    agree(em.group, em.world_size, error)
    reader, source, tensors, hf, transforms = plan
    _apply(em, reader, source, tensors)
    em.publish_updates()  # ZeRO-1/2 chunks: every rank wrote its slice of the payload
    if transforms:  # as from_pretrained: the conversions used, for the next save
        hf._weight_conversions = hf_conversion.used_transforms(transforms)
    return report


def _plan_load(root: str, target: torch.nn.Module, strict: bool):
    if not os.path.isdir(root):
        raise CheckpointError(f"no checkpoint directory at {root}")
    saved = _checkpoint_files(root)
    reader = Reader(root)
    stored = _headers(reader, saved)
    groups = _model_keys(target)
    tensors = dict(target.state_dict(keep_vars=True))
    hf, as_model = _names(target, {k for ks in groups.values() for k in ks})
    transforms = hf_conversion.load_transforms(hf)
    keymap = hf_conversion.map_checkpoint(hf, stored, set(as_model), transforms)
    inner = _match_prefix(getattr(hf, "base_model_prefix", "") or "", keymap.sources, set(as_model))
    to_renamed = {as_model[k]: v for k, v in inner.items()}  # model key -> renamed checkpoint key
    used_saved: set[str] = set()
    source: dict[str, hf_conversion.Source] = {}  # first model key -> where its values are
    missing = []
    for first, ks in groups.items():
        hit = next((k for k in ks if k in to_renamed), None)
        if hit is None:
            missing.extend(ks)
            continue
        for k in ks:
            if k in to_renamed:
                used_saved.update(keymap.used[to_renamed[k]])
        source[first] = keymap.sources[to_renamed[hit]]
    unexpected = [k for k in saved if k not in used_saved]
    missing = [k for k in missing if not _matches(k, _patterns(target, "_keys_to_ignore_on_load_missing"))]
    tied = getattr(target, "all_tied_weights_keys", None) or {}
    missing = [k for k in missing if k not in tied]  # a tie's target is filled by its source
    if hf is not target:  # the adapters: initialised by PEFT, not in a base checkpoint
        trainable = {n for n, p in target.named_parameters() if p.requires_grad}
        missing = [k for k in missing if k not in trainable]
    skip_unexpected = _patterns(hf, "_keys_to_ignore_on_load_unexpected") + list(_LEGACY_UNEXPECTED)
    unexpected = [k for k in unexpected if not _matches(k, skip_unexpected)]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint at {root} does not match the model: missing keys {sorted(missing)[:12]}"
            f"{' ...' if len(missing) > 12 else ''}, unexpected keys {sorted(unexpected)[:12]}"
            f"{' ...' if len(unexpected) > 12 else ''} (pass strict=False to load the keys that match)"
        )
    problems = []
    for first, src in source.items():
        shape, want = tuple(src.shape), tuple(tensors[first].shape)
        what = ", ".join(st.key for st in src.stored[:2]) + (" ..." if len(src.stored) > 2 else "")
        if shape != want:
            problems.append(f"{what}: shape {shape} in the checkpoint, {want} in the model ({first})")
        if src.dtype.is_floating_point != tensors[first].is_floating_point():
            problems.append(f"{what}: dtype {src.dtype} in the checkpoint cannot fill a {tensors[first].dtype} tensor")
    if problems:
        raise CheckpointError("the checkpoint does not fit the model: " + "; ".join(problems[:8]))
    return (reader, source, tensors, hf, transforms), LoadReport(sorted(missing), sorted(unexpected))


def _apply(em: ElixirModule, reader: Reader, source: dict, tensors: dict) -> None:
    pname = {id(em.params[s.index]): s for s in em.slots}
    by_param = {pname[id(tensors[k])].index: v for k, v in source.items() if id(tensors[k]) in pname}
    fmap = em.frozen_map
    fname_of = {id(fmap.params[s.index]): s for s in fmap.slots}
    by_frozen = {fname_of[id(tensors[k])].index: v for k, v in source.items() if id(tensors[k]) in fname_of}
    with torch.no_grad():
        em.cache.release_all()  # gathered payloads would be stale
        for first, src in source.items():  # unchunked frozen parameters and buffers: whole, every rank
            t = tensors[first]
            if id(t) not in pname and id(t) not in fname_of:
                t.copy_(src.read_all(reader).to(t.dtype))
        progress = Progress(f"loading {os.path.basename(reader.root)}", len(em.frozen_chunks) + len(em.chunks),
                            enabled=edist.get_rank() == 0)
        for chunk in progress.over(em.frozen_chunks):  # this rank's rows only, into the shard, in its dtype
            pieces = [p for p in fmap.shard_pieces(chunk.spec) if p.param_index in by_frozen]
            if not pieces:
                continue
            with chunk.shard_access(write=True) as shard:  # a disk shard: staged, written back
                for piece in pieces:
                    src = by_frozen[piece.param_index].read(reader, piece.start, piece.start + piece.hi - piece.lo)
                    shard[piece.lo : piece.hi].copy_(src)
        for chunk in progress.over(em.chunks):
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
                    src = by_param[i].read(reader, a - s.offset, b - s.offset)
                    # converts (bf16 file -> fp32 master); a bf16-kahan master's compensation too
                    lowbit_state.load_values(em, chunk, a - lo, b - lo, src)
