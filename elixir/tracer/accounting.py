"""Alias-aware live-bytes accounting of every aten op, on meta or real tensors.

:class:`StorageAccountant` is a ``TorchDispatchMode``. Memory is counted per *untyped storage*
(the unit an allocator hands out), never per tensor, so views and in-place ops add nothing. Each
storage an op returns is registered once, with a weak reference whose callback subtracts its
bytes when the last tensor holding it dies. Storages that exist before the step (parameters,
buffers, inputs) are registered as *static* and never counted as step memory. Storages that become
a parameter's ``.grad`` are moved from the activation bucket to the gradient bucket at the moment
AccumulateGrad produces them (``register_post_accumulate_grad_hook``).

After each op the accountant appends one timeline sample ``(phase, op name, activation bytes,
gradient bytes)``, and one more (op name ``autograd::AccumulateGrad``) each time a ``.grad`` is
produced. Frees only lower the live total, so the maximum over these post-op samples is the exact
peak. Allocations an op makes internally and frees before returning (kernel workspaces) are not
visible to a dispatch mode and are not counted, on meta or real tensors alike.
"""

from __future__ import annotations

import enum
import os
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .hooks import StepKind, current_phase, tensors_in
from .op_costs import OpCostCounter
from .opcache import MetaOpCache

__all__ = ["Bucket", "StorageAccountant", "Temporary", "TracerError"]


class TracerError(RuntimeError):
    """A step the tracer cannot profile faithfully; the message names the cause and the fix."""


ACCUMULATE_GRAD = "autograd::AccumulateGrad"  # pseudo-op: a timeline sample after a .grad is produced


class Bucket(enum.IntEnum):
    STATIC = 0  # parameters, buffers, inputs: owned by the caller, never step memory
    ACTIVATION = 1  # anything an op allocates during the step (saved tensors, temporaries, ...)
    GRAD = 2  # a parameter's .grad


@dataclass(frozen=True)
class Temporary:
    """A storage allocated and freed within one phase."""

    nbytes: int
    op_index: int
    op_name: str
    phase: str


class _Entry:
    __slots__ = ("nbytes", "bucket", "ref", "op_index", "phase")

    def __init__(self, nbytes: int, bucket: Bucket, ref: Any, op_index: int, phase: StepKind):
        self.nbytes = nbytes
        self.bucket = bucket
        self.ref = ref
        self.op_index = op_index
        self.phase = phase


def _no_meta_kernel_message(func: Any, err: BaseException) -> str:
    return (
        f"op {func} has no meta kernel, so its memory cannot be traced without weights "
        f"({type(err).__name__}: {str(err).splitlines()[0]}). Register one with "
        f"elixir.tracer.meta_kernels.register_meta_kernel({str(func.overloadpacket)!r}, fn) "
        f"(or torch.library.register_fake), or replace the op in the model."
    )


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TRACER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def code_frame() -> str:
    """Where the step's own code (or a library it calls) is, outside torch and the tracer: the
    innermost such frame as ``file:line in function: `source```, and whose code it is."""
    for fs in reversed(traceback.extract_stack()):
        f = os.path.abspath(fs.filename)
        if f.startswith(_TORCH_DIR) or f.startswith(_TRACER_DIR) or fs.filename.startswith("<frozen"):
            continue
        lib = "site-packages" in f or "dist-packages" in f
        where = f.split("site-packages" + os.sep, 1)[-1] if lib else fs.filename
        line = f": `{fs.line.strip()}`" if fs.line else ""
        return f"{where}:{fs.lineno} in {fs.name}{line} ({'library code' if lib else 'your code'})"
    return "an unknown frame"


def _data_dependent_message(func: Any) -> str:
    return (
        f"op {func} needs tensor data (.item(), bool(tensor), int(tensor), nonzero, torch.where(mask)) at "
        f"{code_frame()}: the value it reads depends on the model's "
        f"parameters or activations, which a meta trace does not have (values computed from the batch "
        f"alone are known: the batch's tensors keep their real values while tracing). Fixes: in your own "
        f"code, keep such values as plain Python numbers or compute them from the batch, or move the call out "
        f"of step_fn; in library code, use a shape-static path if the library has one (transformers MoE: "
        f"model.set_experts_implementation('grouped_mm')), or profile on real tensors: "
        f"profile = elixir.search.step_profile.profile_step(model, inp, step_fn, dtype, target='real') "
        f"(needs the model's weights on CPU), then elixir.search.optimal.search_profile(profile, world_size, ...)."
    )


def _is_data_dependent(func: Any, err: BaseException) -> bool:
    tags = getattr(func, "tags", ())
    return (torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags
            or "cannot be called on meta tensors" in str(err))


