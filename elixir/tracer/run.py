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
    seen: set = set()
    params = list(work.parameters())
    tr.param_occ = _unique_storage_bytes(params, seen)
    tr.buffer_occ = _unique_storage_bytes(work.buffers(), seen)
    tr.input_occ = _unique_storage_bytes(batch.values(), seen)
    for t in (*params, *work.buffers(), *batch.values()):
        acc.add_static(t)
    tr.trainable_param_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)

    owned = {mname: names for mname, _, names in param_owning_modules(work)}

    def on_step(kind: StepKind, mname: str, _m: nn.Module) -> None:
        tr.steps.append(TracedStep(kind, mname, owned[mname], acc.op_count))

    # parameters used by an op in forward/recompute while no owner of theirs is inside forward
    param_of_storage = {id(p.untyped_storage()): n for n, p in work.named_parameters()}
    active: Counter = Counter()

    def on_forward(kind: StepKind, mname: str, m: nn.Module) -> None:
        on_step(kind, mname, m)
        active.update(owned[mname])

    def on_forward_end(_kind: StepKind, mname: str, _m: nn.Module) -> None:
        active.subtract(owned[mname])

    def observe(args: tuple, kwargs: dict) -> None:
        if current_phase() is StepKind.BACKWARD:
            return
        for t in (*tensors_in(args), *tensors_in(kwargs)):
            name = param_of_storage.get(id(t.untyped_storage()))
            if name is not None and active[name] <= 0 and name not in tr.external_params:
                tr.external_params[name] = acc.op_count

    def on_grad(p: torch.Tensor) -> None:
        tr.grad_events += 1
        if p.grad is not None:
            acc.mark_grad(p.grad)

    open_region: list = []

    def enter() -> None:
        if current_phase() == StepKind.FORWARD:
            open_region.append((acc.op_count, len(tr.steps)))

    def leave() -> None:
        if open_region and current_phase() == StepKind.FORWARD:
            op0, st0 = open_region.pop()
            tr.checkpoint_ops.append((op0, acc.op_count))
            tr.checkpoint_steps.append((st0, len(tr.steps)))

    acc.observer = observe
    if known is not None:
        acc.fallback = lambda f, a, k: _first_answer(f, a, k, known)
    hooks = install_step_hooks(work, on_forward=on_forward, on_backward=on_step, on_forward_end=on_forward_end)
    grad_handles = [p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad]
    route = sdpa_as_cpu() if target == "meta" else contextlib.nullcontext()
    shims = hf_meta_shims(known.value) if known is not None else contextlib.nullcontext()
    try:
        with watch_checkpoints(enter, leave), shims, route, acc, known or contextlib.nullcontext():
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
