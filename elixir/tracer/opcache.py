"""Memoise meta kernels of functional ops: a transformer repeats the same ops layer after layer.

Many meta kernels are Python reference implementations costing 100-300 us per call. For an op
whose schema has no alias annotations (no views, no in-place or ``out=`` arguments), the outputs'
metadata is a pure function of the inputs' metadata and the other arguments. The cache keys on
``(op, shapes, strides, storage offsets, dtypes, devices, other args)`` and, on a hit, builds fresh
meta outputs with the recorded shapes, strides, offsets, dtypes and storage sizes. An op whose
outputs alias an input or one another (or are not meta) is never cached for that key. A real
CPU scalar argument is keyed by its value.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["MetaOpCache"]

_MISS = object()


class _TensorSpec:
    __slots__ = ("shape", "stride", "offset", "dtype", "nbytes", "minimal")

    def __init__(self, t: torch.Tensor):
        self.shape = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.nbytes = t.untyped_storage().nbytes()
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if all(self.shape) else 0
        self.minimal = self.offset == 0 and self.nbytes == span * t.element_size()

    def make(self) -> torch.Tensor:
        if self.minimal:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        t = torch.empty(0, dtype=self.dtype, device="meta")
        t.set_(torch.UntypedStorage(self.nbytes, device="meta"), self.offset, self.shape, self.stride)
        return t


def _key_of(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_neg() or x.is_conj():
            raise TypeError
        if x.device.type != "meta":  # a real (CPU scalar) tensor: its value may matter
            if x.numel() > 1:
                raise TypeError
            return (x.shape, x.dtype, x.device.type, x.item() if x.numel() else None)
        return (x.shape, x.stride(), x.storage_offset(), x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_key_of(v) for v in x))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError
    hash(x)
    return (type(x).__name__, x)


def _spec_of(out: Any, seen: set) -> Any:
    if isinstance(out, torch.Tensor):
        if out.device.type != "meta" or out.layout != torch.strided:
            raise TypeError
        sid = id(out.untyped_storage())
        if sid in seen:
            raise TypeError  # outputs share storage: not a plain functional op
        seen.add(sid)
        return _TensorSpec(out)
    if isinstance(out, (list, tuple)):
        return (type(out), [_spec_of(v, seen) for v in out])
    if out is None or isinstance(out, (bool, int, float)):
        return ("v", out)
    raise TypeError


def _build(spec: Any) -> Any:
    if isinstance(spec, _TensorSpec):
        return spec.make()
    kind, val = spec
    if kind == "v":
        return val
    return kind([_build(v) for v in val])


class MetaOpCache:
    """``lookup``/``store`` meta outputs of functional ops (see the module docstring)."""

    def __init__(self) -> None:
        self._specs: dict = {}
        self._functional: dict = {}
        self.hits = 0
        self.misses = 0

    def _is_functional(self, func: Any) -> bool:
        ok = self._functional.get(func)
        if ok is None:
            schema = func._schema
            ok = (
                all(a.alias_info is None for a in schema.arguments)
                and all(r.alias_info is None for r in schema.returns)
                and not schema.is_mutable
                and func.namespace in ("aten", "prims")
            )
            self._functional[func] = ok
        return ok

    def key(self, func: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
        if not self._is_functional(func):
            return None
        try:
            return (func, _key_of(args), _key_of(tuple(sorted(kwargs.items()))))
        except TypeError:
            return None

    def lookup(self, key: tuple) -> Any:
        spec = self._specs.get(key, _MISS)
        if spec is _MISS or spec is None:  # None: this key's outputs cannot be rebuilt
            self.misses += 1
            return _MISS
        self.hits += 1
        return _build(spec)

    def store(self, key: tuple, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = set()
        for x in (*args, *kwargs.values()):
            for t in (x if isinstance(x, (list, tuple)) else (x,)):
                if isinstance(t, torch.Tensor):
                    inputs.add(id(t.untyped_storage()))
        try:
            self._specs[key] = _spec_of(out, set(inputs))
        except TypeError:
            self._specs[key] = None  # outputs alias each other or an input, or are not meta

    MISS = _MISS
