"""transformers' own checkpoint-key conversions, for ``load_pretrained`` and ``save_pretrained``.

A Hugging Face checkpoint's keys are not always the model's names. transformers 5 keeps per-model
rules (``transformers.conversion_mapping.get_model_conversion_mapping``: ``WeightRenaming`` and
``WeightConverter``) that ``from_pretrained`` applies and ``save_pretrained`` reverses: GPT-NeoX
stores ``embed_out.weight`` for the module ``lm_head``; Mixtral, Qwen2/3-MoE, DeepSeek and many
more store their experts one by one (``experts.N.w1.weight``) where the model holds one 3-D tensor
(``experts.gate_up_proj``). This module applies those rules unchanged, without the whole tensors:

- **Loading.** Every checkpoint key is renamed with transformers' ``rename_source_key`` (the same
  call, order and base-model-prefix rule as ``from_pretrained``). A key a converter collects joins
  its target's group, in transformers' natural key order. To learn where each row of a fused tensor
  comes from, the converter's own ``convert`` runs on small *index tensors* (one int64 per row of
  each stored tensor, its last dimension collapsed to 1), and once more with a last dimension of 2
  to check that the operations moved whole rows. Then a rank reads, for the rows its shard
  covers, only the matching rows of the per-expert tensors (:class:`Fused`). Operations that move
  elements inside the last dimension (a transpose) fail that check; such a tensor is converted
  whole, by transformers, and sliced (:class:`Converted`).
- **Saving.** The model's tensors are reverted with transformers' ``revert_weight_conversion`` one
  file at a time; the keys a reversed converter needs together (a fused tensor's parts) stay in
  one file, and a meta-tensor revert of the whole model checks the files' names and shapes.

Without transformers (or for a module that is no ``PreTrainedModel``), keys are used as they are.
:func:`read_rows` is the one place a Hugging Face checkpoint's bytes are read.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from elixir.checkpoint.errors import CheckpointError
from elixir.checkpoint.format import Reader


def read_rows(reader: Reader, fname: str, key: str, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` (along dim 0) of tensor ``key`` in ``fname``; a 0-d tensor whole. Every
    read of a Hugging Face checkpoint goes through here (the tests count what each rank reads)."""
    handle = reader.handle(fname)
    sl = handle.get_slice(key)
    if len(sl.get_shape()) == 0:  # (a safetensors slice of a 0-d tensor cannot be indexed)
        return handle.get_tensor(key)
    return sl[r0:r1]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass(frozen=True)
class Stored:
    """A tensor of the checkpoint, as its file header describes it."""

    file: str
    key: str
    shape: tuple
    dtype: torch.dtype


def _read_flat(reader: Reader, st: Stored, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened stored tensor, reading only the dim-0 rows that hold them."""
    if len(st.shape) <= 1:
        return read_rows(reader, st.file, st.key, start, end).reshape(-1)
    row = _numel(st.shape[1:])
    r0, r1 = start // row, -(-end // row)
    return read_rows(reader, st.file, st.key, r0, r1).reshape(-1)[start - r0 * row : end - r0 * row]


class Source:
    """Where one model tensor's values are in the checkpoint: its shape and dtype there, the stored
    tensors it reads, and :meth:`read` of a range of its flattened elements."""

    shape: tuple
    dtype: torch.dtype
    stored: list

    def read(self, reader: Reader, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError

    def read_all(self, reader: Reader) -> torch.Tensor:
        return self.read(reader, 0, _numel(self.shape)).reshape(self.shape)


class Direct(Source):
    """A stored tensor under the model's name or a renamed one."""

    def __init__(self, st: Stored) -> None:
        self.stored, self.shape, self.dtype = [st], st.shape, st.dtype

    def read(self, reader: Reader, start: int, end: int) -> torch.Tensor:
        return _read_flat(reader, self.stored[0], start, end)


class Fused(Source):
    """A tensor a converter assembles from whole rows of stored tensors (experts merged and
    concatenated): row ``r`` of the flattened ``(-1, unit)`` view is row ``rows[r]`` of the stored
    tensors' rows laid end to end (``bases``: where each starts)."""

    def __init__(self, stored: list, shape: tuple, rows: torch.Tensor, bases: list) -> None:
        self.stored, self.shape, self.dtype = stored, tuple(shape), stored[0].dtype
        self.unit = int(shape[-1])
        self.rows = rows
        self.bases = torch.tensor(bases, dtype=torch.int64)

    def runs(self, r0: int, r1: int) -> list[tuple[int, int, int]]:
        """(stored index, first row, end row) of the stored rows behind rows ``[r0, r1)``, in order."""
        ids = self.rows[r0:r1]
        which = torch.searchsorted(self.bases, ids, right=True) - 1
        local = ids - self.bases[which]
        brk = torch.ones(len(ids), dtype=torch.bool)
        if len(ids) > 1:
            brk[1:] = (which[1:] != which[:-1]) | (local[1:] != local[:-1] + 1)
        starts = torch.nonzero(brk).flatten().tolist() + [len(ids)]
        return [(int(which[a]), int(local[a]), int(local[b - 1]) + 1) for a, b in zip(starts[:-1], starts[1:])]

    def read(self, reader: Reader, start: int, end: int) -> torch.Tensor:
        u = self.unit
        r0, r1 = start // u, -(-end // u)
        parts = [_read_flat(reader, self.stored[i], lo * u, hi * u) for i, lo, hi in self.runs(r0, r1)]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat[start - r0 * u : end - r0 * u]


class _Group:
    """A converter and the stored tensors it collects for one target (transformers' order)."""

    def __init__(self, converter: Any, name: str, model: torch.nn.Module) -> None:
        self.converter, self.name, self.model = converter, name, model
        self.items: list[tuple[str, Stored]] = []  # (source pattern, stored tensor)
        self._cached: Optional[tuple[int, dict]] = None

    def convert(self, tensors: list) -> dict[str, torch.Tensor]:
        """transformers' ``convert`` of this group with ``tensors`` standing for the stored ones."""
        conv = copy.deepcopy(self.converter)
        for (pattern, st), t in zip(self.items, tensors):
            conv.add_tensor(self.name, st.key, pattern, t)
        out = conv.convert(self.name, model=self.model, config=getattr(self.model, "config", None))
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}

    def converted(self, reader: Reader) -> dict[str, torch.Tensor]:
        """The group converted from the whole stored tensors (kept for the next call on the same reader)."""
        if self._cached is None or self._cached[0] != id(reader):
            self._cached = None  # drop the previous values before reading new ones
            self._cached = (id(reader), self.convert([_read_flat(reader, st, 0, _numel(st.shape)).reshape(st.shape)
                                                      for _, st in self.items]))
        return self._cached[1]


