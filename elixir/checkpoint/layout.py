"""What of an ElixirModule and its ElixirOptimizer a checkpoint holds, named so that another world
size or plan can find it: parameters by name and flattened range, other tensors by state-dict key,
param groups by parameter name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from elixir.checkpoint.index import encode
from elixir.wrapper import lowbit_state, optim_state
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.optimizer import ElixirOptimizer, Fragment


def fingerprint(em: ElixirModule, frozen: bool = True) -> dict:
    """Names and shapes of the model's trainable parameters (chunked), of its other state-dict
    tensors, and (``frozen``) of the parameters in frozen chunks."""
    out = {
        "params": {s.name: list(s.shape) for s in em.slots},
        "tensors": {k: list(v.shape) for k, v in module_tensors(em).items()},
    }
    if frozen and em.frozen_map.slots:
        out["frozen"] = {s.name: list(s.shape) for s in em.frozen_map.slots}
    return out


def module_tensors(em: ElixirModule) -> dict[str, torch.Tensor]:
    """State-dict entries not held in chunks (frozen params left out of chunks, buffers), once
    each, by first key."""
    managed = {id(p) for p in em.params} | {id(p) for p in em.frozen_map.params}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, t in em.module.state_dict(keep_vars=True).items():
        if id(t) in managed or id(t) in seen:
            continue
        seen.add(id(t))
        out[k] = t
    return out


@dataclass(frozen=True)
class FrozenPiece:
    """The part of frozen parameter ``name`` in this rank's shard of frozen chunk ``chunk``:
    ``shard[lo:hi]``, elements ``[start, end)`` of the flattened parameter."""

    name: str
    start: int
    end: int
    chunk: int
    lo: int
    hi: int

    def view(self, em: ElixirModule) -> torch.Tensor:
        return em.all_chunks[self.chunk].shard[self.lo : self.hi]


def frozen_pieces(em: ElixirModule, writers_only: bool = False) -> list[FrozenPiece]:
    """This rank's pieces of the frozen chunks (``writers_only``: replicated ones on rank 0 only,
    as they are identical everywhere)."""
    out = []
    for c in em.frozen_chunks:
        if writers_only and not c.spec.sharded and em.rank != 0:
            continue
        for p in em.frozen_map.shard_pieces(c.spec):
            s = em.frozen_map.slots[p.param_index]
            out.append(FrozenPiece(s.name, p.start, p.start + p.hi - p.lo, c.index, p.lo, p.hi))
    return out


def frag_range(em: ElixirModule, f: Fragment) -> tuple[str, int, int]:
    """The parameter a fragment belongs to, and the fragment's range in the flattened parameter."""
    start = optim_state.fragment_start(em, f)
    return em.slots[f.param_index].name, start, start + (f.hi - f.lo)


def writes_fragment(em: ElixirModule, f: Fragment) -> bool:
    """Replicated chunks are identical everywhere: only rank 0 writes them."""
    return em.chunks[f.chunk].spec.state_sharded or em.rank == 0


def fragments(em: ElixirModule, eo: Optional[ElixirOptimizer], mapped: dict[int, torch.Tensor]) -> list[Fragment]:
    """This rank's fragments: the optimizer's, or when none is given the same cut of the chunks
    (``mapped``: the masters of disk chunks, mapped from the offload file)."""
    if eo is not None:
        return eo.fragments
    out = []
    for c in em.chunks:
        master = mapped.get(c.index, c.master)
        for piece in em.param_map.shard_pieces(c.spec):
            out.append(Fragment(piece.param_index, c.index, piece.lo, piece.hi, master[piece.lo : piece.hi]))
    return out


def optimizer_meta(eo: ElixirOptimizer, em: ElixirModule) -> dict:
    """The optimizer's class and param groups, with parameters by name."""
    frozen_names = {id(p): n for n, p in em.module.named_parameters()}
    groups = []
    for group, entries in zip(eo.optim.param_groups, eo.layout.groups):
        g = {k: encode(v, f"hyper-parameter {k!r}") for k, v in group.items() if k not in ("params", "param_names")}
        g["params"] = [em.slots[e].name if isinstance(e, int) else frozen_names.get(id(e), "?") for e in entries]
        groups.append(g)
    return {"class": type(eo.optim).__name__, "param_groups": groups, "state_format": lowbit_state.formats(eo)}
