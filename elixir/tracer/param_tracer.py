"""The order in which a training step uses its parameters, traced on meta tensors.

A *step* is one firing of the hooks defined in :mod:`elixir.tracer.hooks` (a param-owning
module's forward call, its recomputation under gradient checkpointing, or the start of its
backward); the runtime installs the same hooks, so step ``i`` here is step ``i`` there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .run import StepFn, StepTrace, TracedStep, trace_step

__all__ = ["ParamOrder", "generate_tf_order", "order_from_trace"]


@dataclass(frozen=True)
class ParamOrder:
    """The traced order.

    Attributes:
        steps: every hook step (kind, module, params, op index into the memory timeline).
        checkpoint_info: the outermost checkpointed forward regions as half-open ``(start, end)``
            step-index pairs: steps ``start .. end-1`` ran inside the region.
        recompute_info: the same, for each contiguous run of recompute steps.
        external_params: canonical names of parameters some op used in forward or recomputation
            while none of their owning modules was inside ``forward`` (functional use from
            another module). The step granularity does not cover them: a runtime must keep them
            available for the whole step.
    """

    steps: tuple
    checkpoint_info: tuple
    recompute_info: tuple
    external_params: tuple = ()

    @property
    def params_per_step(self) -> list:
        """For each step, the canonical names of the parameters it touches (module registration order)."""
        return [s.params for s in self.steps]

    def to_dict(self) -> dict:
        return {
            "params_per_step": [list(p) for p in self.params_per_step],
            "checkpoint_info": [list(r) for r in self.checkpoint_info],
            "recompute_info": [list(r) for r in self.recompute_info],
            "external_params": list(self.external_params),
            "steps": [{"kind": s.kind.value, "module": s.module, "op_index": s.op_index} for s in self.steps],
        }


def _step_runs(steps: list, kind: str) -> tuple:
    out, start = [], None
    for i, s in enumerate(steps):
        if s.kind.value == kind and start is None:
            start = i
        elif s.kind.value != kind and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(steps)))
    return tuple(out)


def order_from_trace(tr: StepTrace) -> ParamOrder:
    steps: list[TracedStep] = list(tr.steps)
    return ParamOrder(
        steps=tuple(steps),
        checkpoint_info=tuple(tr.checkpoint_steps),
        recompute_info=_step_runs(steps, "recompute"),
        external_params=tuple(tr.external_params),
    )


def generate_tf_order(model: nn.Module, inp: dict, step_fn: StepFn, dtype: torch.dtype = torch.float) -> dict:
    """Trace ``step_fn(model, inp)`` on meta and return the parameter order.

    Returns ``{"params_per_step": [tuple of names per step], "checkpoint_info": [(start, end), ...],
    "recompute_info": [...], "external_params": [...], "order": ParamOrder}``. Neither ``model`` nor ``inp`` is modified.
    """
    order = order_from_trace(trace_step(model, inp, step_fn, dtype, "meta"))
    return {
        "params_per_step": order.params_per_step,
        "checkpoint_info": list(order.checkpoint_info),
        "recompute_info": list(order.recompute_info),
        "external_params": list(order.external_params),
        "order": order,
    }
