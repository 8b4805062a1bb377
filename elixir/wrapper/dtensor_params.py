"""Tensor-parallel (DTensor) parameters in chunks: each rank packs its LOCAL shards.

A model parallelised with torch's ``parallelize_module`` (see :mod:`elixir.parallel`) holds
``DTensor`` parameters on the mesh's ``tp`` dimension. Chunks hold plain tensors, so, as FSDP2 does
when it composes with tensor parallelism, :func:`localize` replaces every DTensor parameter by a
plain parameter over its local shard (the same object in every module that held it, so tied
weights stay tied) and records its placements. For compute, a forward pre-hook on each module that
owns one exposes ``DTensor.from_local(local, tp_mesh, placements)`` under the parameter's name (in
the module's instance ``__dict__``, which attribute lookup reads before ``_parameters``), and the
forward hook takes it away again. ``from_local`` is differentiable: the gradient arrives on the
local parameter, already reduced over ``tp`` where the placement is ``Replicate``
(DTensor's backward redistributes it to the forward placements), so elixir reduces it over the
data-parallel axis only, as any other gradient.

The gradient norm (:mod:`elixir.wrapper.clipping`) needs to know which elements are a slice of a
``Shard``-placed parameter (summed over ``tp``) and which are replicated on every ``tp`` rank
(counted once): :meth:`TensorParallelParams.sharded_ranges`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from elixir import distributed as edist


class TensorParallelError(ValueError):
    """A model's DTensor parameters do not fit the run's mesh."""


@dataclass(frozen=True)
class TPParam:
    """One localised DTensor parameter: its local plain parameter and how to rebuild the DTensor."""

    name: str  # first named_parameters name
    param: nn.Parameter  # the local shard, as a plain parameter (chunks hold it)
    mesh: Any  # the 1-D tp DeviceMesh
    placements: tuple
    shape: torch.Size  # global
    stride: tuple  # global

    @property
    def sharded(self) -> bool:
        """A slice of the parameter differs on each tp rank (its norm sums over tp)."""
        return any(isinstance(p, Shard) for p in self.placements)

    def as_dtensor(self, local: Optional[torch.Tensor] = None) -> DTensor:
        """``local`` (default: the parameter) as the DTensor it stands for (differentiable)."""
        return DTensor.from_local(self.param if local is None else local, self.mesh, self.placements,
                                  run_check=False, shape=self.shape, stride=self.stride)


class TensorParallelParams:
    """The DTensor parameters of a module, localised (see the module docstring)."""

    def __init__(self, params: dict[int, TPParam], owners: dict[nn.Module, list[tuple[str, TPParam]]],
                 aliases: dict[str, TPParam]) -> None:
        self.by_id = params  # id(local parameter) -> TPParam
        self.by_name = {t.name: t for t in params.values()}
        self.by_name.update(aliases)  # every name of a tied parameter (state dicts list them all)
        self.owners = owners
        self.mesh = next(iter(params.values())).mesh
        self.handles: list = []
        for m, entries in owners.items():
            self.handles.append(m.register_forward_pre_hook(_expose(entries), prepend=True))
            self.handles.append(m.register_forward_hook(_hide(entries), always_call=True))

    @property
    def tp_group(self):
        return self.mesh.get_group()

    def sharded_ranges(self, slots: list, lo: int, hi: int) -> list[tuple[int, int]]:
        """Of a chunk's elements ``[lo, hi)`` (this rank's shard), the ranges (relative to ``lo``)
        that belong to ``Shard``-placed tensor-parallel parameters; ``slots`` are the chunk's
        :class:`~elixir.wrapper.param_map.ParamSlot` s."""
        out = []
        for s in slots:
            t = self.by_name.get(s.name)
            if t is None or not t.sharded:
                continue
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append((a - lo, b - lo))
        return out

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole parameter ``name`` from this rank's ``local`` values (all-gathers over tp;
        collective on the tp group); other names are returned as they are."""
        t = self.by_name.get(name)
        if t is None:
            return local
        return t.as_dtensor(local.to(t.param.device)).full_tensor()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _expose(entries: list[tuple[str, TPParam]]):
    def hook(module: nn.Module, args) -> None:
        # This hook runs before the step hook that gathers the module's chunks, so a sharded chunk
        # may still be released here. from_local only views the local parameter (a view of the
        # chunk's payload, whose storage the gather refills in place), so the view is made without
        # the released parameter's guard: through the guard it would read as an access and gather
        # the chunk pinned to the end of backward (every chunk held at once, the plan's rCache exceeded).
        with torch._C.DisableTorchFunctionSubclass():
            for attr, t in entries:
                module.__dict__[attr] = t.as_dtensor()
    return hook


def _hide(entries: list[tuple[str, TPParam]]):
    def hook(module: nn.Module, args, output) -> None:
        for attr, _ in entries:
            module.__dict__.pop(attr, None)
    return hook


def localize(module: nn.Module, tp_mesh: Any, tp_size: int) -> Optional[TensorParallelParams]:
    """Replace ``module``'s DTensor parameters by plain parameters over their local shards (see the
    module docstring); None when it has none. Raises :class:`TensorParallelError` when a DTensor
    parameter is not on ``tp_mesh`` (a 1-D mesh: the run's ``tp`` dimension), or when the run has a
    tensor axis (``tp_size`` > 1) but the model has no DTensor parameter."""
    first_name = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
    every_name = list(module.named_parameters(remove_duplicate=False))
    found: dict[int, TPParam] = {}
    owners: dict[nn.Module, list[tuple[str, TPParam]]] = {}
    for m in module.modules():
        for attr, p in list(m._parameters.items()):
            if not isinstance(p, DTensor):
                continue
            if tp_mesh is None or p.device_mesh != tp_mesh:
                raise TensorParallelError(
                    f"parameter {first_name.get(id(p), attr)!r} is a DTensor on {p.device_mesh}, but this run's tensor "
                    f"axis is {tp_mesh}: parallelise the model over mesh['tp'] of the DeviceMesh given to ElixirModule "
                    "(elixir.parallel.tensor_parallel(model, mesh))"
                )
            t = found.get(id(p))
            if t is None:
                local = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                t = TPParam(first_name[id(p)], local, p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))
                found[id(p)] = t
            m._parameters[attr] = t.param
            owners.setdefault(m, []).append((attr, t))
    if not found:
        if tp_size > 1:
            raise TensorParallelError(
                f"the mesh has a tensor axis of {tp_size} ranks, but the model has no DTensor parameter: parallelise it "
                "first (elixir.parallel.tensor_parallel(model, mesh)), or pass a mesh without a tp dimension"
            )
        return None
    aliases = {n: found[id(p)] for n, p in every_name if id(p) in found}
    edist.name_backward_failures("tensor-parallel backward")  # DTensor's backward collectives, bare loss.backward()
    return TensorParallelParams({id(t.param): t for t in found.values()}, owners, aliases)