class StorageAccountant(TorchDispatchMode):
    """Counts live bytes per bucket, op by op (see the module docstring)."""

    def __init__(self, cache: Optional[MetaOpCache] = None) -> None:
        super().__init__()
        self.cache = cache
        self.observer: Optional[Callable[[tuple, dict], None]] = None  # sees every op's arguments
        # answers an op that failed (on meta) with its outputs, or ``NotImplemented``
        self.fallback: Optional[Callable[[Any, tuple, dict], Any]] = None
        self._entries: dict[int, _Entry] = {}
        self.live = [0, 0, 0]  # indexed by Bucket
        self.op_count = 0
        # timeline (parallel lists keep 10^5 samples cheap)
        self.t_phase: list[str] = []
        self.t_name: list[Any] = []  # OpOverload objects; str() them when reporting
        self.t_act: list[int] = []
        self.t_grad: list[int] = []
        self.largest_temporary: Optional[Temporary] = None
        self.costs = OpCostCounter()  # FLOPs, bytes and op counts for the compute-time model

    # -- registration -------------------------------------------------------------------------

    def _key_and_storage(self, t: torch.Tensor):
        st = t.untyped_storage()
        return id(st), st

    def add_static(self, t: torch.Tensor) -> None:
        """Register a pre-existing tensor's storage (parameter, buffer, input)."""
        key, st = self._key_and_storage(t)
        if key not in self._entries:
            # keep a strong ref: static storages must not be recycled (and their ids reused)
            self._entries[key] = _Entry(st.nbytes(), Bucket.STATIC, st, -1, StepKind.FORWARD)

    def _free(self, key: int) -> None:
        e = self._entries.pop(key, None)
        if e is None:
            return
        self.live[e.bucket] -= e.nbytes
        if e.bucket == Bucket.ACTIVATION and e.phase == current_phase():
            lt = self.largest_temporary
            if lt is None or e.nbytes > lt.nbytes:
                name = str(self.t_name[e.op_index]) if 0 <= e.op_index < len(self.t_name) else "?"
                self.largest_temporary = Temporary(e.nbytes, e.op_index, name, e.phase.value)

    def _track(self, t: torch.Tensor, phase: StepKind) -> None:
        key, st = self._key_and_storage(t)
        e = self._entries.get(key)
        nbytes = st.nbytes()
        if e is None:
            ref = weakref.ref(st, lambda _r, k=key: self._free(k))
            self._entries[key] = _Entry(nbytes, Bucket.ACTIVATION, ref, self.op_count, phase)
            self.live[Bucket.ACTIVATION] += nbytes
        elif e.nbytes != nbytes and e.bucket != Bucket.STATIC:  # resize_ / set_
            self.live[e.bucket] += nbytes - e.nbytes
            e.nbytes = nbytes

    def mark_grad(self, grad: torch.Tensor) -> None:
        """Move ``grad``'s storage into the gradient bucket (called when AccumulateGrad ran)."""
        key, st = self._key_and_storage(grad)
        e = self._entries.get(key)
        if e is None:
            self._track(grad, current_phase())
            e = self._entries[key]
        if e.bucket == Bucket.ACTIVATION:
            self.live[Bucket.ACTIVATION] -= e.nbytes
            self.live[Bucket.GRAD] += e.nbytes
            e.bucket = Bucket.GRAD
        self._sample(current_phase(), ACCUMULATE_GRAD)

    # -- dispatch ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.observer is not None:
            self.observer(args, kwargs)
        cache, key = self.cache, None
        if cache is not None:
            key = cache.key(func, args, kwargs)
            out = cache.lookup(key) if key is not None else cache.MISS
            if out is not cache.MISS:
                return self._after(func, out, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as err:
            out = self._answer(func, args, kwargs, err)
            key = None  # an answer from data (or a rule) is not a function of the shapes alone
        if key is not None:
            cache.store(key, args, kwargs, out)
        return self._after(func, out, args, kwargs)

    def _answer(self, func: Any, args: tuple, kwargs: dict, err: BaseException) -> Any:
        """``func`` failed: the fallback's answer, or a TracerError naming the cause and the fix."""
        out = self.fallback(func, args, kwargs) if self.fallback is not None else NotImplemented
        if out is not NotImplemented:
            return out
        if _is_data_dependent(func, err):
            raise TracerError(_data_dependent_message(func)) from err
        if isinstance(err, NotImplementedError) and "Meta" in str(err):
            raise TracerError(_no_meta_kernel_message(func, err)) from err
        raise err

    def _after(self, func: Any, out: Any, args: tuple, kwargs: dict) -> Any:
        self.costs.record(func, args, kwargs, out)
        phase = current_phase()
        before = len(self._entries)
        for t in tensors_in(out):
            if t.layout == torch.strided:
                self._track(t, phase)
        if (phase is StepKind.BACKWARD and self.t_phase and self.t_phase[-1] == "recompute"
                and len(self._entries) == before):
            # checkpointing's own no-grad bookkeeping (detach of recomputed tensors) inside a
            # recomputation allocates nothing; keep it in the recompute run
            phase = StepKind.RECOMPUTE
        self._sample(phase, func)
        return out

    def _sample(self, phase: StepKind, name: Any) -> None:
        self.t_phase.append(phase.value)
        self.t_name.append(name)
        self.t_act.append(self.live[Bucket.ACTIVATION])
        self.t_grad.append(self.live[Bucket.GRAD])
        self.op_count += 1
