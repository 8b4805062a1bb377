"""Real values, beside the meta trace, for the small tensors a step computes from its batch alone.

A meta trace has shapes but no values, yet library code branches on values computed from the
batch: transformers' masking utilities ask whether the attention mask pads anything
(``padding_mask.all()``), DeBERTa whether the last token is padding
(``pad_token_id in input_ids[:, [-1, 0]]``), and so on. Such a check is not a property of the
model; it reads the batch, which the tracer has.

:class:`KnownValues` is a dispatch mode that keeps, for each meta tensor whose value follows from
the batch alone, a real CPU *twin*. A tensor is known when it is

- one of the batch's tensors (up to :data:`MAX_NUMEL` elements; the tracer gives the batch's
  copies their real values as twins),
- made by a deterministic factory (``arange``, ``full``, ``zeros``, ``*_like``, ...), or
- the output of an op whose tensor inputs are all known (the op is run again on the twins).

When an op needs data (``.item()``, ``bool(t)``, ``nonzero``, ``torch.where(mask)``) and its
inputs are known, the twin answers: the trace follows the control flow a real run of this batch
takes. Values that depend on parameters or activations stay unknown, and an op needing one is a
``TracerError`` (raised by the accountant, naming the frame). A known tensor written in place by
an op with unknown inputs becomes unknown (with every view of its storage). Outputs larger than
:data:`MAX_NUMEL` elements get no twin. Random ops never get one (their real run would consume the
caller's random stream).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["KnownValues", "MAX_NUMEL"]

MAX_NUMEL = 1 << 22  # elements: a twin is a real CPU tensor; masks and ids are far below this

_aten = torch.ops.aten
# ops whose output does not depend on the values of their first tensor argument (its shape and
# dtype only); the in-place ones among them overwrite it whole
_VALUE_FREE = {
    _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default,
    _aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default,
    _aten.fill_.Scalar, _aten.zero_.default, _aten.copy_.default,
}
# deterministic factories: no tensor inputs, and a value fixed by their arguments
_FACTORIES = {getattr(pk, ov) for pk in (_aten.arange, _aten.full, _aten.zeros, _aten.ones, _aten.scalar_tensor,
                                         _aten.eye, _aten.linspace, _aten.tril_indices, _aten.triu_indices)
              for ov in pk.overloads()}


def _written(func: Any) -> tuple[int, ...]:
    """Positions (in the schema) of the arguments ``func`` writes (in-place ``self``, ``out=``)."""
    return tuple(i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _numel(out: Any) -> int:
    leaves, _ = tree_flatten(out)
    return sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))


class KnownValues(TorchDispatchMode):
    """Keeps real twins of batch-derived meta tensors and answers data-dependent ops from them.

    Enter it *inside* (after) the :class:`~elixir.tracer.accounting.StorageAccountant`, and set
    the accountant's ``fallback`` to :meth:`answer`: an op that fails on meta is then answered from
    the twins, and the accountant still records it.
    """

    def __init__(self, max_numel: int = MAX_NUMEL) -> None:
        super().__init__()
        self.max_numel = max_numel
        self._twin: WeakIdKeyDictionary = WeakIdKeyDictionary()  # meta tensor -> (real twin, generation)
        self._poisoned: dict[int, tuple[int, Any]] = {}  # meta storage id -> (generation, weakref)
        self._gen = 0
        self._pending: Optional[tuple] = None  # (func, real args, real kwargs, real output or NotImplemented)
        self._placeholder: Optional[torch.Tensor] = None
        self._writes: dict[Any, tuple[int, ...]] = {}
        self.answered = 0  # data-dependent ops answered from twins (for tests and reports)

    # -- twins ----------------------------------------------------------------------------------

    def add(self, meta: torch.Tensor, real: torch.Tensor) -> None:
        """Give ``meta`` the value ``real`` (a CPU tensor of the same shape and dtype, owned by us)."""
        if meta.numel() <= self.max_numel and real.shape == meta.shape and real.dtype == meta.dtype:
            self._gen += 1
            self._twin[meta] = (real, self._gen)

    def value(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """``t``'s real twin, or None when its value is unknown."""
        entry = self._twin.get(t)
        if entry is None:
            return None
        poisoned = self._poisoned.get(id(t.untyped_storage()))
        if poisoned is not None and poisoned[0] >= entry[1]:
            return None
        return entry[0]

    def _poison(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        self._gen += 1
        ref = self._poisoned[key][1] if key in self._poisoned else weakref.ref(st, lambda _r, k=key: self._poisoned.pop(k, None))
        self._poisoned[key] = (self._gen, ref)

    # -- real arguments -------------------------------------------------------------------------

    def _real(self, func: Any, x: Any, first: bool) -> Any:
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        if not isinstance(x, torch.Tensor):
            return x
        if x.device.type != "meta":
            return x  # a real CPU scalar the step passed in
        twin = self.value(x)
        if twin is not None:
            return twin
        if first and func in _VALUE_FREE and x.numel() <= self.max_numel:
            self._placeholder = x  # only its shape is read (or it is overwritten whole)
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        raise LookupError

    def _real_args(self, func: Any, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """The op's arguments with each meta tensor replaced by its twin; None if one is unknown."""
        if torch.Tag.nondeterministic_seeded in func.tags:
            return None
        has_tensor = False
        self._placeholder = None
        try:
            rargs = []
            for i, a in enumerate(args):
                has_tensor = has_tensor or isinstance(a, (torch.Tensor, list, tuple))
                rargs.append(tree_map(lambda x, i=i: self._real(func, x, i == 0), a)
                             if isinstance(a, (list, tuple)) else self._real(func, a, i == 0))
            rkwargs = {k: tree_map(lambda x: self._real(func, x, False), v) for k, v in kwargs.items()}
        except LookupError:
            return None
        if not has_tensor and func not in _FACTORIES:
            return None  # empty, randn, ...: no value to know
        return tuple(rargs), rkwargs

    def _run_real(self, func: Any, rargs: tuple, rkwargs: dict) -> Any:
        """The op on the twins, or ``NotImplemented`` where the CPU kernel refuses them (then the
        outputs stay unknown: the meta trace goes on without their values)."""
        with _disable_current_modes():  # the real run is not part of the traced step
            try:
                return func(*rargs, **rkwargs)
            except Exception:  # noqa: BLE001 - any kernel refusal means "value unknown", never a failed trace
                return NotImplemented

    # -- dispatch -------------------------------------------------------------------------------

    def answer(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The accountant's fallback for an op that fails on meta: its output, computed from the
        twins (meta tensors shaped like the real result; a Python number for ``.item()``), or
        ``NotImplemented`` when the op's inputs are not all known."""
        p = self._pending
        if p is None or p[0] is not func:
            return NotImplemented
        real = self._run_real(func, p[1], p[2])
        if real is NotImplemented:
            return NotImplemented
        self._pending = (func, p[1], p[2], real)
        self.answered += 1
        with _disable_current_modes():
            return tree_map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta")
                            if isinstance(r, torch.Tensor) else r, real)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reals = self._real_args(func, args, kwargs)
        self._pending = (func, *reals, NotImplemented) if reals is not None else None
        placeholder = self._placeholder
        try:
            out = func(*args, **kwargs)  # through the accountant (which may call :meth:`answer`)
            pending = self._pending
        finally:
            self._pending = None
        writes = self._writes.get(func)
        if writes is None:
            writes = self._writes[func] = _written(func)
        known = reals is not None and _numel(out) <= self.max_numel
        if writes and (not known or placeholder is not None):
            # written with values we do not know, or overwritten whole where we knew nothing: other
            # views of the storage no longer match their twins
            self._poison_written(func, args, kwargs, writes)
        if known:
            real = pending[3] if pending is not None and pending[3] is not NotImplemented else self._run_real(func, *reals)
            if real is not NotImplemented:
                self._attach(out, real)
            elif writes:
                self._poison_written(func, args, kwargs, writes)
        return out

    def _poison_written(self, func: Any, args: tuple, kwargs: dict, writes: tuple[int, ...]) -> None:
        for i in writes:
            t = args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name)
            for x in (t if isinstance(t, (list, tuple)) else (t,)):
                if isinstance(x, torch.Tensor) and x.device.type == "meta":
                    self._poison(x)

    def _attach(self, out: Any, real: Any) -> None:
        outs, _ = tree_flatten(out)
        reals, _ = tree_flatten(real)
        if len(outs) != len(reals):
            return
        for o, r in zip(outs, reals):
            if isinstance(o, torch.Tensor) and o.device.type == "meta" and isinstance(r, torch.Tensor):
                if self.value(o) is not r:
                    self.add(o, r)