class Converted(Source):
    """One output of a converter whose operations are not whole-row moves: read whole, converted by
    transformers, then sliced."""

    def __init__(self, group: _Group, name: str, shape: tuple, dtype: torch.dtype) -> None:
        self.group, self.name, self.shape, self.dtype = group, name, tuple(shape), dtype
        self.stored = [st for _, st in group.items]

    def read(self, reader: Reader, start: int, end: int) -> torch.Tensor:
        return self.group.converted(reader)[self.name].reshape(-1)[start:end]


# --------------------------------------------------------------------------------------------
# transformers' rules


def hf_model(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (False without transformers)."""
    try:
        # optional dependency: transformers
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


def load_transforms(model: torch.nn.Module) -> list:
    """transformers' conversion list for loading into ``model`` (``from_pretrained``'s), or [] for
    a module that is no ``PreTrainedModel`` or a transformers without conversion rules."""
    if not hf_model(model):
        return []
    try:
        # optional dependency: transformers >= 5 (its checkpoint conversion rules)
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    return list(get_model_conversion_mapping(model))


@dataclass
class KeyMap:
    """The checkpoint seen through the model's names: model key -> :class:`Source`, and for each
    model key the checkpoint keys it reads."""

    sources: dict = field(default_factory=dict)
    used: dict = field(default_factory=dict)


def map_checkpoint(model: Optional[torch.nn.Module], stored: dict, model_keys: set, transforms: list) -> KeyMap:
    """Rename every stored key as ``from_pretrained`` does (``transforms`` from :func:`load_transforms`)
    and build the source of each model key the renamed keys name. ``stored``: checkpoint key ->
    :class:`Stored`. Keys that reach no model key are left out (the caller reports them)."""
    if not transforms:
        return KeyMap({k: Direct(st) for k, st in stored.items()}, {k: [k] for k in stored})
    # optional dependency: transformers (the module's own renaming and key order)
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", "") or ""
    meta = dict.fromkeys(model_keys, True)  # transformers only asks whether a name exists
    out = KeyMap()
    groups: dict[str, _Group] = {}
    for key in sorted(stored, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in model_keys and key in model_keys:  # as from_pretrained: not to be renamed
            renamed, pattern = rename_source_key(key, [], [], prefix, meta)
        if pattern is None:
            out.sources.setdefault(renamed, Direct(stored[key]))
            out.used.setdefault(renamed, []).append(key)
            continue
        group = groups.get(renamed)
        if group is None:
            group = groups[renamed] = _Group(copy.deepcopy(by_pattern[pattern]), renamed, model)
        group.items.append((pattern, stored[key]))
    for group in groups.values():
        for name, src in _group_sources(group).items():
            out.sources.setdefault(name, src)
            out.used.setdefault(name, []).extend(st.key for st in src.stored)
    return out


def _group_sources(group: _Group) -> dict[str, Source]:
    """Each output of ``group``: :class:`Fused` where the converter moves whole rows, else :class:`Converted`."""
    fused = _row_map(group)
    if fused is not None:
        return fused
    try:
        metas = group.convert([torch.empty(st.shape, dtype=st.dtype, device="meta") for _, st in group.items])
    except Exception as e:
        raise CheckpointError(
            f"transformers' conversion {type(group.converter).__name__}{group.converter.source_patterns} -> "
            f"{group.name} failed on the checkpoint's shapes: {type(e).__name__}: {e}"
        ) from None
    return {k: Converted(group, k, tuple(v.shape), v.dtype) for k, v in metas.items()}


def _index_tensors(items: list, width: int) -> tuple[list, list]:
    """One int64 per row of each stored tensor (its last dimension replaced by ``width``): row id * width + column."""
    tensors, bases, base = [], [], 0
    for _, st in items:
        rows = _numel(st.shape[:-1])
        ids = (torch.arange(rows, dtype=torch.int64) + base).reshape(*st.shape[:-1], 1)
        tensors.append(ids * width + torch.arange(width, dtype=torch.int64))
        bases.append(base)
        base += rows
    return tensors, bases


def _row_map(group: _Group) -> Optional[dict[str, Source]]:
    """The outputs of ``group`` as :class:`Fused` sources, when its operations only move whole rows
    of stored tensors that share their last dimension and dtype; None otherwise."""
    stored = [st for _, st in group.items]
    if any(len(st.shape) < 2 for st in stored) or len({(st.shape[-1], st.dtype) for st in stored}) != 1:
        return None
    try:
        one, bases = _index_tensors(group.items, 1)
        two, _ = _index_tensors(group.items, 2)
        out1, out2 = group.convert(one), group.convert(two)
    except Exception:  # an operation that needs real values: converted whole instead
        return None
    unit = stored[0].shape[-1]
    result: dict[str, Source] = {}
    for name, t1 in out1.items():
        t2 = out2.get(name)
        if (t2 is None or t1.dtype != torch.int64 or t1.dim() < 1 or t1.shape[-1] != 1
                or tuple(t2.shape) != tuple(t1.shape[:-1]) + (2,)
                or not torch.equal(t2[..., 0], t1[..., 0] * 2) or not torch.equal(t2[..., 1], t2[..., 0] + 1)):
            return None
        result[name] = Fused(stored, tuple(t1.shape[:-1]) + (unit,), t1.reshape(-1).clone(), bases)
    return result


def used_transforms(transforms: list) -> list:
    """The transforms that matched a key, as ``from_pretrained`` keeps them on the model
    (``model._weight_conversions``) for its next ``save_pretrained``."""
    return [t for t in transforms if t.was_used()]


# --------------------------------------------------------------------------------------------
# saving: transformers' revert


def _reverse_converters(model: torch.nn.Module) -> list:
    """The reversed converters ``revert_weight_conversion`` applies to ``model`` (the same choice of list)."""
    # optional dependency: transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (  # optional dependency: transformers
        PrefixChange,
        WeightConverter,
    )

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    return [c for c in reverse if isinstance(c, WeightConverter)]


def to_checkpoint(model: torch.nn.Module, state: dict) -> dict:
    """``state`` (model keys, whole conversion groups) under the checkpoint's keys, converted by
    transformers' ``revert_weight_conversion``; unchanged for a module that is no ``PreTrainedModel``."""
    if not hf_model(model) or not state:
        return state
    try:
        # optional dependency: transformers >= 5 (its checkpoint conversion rules)
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    return revert_weight_conversion(model, dict(state))


