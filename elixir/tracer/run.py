"""Run one training step under the accountant and the step hooks; the raw trace behind both APIs."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from .accounting import StorageAccountant, TracerError
from .checkpoint import watch_checkpoints
from .convert import Target, check_dtype, check_inputs, copy_inputs, copy_model, model_device
from .hooks import StepKind, current_phase, install_step_hooks, param_owning_modules, tensors_in
from .known_values import KnownValues
from .meta_kernels import ensure_meta_kernels, hf_meta_shims, hf_static_experts, meta_rule, sdpa_as_cpu
from .opcache import MetaOpCache

__all__ = ["TracedStep", "StepTrace", "trace_step"]

StepFn = Callable[[nn.Module, dict], Any]


@dataclass(frozen=True)
class TracedStep:
    """One hook firing: its kind, the module, the canonical names of the params it touches, and the
    number of ops traced before it (an index into the op timeline)."""

    kind: StepKind
    module: str
    params: tuple[str, ...]
    op_index: int


@dataclass
class StepTrace:
    """Everything recorded while one step ran (mutable while tracing; read-only afterwards)."""

    target: str
    dtype: torch.dtype
    acc: StorageAccountant
    param_occ: int = 0
    buffer_occ: int = 0
    input_occ: int = 0
    trainable_param_bytes: int = 0
    grad_events: int = 0
    steps: list[TracedStep] = field(default_factory=list)
    # outermost checkpointed forward regions: (start, end) half-open, in ops and in steps
    checkpoint_ops: list[tuple[int, int]] = field(default_factory=list)
    checkpoint_steps: list[tuple[int, int]] = field(default_factory=list)
    # canonical names of params an op used outside their owners' forward -> first such op index
    external_params: dict[str, int] = field(default_factory=dict)


def _unique_storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        if id(st) not in seen:
            seen.add(id(st))
            total += st.nbytes()
    return total


def _known_batch(inp: dict, batch: dict) -> KnownValues:
    """A :class:`KnownValues` in which the batch's meta copies have their real values as twins."""
    known = KnownValues()
    for k, v in inp.items():
        t = batch[k]
        if t.device.type == "meta" and v.device.type != "meta" and t.numel() <= known.max_numel:
            known.add(t, v.detach().to(device="cpu", dtype=t.dtype, copy=True))
    return known


def _first_answer(func: Any, args: tuple, kwargs: dict, known: KnownValues) -> Any:
    """An op failed on meta: elixir's shape rule for it, else its value from the batch's twins."""
    out = meta_rule(func, args, kwargs)
    return known.answer(func, args, kwargs) if out is NotImplemented else out


def _record_static(tr: StepTrace, work: nn.Module, params: list[nn.Parameter], batch: dict) -> None:
    """Book the parameters, buffers and inputs, resident before the step starts, in ``tr``."""
    seen: set = set()
    tr.param_occ = _unique_storage_bytes(params, seen)
    tr.buffer_occ = _unique_storage_bytes(work.buffers(), seen)
    tr.input_occ = _unique_storage_bytes(batch.values(), seen)
    for t in (*params, *work.buffers(), *batch.values()):
        tr.acc.add_static(t)
    tr.trainable_param_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)


