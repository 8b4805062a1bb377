"""Full (unsharded) optimizer state for ElixirOptimizer, in torch's own format, and ``init_step``.

The inner optimizer keeps one state entry per *fragment* (this rank's slice of a parameter). The
user sees the optimizer they built: :func:`gather_full_state` reassembles every fragment's state
into a ``torch.optim.Optimizer.state_dict()`` keyed like the original optimizer (parameter indices
in original group order, hyper-parameters as they are now), so it loads into a plain torch
optimizer on the unwrapped model; :func:`scatter_full_state` does the reverse.

A state value is *elementwise* when it is a tensor with at least one dimension and as many
elements as its parameter (``exp_avg``, ``momentum_buffer``, ``sum``...): its fragments are
slices of it. Anything else (``step``, ``None``, numbers) is *scalar* and identical on every
fragment of a parameter.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import torch

from elixir import distributed as edist
from elixir.offload.pipeline import staged
from elixir.offload.state_binding import is_elementwise
from elixir.optim.nvme import absorb
from elixir.plan.state_format import is_lossy
from elixir.wrapper import lowbit_state

if TYPE_CHECKING:
    from elixir.wrapper.interfaces import ShardedOptimizer


class OptimStateMismatch(ValueError):
    """An optimizer state dict does not fit the wrapped optimizer (groups or sizes differ)."""


# One entry of an original param group: a managed parameter (its slot index) or a parameter the
# module does not manage (frozen), kept as the tensor itself.
Entry = Union[int, torch.Tensor]


@dataclass(frozen=True)
class GroupLayout:
    """The original membership of the user's param groups, before they were cut into fragments."""

    groups: tuple[tuple[Entry, ...], ...]

    def entries(self):
        """(global index, entry) over all groups, in torch's state-dict numbering."""
        i = 0
        for g in self.groups:
            for e in g:
                yield i, e
                i += 1


def capture_layout(module, optimizer: torch.optim.Optimizer) -> GroupLayout:
    """Record which parameters each group holds (call before the groups are rebuilt)."""
    groups = []
    for group in optimizer.param_groups:
        entries: list[Entry] = []
        for p in group["params"]:
            slot = module.param_map.slot_of(p)
            entries.append(slot.index if slot is not None else p)
        groups.append(tuple(entries))
    return GroupLayout(tuple(groups))


def fragment_start(em, f) -> int:
    """Offset of fragment ``f`` inside its flattened parameter."""
    return em.param_map.param_offset(em.chunks[f.chunk].spec, f.lo, f.param_index)


def _group_dicts(eo: ShardedOptimizer) -> list[dict]:
    out = []
    base = 0
    for group, entries in zip(eo.optim.param_groups, eo.layout.groups):
        g = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        g["params"] = list(range(base, base + len(entries)))
        base += len(entries)
        out.append(g)
    return out


