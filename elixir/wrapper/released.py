"""The model's own parameters while their chunk is released: an error instead of a crash.

A wrapped parameter is a view into its chunk's payload. A sharded chunk's payload holds no bytes
between uses (its storage is resized to 0), so a torch op on such a view read freed memory: the
process died with SIGSEGV (``model.state_dict()`` or ``p.sum()`` on the model the user still holds,
``trainer.model.state_dict()`` after training). ZeRO-3 points such parameters at empty tensors and
FSDP swaps them for sharded ones; both change what the user's parameter objects are. Here a
released parameter keeps its identity, shape, dtype and device, and only its Python class changes
while its chunk is released (:class:`ReleaseGuard`, told by the chunk on every gather and release):
the class's ``__torch_function__`` lets metadata through (shape, dtype, ``.grad``, hooks, ...) and,
for anything that reads the values,

- inside the wrapper's own forward or backward (a parameter read outside the call of the module
  that owns it: DeBERTa-v2's encoder hands ``rel_embeddings.weight`` to every layer), gathers the
  chunk on the spot and keeps it gathered until the end of the step (:meth:`ElixirModule._gather_on_access`);
- anywhere else, raises :class:`ReleasedParameterError`, naming the calls that read the values.

A gathered parameter has its own class again, so the hot path runs no Python per op.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from elixir.tracer.hooks import tensors_in


class ReleasedParameterError(RuntimeError):
    """A wrapped model's parameter was read while its chunk holds no values on this rank."""


def _descriptor_methods(names: tuple[str, ...]) -> set:
    out = set()
    for name in names:
        d = getattr(torch.Tensor, name, None)
        for m in ("__get__", "__set__", "__delete__"):
            if hasattr(d, m):
                out.add(getattr(d, m))
    return out


# what reads no values: metadata, gradients, hooks (the runtime's own bookkeeping uses these)
_METADATA = _descriptor_methods((
    "shape", "dtype", "device", "layout", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "names", "output_nr",
    "_version", "_backward_hooks", "_post_accumulate_grad_hooks", "retains_grad", "itemsize", "nbytes",
    "_grad", "_base",
)) | {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.ndimension,
    torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device,
    torch.Tensor.__hash__, torch.Tensor.requires_grad_, torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.stride, torch.Tensor.is_contiguous,
    torch.Tensor.storage_offset, torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.is_floating_point, torch.is_complex, torch.numel,
    torch.Tensor.__len__, torch.Tensor.is_pinned,
    # factories that take only the shape, dtype and device of their input (optimizers build their
    # state with them: Adagrad's full_like at construction)
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
}


class _Released:
    """Mixed into the class of a parameter whose chunk is released (see the module docstring)."""

    _elixir_guard: ReleaseGuard

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA:
            for t in list(tensors_in(args)) + list(tensors_in(kwargs)):
                if isinstance(t, _Released):
                    t._elixir_guard.on_access(t, func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return (f"{type(self).__mro__[2].__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, released: its values are sharded across ranks)")


_CLASSES: dict[type, type] = {}


def released_class(cls: type) -> type:
    """The released twin of parameter class ``cls`` (a subclass of it: ``isinstance`` holds)."""
    if issubclass(cls, _Released):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Released{cls.__name__}", (_Released, cls), {})
    return _CLASSES[cls]


# owner.<handler>(guard, param, func) -> True when it gathered the chunk (else the read raises)
AccessHandler = Callable[["ReleaseGuard", nn.Parameter, Any], bool]


class ReleaseGuard:
    """The parameters viewing one chunk: their class follows the chunk (released or gathered).

    ``names`` maps each parameter to its name in the model (for the error); ``on_access`` is the
    owner's handler, held weakly through ``owner`` (a dropped wrapper leaves an error behind)."""

    def __init__(self, chunk: Any, params: list[tuple[nn.Parameter, str]], owner: Any, handler_name: str) -> None:
        self.chunk = chunk
        self.params = [(p, type(p), name) for p, name in params]
        self._owner = weakref.ref(owner)
        self._handler = handler_name
        for p, _, _ in self.params:
            p._elixir_guard = self

    def gathered(self, chunk: Any = None) -> None:
        for p, cls, _ in self.params:
            p.__class__ = cls

    def released(self, chunk: Any = None) -> None:
        for p, cls, _ in self.params:
            p.__class__ = released_class(cls)

    def name_of(self, param: nn.Parameter) -> str:
        return next((n for p, _, n in self.params if p is param), "?")

    def on_access(self, param: nn.Parameter, func: Any) -> None:
        owner = self._owner()
        handler: Optional[AccessHandler] = getattr(owner, self._handler, None) if owner is not None else None
        if handler is not None and handler(self, param, func):
            return
        what = getattr(func, "__name__", str(func))
        world = getattr(owner, "world_size", "several")
        raise ReleasedParameterError(
            f"elixir: {what} read parameter {self.name_of(param)!r} of a model wrapped in an ElixirModule, but "
            f"its chunk is released on this rank (its values are sharded across {world} ranks and gathered only "
            "while the ElixirModule runs). Read the values through the wrapper: ElixirModule.state_dict() "
            "(collective: call it on every rank; rank0_only=True to keep them on rank 0), "
            "elixir.checkpoint.save_pretrained(path, wrapper), or ElixirModule.full_grads() for gradients"
        )


class AccessGathers:
    """The owner's handler for :class:`ReleaseGuard`: a released parameter read while the
    ElixirModule runs (forward, backward, recomputation) has its chunk gathered there and then
    (collective: every rank reads it at the same point, as every rank calls the same modules) and
    pinned until the step ends (:meth:`release`: end of backward, a forward without gradients, or
    the next forward). Its gradient is then expected like those of the modules that ran."""

    def __init__(self) -> None:
        self.pinned: list = []
        self.names: set[str] = set()  # parameters read outside their owners' calls, so far

    def __call__(self, em: Any, guard: ReleaseGuard, param: nn.Parameter) -> bool:
        if not em.running:
            return False
        chunk = guard.chunk
        em.cache.acquire(chunk)
        chunk.pin()
        self.pinned.append(chunk)
        self.names.add(guard.name_of(param))
        slot = em.param_map.slot_of(param)
        if slot is not None and torch.is_grad_enabled():
            em.tracker.expect(slot.index)
        return True

    def release(self) -> None:
        for c in self.pinned:
            c.unpin()
        self.pinned.clear()


def install_release_guards(em: Any) -> None:
    """A :class:`ReleaseGuard` on every sharded chunk of ``em`` (trainable and frozen)."""
    for chunk in em.all_chunks:
        if not chunk.spec.sharded:
            continue
        pmap = em.param_map if chunk.index < len(em.chunks) else em.frozen_map
        params = [(pmap.params[i], pmap.slots[i].name) for i in pmap.by_chunk[chunk.index]]
        guard = ReleaseGuard(chunk, params, em, "_gather_on_access")
        chunk.observers.append(guard)
        if not chunk.is_gathered:
            guard.released()
