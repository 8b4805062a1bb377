"""What the plugins that run on a device mesh share: the mesh, tensor parallelism before wrapping,
and the user's optimizer re-pointed at the parameters elixir manages.

A plugin is given an optimizer built on the unwrapped model's parameters. Tensor parallelism
replaces each parallelised parameter by a DTensor (:func:`~elixir.parallel.tensor_parallel`),
``ElixirModule`` replaces a DTensor by a plain parameter over its local shard, and a pipeline
stage holds only some of the parameters. :func:`parameter_names` records, before any of that,
every name each of the optimizer's parameters is known by (a tied weight has two);
:func:`bind_optimizer` then puts in each param group the parameters of the wrapped module that
carry those names, so the optimizer object the user built (and any LR scheduler on it) is the
one that steps.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from elixir import device as dev
from elixir import distributed as edist
from elixir.parallel import distribute_like
from elixir.parallel.tensor import is_fused_qkv, qkv_from_tp_order, qkv_into_tp_order
from elixir.plan import MeshLayout
from elixir.wrapper import ElixirModule


def device_mesh(sizes: dict[str, int]) -> Any:
    """A ``DeviceMesh`` over the world with the named dimensions (elixir's axis names, outermost
    first) and sizes; the world size must be their product. Collective."""
    # torch's DeviceMesh (imported here: a process group must exist first)
    from torch.distributed.device_mesh import init_device_mesh

    layout = MeshLayout.from_sizes(sizes)
    world = edist.get_world_size()
    if layout.world_size != world:
        raise ValueError(f"{' x '.join(f'{k} {v}' for k, v in sizes.items())} needs {layout.world_size} ranks; this run "
                         f"has {world}")
    return init_device_mesh(dev.default_device().type, tuple(sizes.values()), mesh_dim_names=tuple(sizes),
                            backend_override=edist.mesh_backend_options(len(sizes)))


def parameter_names(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """id(parameter) -> every name the model gives it (tied parameters have several)."""
    out: dict[int, tuple[str, ...]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[id(p)] = out.get(id(p), ()) + (name,)
    return out


def bind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, tuple[str, ...]], em: ElixirModule,
                   keep_others: bool = False) -> torch.optim.Optimizer:
    """Point ``optimizer``'s param groups (built on the parameters ``names`` was taken from) at
    ``em``'s parameters of the same names, in place; returns it. Parameters ``em`` does not hold
    (another pipeline stage's) are dropped; one with no recorded name raises."""
    by_name = {s.name: em.params[s.index] for s in em.slots}
    frozen = {n: p for n, p in em.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            aliases = names.get(id(p))
            if aliases is None:
                if keep_others:
                    kept.append(p)
                    continue
                raise ValueError("the optimizer holds a parameter the model does not: build the optimizer on the "
                                 "model's parameters before boosting")
            here = [by_name[a] for a in aliases if a in by_name] or [frozen[a] for a in aliases if a in frozen]
            kept.extend(here[:1])
        group["params"] = kept
    optimizer.state.clear()
    return optimizer


def copy_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new optimizer of the same class, defaults and param groups (same parameters)."""
    groups = [dict(g) for g in optimizer.param_groups]
    return type(optimizer)(groups, **optimizer.defaults)


def tp_dims(tp_size: int, world: Optional[int] = None) -> dict[str, int]:
    """The mesh of a data- and tensor-parallel run: ``{"dp_shard": world // tp_size, "tp": tp_size}``."""
    world = edist.get_world_size() if world is None else world
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide the world size ({world})")
    return {"dp_shard": world // tp_size, "tp": tp_size}


def whole_state(em: ElixirModule, tp: int) -> dict[str, torch.Tensor]:
    """``em``'s state dict with tensor-parallel shards made whole (collective over dp and tp)."""
    out = {}
    for k, v in em.state_dict().items():
        if em.tensor_parallel is not None:
            v = em.tensor_parallel.full_tensor(k, v)
            if tp > 1 and is_fused_qkv(k):
                v = qkv_from_tp_order(v, tp)
        out[k] = v.detach().cpu()
    return out


def local_slice(em: ElixirModule, name: str, full: torch.Tensor, tp: int) -> torch.Tensor:
    """This tp rank's slice of the whole tensor ``full`` of parameter ``name``."""
    t = em.tensor_parallel.by_name.get(name) if em.tensor_parallel is not None else None
    if t is None:
        return full
    if tp > 1 and is_fused_qkv(name):
        full = qkv_into_tp_order(full, tp)
    return distribute_like(full.to(t.param.device, t.param.dtype), t.mesh, t.placements)