def gather_full_state(eo: ShardedOptimizer, rank0_only: bool = False) -> dict:
    """The full torch-format state dict of ``eo`` (collective: call on every rank).

    With ``rank0_only`` the other ranks return ``{}`` (and hold no full tensors)."""
    em = eo.module
    keep = not rank0_only or em.rank == 0
    state = eo.optim.state
    # Per managed parameter on this rank: key -> ("elem", dtype) | ("scalar", value), in order.
    meta: dict[int, dict] = {}
    for f in eo.fragments:
        st = lowbit_state.export_state(eo, state.get(f.tensor), f.tensor.numel(), decode=False)
        if not st:
            continue
        d = meta.setdefault(f.param_index, {})
        for k, v in st.items():
            if k in d:
                continue
            if is_elementwise(v, f.tensor.numel()) and f.tensor.numel() > 0:
                d[k] = ("elem", v.dtype)
            else:
                d[k] = ("scalar", v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
    merged: dict[int, dict] = {}
    for rank_meta in edist.all_gather_object(meta, em.group) if em.world_size > 1 else [meta]:
        for i, d in rank_meta.items():
            m = merged.setdefault(i, {})
            for k, v in d.items():
                m.setdefault(k, v)

    full: dict[int, dict] = {i: {} for i in merged}  # slot index -> key -> value
    for c in em.chunks:
        members = [i for i in em.param_map.chunk_params(c.index) if i in merged]
        if not members:
            continue
        elem_keys: dict[str, torch.dtype] = {}
        for i in members:
            for k, (kind, v) in merged[i].items():
                if kind == "elem":
                    elem_keys.setdefault(k, v)
        frags = eo.chunk_fragments(c.index)
        shards = {k: torch.zeros(c.spec.shard_numel, dtype=dtype, device=em.device) for k, dtype in elem_keys.items()}
        with staged(eo.disk_store, [c.index], write_back=False):  # disk chunks: read, not written
            for f in frags:
                st = lowbit_state.export_state(eo, state.get(f.tensor), f.tensor.numel())
                for k, shard in shards.items():
                    if st and k in st:
                        shard[f.lo : f.hi].copy_(st[k].reshape(-1))
        for k, dtype in elem_keys.items():
            shard = shards.pop(k)
            if c.spec.state_sharded and em.world_size > 1:
                buf = torch.empty(c.spec.capacity, dtype=dtype, device=em.device)
                edist.all_gather_into(buf, shard, em.group)
            else:
                buf = shard
            if not keep:
                continue
            buf = buf.cpu()
            for i in members:
                if merged[i].get(k, ("",))[0] == "elem":
                    s = em.slots[i]
                    full[i][k] = buf[s.offset : s.offset + s.numel].view(s.shape).clone()
        if keep:
            for i in members:
                for k, (kind, v) in merged[i].items():
                    if kind == "scalar":
                        full[i][k] = v
    if not keep:
        return {}
    out_state: dict[int, dict] = {}
    for idx, e in eo.layout.entries():
        if isinstance(e, int):
            if e in full:
                order = list(merged[e])
                out_state[idx] = {k: full[e][k] for k in order}
        else:
            st = state.get(e)
            if st:
                out_state[idx] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in st.items()}
    return {"state": out_state, "param_groups": _group_dicts(eo)}


def check_groups(eo: ShardedOptimizer, saved_groups: list) -> None:
    groups = eo.layout.groups
    if len(saved_groups) != len(groups):
        raise OptimStateMismatch(
            f"the state dict has {len(saved_groups)} param groups, the optimizer {len(groups)}; build the "
            "optimizer with the same param groups as the one that was saved"
        )
    for gi, (sg, g) in enumerate(zip(saved_groups, groups)):
        if len(sg["params"]) != len(g):
            raise OptimStateMismatch(
                f"param group {gi} holds {len(sg['params'])} parameters in the state dict and {len(g)} in the "
                "optimizer; build the optimizer on the same parameters as the one that was saved"
            )


def scatter_full_state(eo: ShardedOptimizer, state_dict: dict) -> None:
    """Load a full torch-format optimizer state dict (every rank needs the whole dict)."""
    install_state(eo, fragment_states_of_full(eo, state_dict), state_dict["param_groups"])