def save_groups(model: torch.nn.Module, keys: list, shapes: dict) -> list[list[str]]:
    """``keys`` (model keys to save, in order) in groups that must be reverted together (the parts
    of one reversed converter); singletons where nothing converts. ``shapes``: key -> (shape,
    dtype), for the check that reverting file by file gives what reverting the whole model gives
    (else one group holds every key, with a warning)."""
    if not hf_model(model):
        return [[k] for k in keys]
    try:
        # optional dependency: transformers >= 5 (its checkpoint conversion rules)
        from transformers.core_model_loading import apply_converters
        reverse = _reverse_converters(model)
    except ImportError:
        return [[k] for k in keys]
    groups: dict[Any, list[str]] = {}
    for k in keys:
        renamed, pattern = apply_converters(k, reverse) if reverse else (k, None)
        groups.setdefault(renamed if pattern is not None else ("", k), []).append(k)
    out = list(groups.values())
    if reverse and _meta_names(model, out, shapes) != _meta_names(model, [keys], shapes):
        warnings.warn(
            "save_pretrained: reverting transformers' conversions group by group does not give what reverting "
            "the whole model gives; saving every tensor in one file", stacklevel=3,
        )
        return [list(keys)]
    return out


def checkpoint_shapes(model: torch.nn.Module, keys: list, shapes: dict) -> dict[str, tuple]:
    """The checkpoint keys (and (shape, dtype)) that ``keys`` of the model are saved as, reverted on meta tensors."""
    meta = {k: torch.empty(shapes[k][0], dtype=shapes[k][1], device="meta") for k in keys}
    return {k: (tuple(v.shape), v.dtype) for k, v in to_checkpoint(model, meta).items()}


def _meta_names(model, groups, shapes) -> dict:
    out: dict = {}
    for g in groups:
        out.update(checkpoint_shapes(model, g, shapes))
    return out
