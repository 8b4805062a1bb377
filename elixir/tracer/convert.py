"""Validate the tracer's inputs and copy model and batch onto meta (or, for measurement, CPU).

The copy never touches the user's objects: ``copy.deepcopy`` runs with a memo that maps every
parameter, buffer and tensor attribute to a fresh twin (meta: no bytes at all), so the module
structure, hooks and tied parameters (one ``Parameter`` object reached twice) carry over.
Floating parameters, buffers and inputs are cast to the step's unified ``dtype``.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
import torch.nn as nn

from .accounting import TracerError

__all__ = ["Target", "check_dtype", "check_inputs", "model_device", "copy_model", "copy_inputs"]

Target = Literal["meta", "real"]


def check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TracerError(
            f"dtype must be a floating torch.dtype (torch.float32, torch.bfloat16, torch.float16), got {dtype!r}"
        )


def check_inputs(inp: object) -> None:
    if not isinstance(inp, dict):
        raise TracerError(
            f"inp must be a dict mapping names to tensors (the batch step_fn receives), got {type(inp).__name__}"
        )
    bad = {k: type(v).__name__ for k, v in inp.items() if not isinstance(v, torch.Tensor)}
    if bad:
        raise TracerError(f"inp must be a dict of tensors; these entries are not tensors: {bad}")


def model_device(model: nn.Module) -> torch.device:
    """The one device all parameters and buffers live on (meta for a model built on meta)."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) > 1:
        raise TracerError(
            f"the model's parameters and buffers live on different devices {sorted(map(str, devices))}; "
            f"move the whole model to one device (or build it under torch.device('meta')) before profiling"
        )
    return devices.pop() if devices else torch.device("meta")


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() else t.dtype


def _twin(t: torch.Tensor, dtype: torch.dtype, target: Target) -> torch.Tensor:
    if target == "meta":
        return torch.empty_strided(t.shape, t.stride(), dtype=_cast(t, dtype), device="meta")
    return t.detach().to(device="cpu", dtype=_cast(t, dtype), copy=True)


def copy_model(model: nn.Module, dtype: torch.dtype, target: Target = "meta") -> nn.Module:
    """A structural copy of ``model`` whose tensors are meta twins (``target="meta"``) or real copies."""
    memo: dict = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(_twin(p, dtype, target), requires_grad=p.requires_grad)
    for mod in model.modules():
        for b in mod._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = _twin(b, dtype, target)
        for v in vars(mod).values():  # plain tensor attributes (caches, constants)
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = _twin(v, dtype, target)
    try:
        return copy.deepcopy(model, memo)
    except Exception as err:
        raise TracerError(
            f"cannot copy the model's structure for tracing ({type(err).__name__}: {err}); the tracer never "
            f"modifies your model, so it works on a structural copy. Make the model deep-copyable (drop "
            f"locks, process groups or open files from module attributes)."
        ) from err


def copy_inputs(inp: dict, dtype: torch.dtype, target: Target = "meta") -> dict:
    """Copies of the batch: floating tensors cast to ``dtype``; on meta, 0-dim tensors stay real.

    0-dim tensors (a step counter, a flag) stay real CPU tensors so that Python control flow on
    them (``int(batch["step"])``) still works; a CPU scalar mixes with tensors on any device.
    """
    out = {}
    for k, v in inp.items():
        if target == "meta" and v.dim() > 0:
            out[k] = torch.empty_strided(v.shape, v.stride(), dtype=_cast(v, dtype), device="meta")
        else:
            out[k] = v.detach().to(device="cpu", dtype=_cast(v, dtype), copy=True)
        if v.requires_grad and out[k].is_floating_point():
            out[k].requires_grad_(True)
    return out