def fragment_states_of_full(eo: ShardedOptimizer, state_dict: dict) -> dict:
    """The state of each of this rank's fragments (keyed by their tensors) in a full torch-format
    optimizer state dict, cut from the whole parameters' (checked against the optimizer's groups)."""
    em = eo.module
    saved_groups = state_dict["param_groups"]
    check_groups(eo, saved_groups)
    saved_state = state_dict["state"]
    by_entry: dict[int, dict] = {}
    for sg, entries in zip(saved_groups, eo.layout.groups):
        for sid, e in zip(sg["params"], entries):
            st = saved_state.get(sid, saved_state.get(str(sid)))
            if st is None:
                continue
            if isinstance(e, int):
                s = em.slots[e]
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() != s.numel and s.numel > 1:
                        raise OptimStateMismatch(
                            f"state {k!r} of {s.name!r} has {v.numel()} elements, the parameter {s.numel}"
                        )
                by_entry[e] = st
            else:
                by_entry[id(e)] = st
    new_state: defaultdict = defaultdict(dict)
    lossy = is_lossy(*em.state_formats)
    for f in eo.fragments:
        st = by_entry.get(f.param_index)
        if st is None:
            continue
        s = em.slots[f.param_index]
        start = fragment_start(em, f)
        d = {}
        for k, v in st.items():
            if is_elementwise(v, s.numel):
                # in the parameter's dtype (a bf16 torch state into fp32 masters); low-precision
                # formats as saved (fp32 moments beside a bf16 master), conform_loaded converts
                to = v.dtype if lossy or not v.is_floating_point() else f.tensor.dtype
                d[k] = v.reshape(-1)[start : start + f.hi - f.lo].to(device=f.tensor.device, dtype=to, copy=True)
            elif isinstance(v, torch.Tensor):
                d[k] = v.detach().clone()
            else:
                d[k] = copy.deepcopy(v)
        new_state[f.tensor] = d
    for entries in eo.layout.groups:
        for e in entries:
            if not isinstance(e, int) and id(e) in by_entry:
                new_state[e] = {
                    k: (v.to(e.device, copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                    for k, v in by_entry[id(e)].items()
                }
    return new_state


def install_state(eo: ShardedOptimizer, new_state: dict, saved_groups: list[dict]) -> None:
    """Replace the inner optimizer's state (keyed by fragment tensors) and its groups'
    hyper-parameters (``saved_groups``, whose ``params`` entries are ignored), as torch's
    ``load_state_dict`` does."""
    lowbit_state.conform_loaded(eo, new_state)  # to the run's state formats, before binding to the disk
    state: defaultdict = defaultdict(dict)
    state.update(new_state)
    new_groups = []
    for group, sg in zip(eo.optim.param_groups, saved_groups):
        ng = {k: copy.deepcopy(v) for k, v in sg.items() if k != "params"}
        ng["params"] = group["params"]
        if "param_names" in group and "param_names" not in ng:
            ng["param_names"] = group["param_names"]
        new_groups.append(ng)
    eo.optim.__setstate__({"state": state, "param_groups": new_groups})
    absorb(eo.optim)  # moments of parameters the optimizer keeps on its own disk go there


# --------------------------------------------------------------------------------------------
# init_step


def _zero_like_scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    return type(v)(0)


def init_state(eo: ShardedOptimizer) -> None:
    """Create the inner optimizer's state for every fragment now, changing nothing else.

    Runs one step with zero gradients and ``lr = weight_decay = 0`` (so elementwise optimizers
    leave parameters and zero-initialised moments as they are), restores the hyper-parameters,
    and resets every ``step`` counter to 0. SGD with ``dampening != 0`` would treat the created
    momentum buffer differently from a fresh one, so its buffer is dropped again. Fragments that
    already have state (loaded, or made by the optimizer's constructor) are left alone.
    """
    opt = eo.optim
    fresh = [f for f in eo.fragments if not opt.state.get(f.tensor)]
    if not fresh:
        return
    zeros: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    for f in fresh:
        n, where = f.tensor.numel(), (f.tensor.device, f.tensor.dtype)  # a bf16 master takes a bf16 gradient
        z = zeros.get(where)
        if z is None or z.numel() < n:
            zeros[where] = z = torch.zeros(max(n, 1), dtype=f.tensor.dtype, device=f.tensor.device)
        f.tensor.grad = z[:n]
    saved = []
    for g in opt.param_groups:
        old = {k: g[k] for k in ("lr", "weight_decay") if k in g}
        saved.append(old)
        for k, v in old.items():
            g[k] = torch.zeros_like(v) if isinstance(v, torch.Tensor) else type(v)(0)
    try:
        eo.plain_step()  # disk chunks: staged one at a time, their new state bound to the disk
    finally:
        for g, old in zip(opt.param_groups, saved):
            g.update(old)
        for f in eo.fragments:
            f.tensor.grad = None
    frag_ids = {id(f.tensor) for f in fresh}
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) not in frag_ids:
                continue
            st = opt.state.get(p)
            if not st:
                continue
            if "step" in st:
                st["step"] = _zero_like_scalar(st["step"])
            if isinstance(opt, torch.optim.SGD) and g.get("dampening", 0) != 0:
                st.pop("momentum_buffer", None)