class _StepRecorder:
    """The step hooks' callbacks, appending to ``tr`` as the step of ``work`` runs: module steps,
    gradients, checkpointed regions, and parameters used outside their owners' forward."""

    def __init__(self, tr: StepTrace, work: nn.Module) -> None:
        self.tr, self.acc = tr, tr.acc
        self.owned = {mname: names for mname, _, names in param_owning_modules(work)}
        # parameters used by an op in forward/recompute while no owner of theirs is inside forward
        self.param_of_storage = {id(p.untyped_storage()): n for n, p in work.named_parameters()}
        self.active: Counter = Counter()
        self.open_region: list = []

    def on_step(self, kind: StepKind, mname: str, _m: nn.Module) -> None:
        self.tr.steps.append(TracedStep(kind, mname, self.owned[mname], self.acc.op_count))

    def on_forward(self, kind: StepKind, mname: str, m: nn.Module) -> None:
        self.on_step(kind, mname, m)
        self.active.update(self.owned[mname])

    def on_forward_end(self, _kind: StepKind, mname: str, _m: nn.Module) -> None:
        self.active.subtract(self.owned[mname])

    def observe(self, args: tuple, kwargs: dict) -> None:
        if current_phase() is StepKind.BACKWARD:
            return
        for t in (*tensors_in(args), *tensors_in(kwargs)):
            name = self.param_of_storage.get(id(t.untyped_storage()))
            if name is not None and self.active[name] <= 0 and name not in self.tr.external_params:
                self.tr.external_params[name] = self.acc.op_count

    def on_grad(self, p: torch.Tensor) -> None:
        self.tr.grad_events += 1
        if p.grad is not None:
            self.acc.mark_grad(p.grad)

    def enter(self) -> None:
        """A checkpointed region starts; recorded in the forward phase only."""
        if current_phase() == StepKind.FORWARD:
            self.open_region.append((self.acc.op_count, len(self.tr.steps)))

    def leave(self) -> None:
        if self.open_region and current_phase() == StepKind.FORWARD:
            op0, st0 = self.open_region.pop()
            self.tr.checkpoint_ops.append((op0, self.acc.op_count))
            self.tr.checkpoint_steps.append((st0, len(self.tr.steps)))


def trace_step(model: nn.Module, inp: dict, step_fn: StepFn, dtype: torch.dtype = torch.float,
               target: Target = "meta", op_cache: bool = True) -> StepTrace:
    """Run ``step_fn`` once on a copy of ``model`` and ``inp`` (meta twins, or real CPU copies for
    ``target="real"``) and record memory and parameter order. The caller's objects are untouched.
    ``op_cache`` memoises meta kernels (:mod:`elixir.tracer.opcache`); it changes speed only.

    On meta, values computed from the batch alone keep their real values beside the trace
    (:mod:`elixir.tracer.known_values`), so library checks on the batch (attention masks, padding)
    take the branch a real run takes; transformers' eager experts are traced through its
    ``grouped_mm`` path (:func:`~elixir.tracer.meta_kernels.hf_static_experts`)."""
    check_dtype(dtype)
    check_inputs(inp)
    if not callable(step_fn):
        raise TracerError(f"step_fn must be callable as step_fn(model, inp), got {type(step_fn).__name__}")
    dev = model_device(model)
    if target == "real" and dev.type == "meta":
        raise TracerError("a model on meta has no weights to run for real; use target='meta'")
    ensure_meta_kernels()
    work = copy_model(model, dtype, target)
    batch = copy_inputs(inp, dtype, target)
    work.train(model.training)
    known = _known_batch(inp, batch) if target == "meta" else None
    if target == "meta":
        hf_static_experts(work)

    acc = StorageAccountant(MetaOpCache() if target == "meta" and op_cache else None)
    tr = StepTrace(target=target, dtype=dtype, acc=acc)
    params = list(work.parameters())
    _record_static(tr, work, params, batch)
    rec = _StepRecorder(tr, work)
    acc.observer = rec.observe
    if known is not None:
        acc.fallback = lambda f, a, k: _first_answer(f, a, k, known)
    hooks = install_step_hooks(work, on_forward=rec.on_forward, on_backward=rec.on_step, on_forward_end=rec.on_forward_end)
    grad_handles = [p.register_post_accumulate_grad_hook(rec.on_grad) for p in params if p.requires_grad]
    route = sdpa_as_cpu() if target == "meta" else contextlib.nullcontext()
    shims = hf_meta_shims(known.value) if known is not None else contextlib.nullcontext()
    try:
        with watch_checkpoints(rec.enter, rec.leave), shims, route, acc, known or contextlib.nullcontext():
            ret = step_fn(work, batch)
            del ret  # the loss and anything else the step returns die with the step
    finally:
        hooks.remove()
        for h in grad_handles:
            h.remove()
    if tr.grad_events == 0 and StepKind.BACKWARD.value not in acc.t_phase:
        raise TracerError(
            "step_fn never called backward: it must run one training step's forward and backward "
            "(e.g. `loss = model(**inp).loss; loss.backward()`), and the model needs trainable parameters"
        )
    return tr
