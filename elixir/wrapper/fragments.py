"""The inner optimizer's view of the shards: one *fragment* per parameter piece in this rank's shard.

For every parameter, a fragment is the slice of its chunk's fp32 master that falls in this rank's
shard (the whole parameter for replicated chunks). :class:`ShardFragments` cuts them, rebuilds the
user's param groups on them in place (hyper-parameters, group structure and the optimizer object are
kept, so LR schedulers keep working), and attaches each step's gradients: a fragment's ``.grad`` is
the matching slice of the chunk's reduced shard gradient, or None when the parameter got no gradient
on any rank (so the optimizer skips it, as torch does).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from elixir.offload.state_binding import FragmentState
from elixir.wrapper.interfaces import ChunkedModel


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter held by this rank: ``master[lo:hi]`` of chunk ``chunk``."""

    param_index: int
    chunk: int
    lo: int  # offset in this rank's shard
    hi: int
    tensor: torch.Tensor  # the optimizer's param (a view of the master shard)


class ShardFragments:
    """``module``'s trainable chunks cut into fragments, and ``optim``'s param groups over them."""

    def __init__(self, module: ChunkedModel, optim: torch.optim.Optimizer) -> None:
        self.module, self.optim = module, optim
        self.fragments: list[Fragment] = []
        self._frags_of: dict[int, list[Fragment]] = {}
        self._chunk_frags: dict[int, list[Fragment]] = {}
        self._lowp_grads: dict[int, torch.Tensor] = {}  # id(fragment tensor) -> its bf16/fp16 gradient
        self._cut()

    def _cut(self) -> None:
        m = self.module
        for c in m.chunks:
            store = m.disk_store
            with store.sliceable(c.index) if store is not None and c.index in store.chunks else contextlib.nullcontext():
                for piece in m.param_map.shard_pieces(c.spec):
                    i = piece.param_index
                    f = Fragment(i, c.index, piece.lo, piece.hi, c.master[piece.lo : piece.hi])
                    self.fragments.append(f)
                    self._frags_of.setdefault(i, []).append(f)
                    self._chunk_frags.setdefault(c.index, []).append(f)

    def chunk_fragments(self, index: int) -> list[Fragment]:
        """This rank's fragments of chunk ``index`` (plan order)."""
        return self._chunk_frags.get(index, [])

    def fragment_states(self, index: int) -> list[FragmentState]:
        """The inner optimizer's state dict (None before its first step) and range of each of
        this rank's fragments of chunk ``index``: what disk offload binds to its flats."""
        return [(self.optim.state.get(f.tensor), f.lo, f.hi) for f in self.chunk_fragments(index)]

    def rebuild_groups(self) -> None:
        """Replace each managed parameter of the param groups by its fragments (in place), and
        drop the inner optimizer's state (it was keyed by the original parameters)."""
        m = self.module
        seen: set[int] = set()
        for group in self.optim.param_groups:
            new_params = []
            for p in group["params"]:
                slot = m.param_map.slot_of(p)
                if slot is None:
                    if p.requires_grad:
                        raise ValueError(
                            "the optimizer holds a trainable parameter that the ElixirModule does not "
                            "manage; build the optimizer on the wrapped model's parameters"
                        )
                    new_params.append(p)  # frozen: left as it is (it never gets a gradient)
                    continue
                if slot.index in seen:
                    raise ValueError(f"parameter {slot.name!r} appears in more than one param group")
                seen.add(slot.index)
                new_params.extend(f.tensor for f in self._frags_of.get(slot.index, []))
            group["params"] = new_params
        self.optim.state.clear()
        if getattr(self.optim, "nvme", None) is not None:
            self.optim.nvme.reset_layout()  # laid out again on the fragments at the first step

    def attach_grads(self, chunk: Optional[int] = None) -> None:
        """Give every fragment (of chunk ``chunk`` only, when given) its slice of the reduced
        shard gradient: as ``.grad`` when it is fp32, else kept aside (torch refuses a
        low-precision ``.grad`` on an fp32 tensor) for :meth:`grad_of`."""
        m = self.module
        for f in self.fragments if chunk is None else self.chunk_fragments(chunk):
            c = m.chunks[f.chunk]
            g = c.shard_grad[f.lo : f.hi] if c.grad_valid and m.has_grad[f.param_index] else None
            if g is not None and g.dtype != f.tensor.dtype:
                self._lowp_grads[id(f.tensor)] = g
                g = None
            f.tensor.grad = g

    def grad_of(self, f: Fragment) -> Optional[torch.Tensor]:
        """The gradient attached to fragment ``f`` for this step (any dtype), or None."""
        g = f.tensor.grad
        return g if g is not None else self._lowp_grads.get(id(f.tensor))

    def detach_grads(self, frags: Optional[list[Fragment]] = None) -> None:
        """Take the gradients off every fragment (of ``frags`` only, when given)."""
        for f in self.fragments if frags is None else frags:
            f.tensor.grad = None
            self._lowp_grads.pop(id(f.tensor), None)

    @contextlib.contextmanager
    def only(self, keep: Callable[[torch.Tensor], bool]) -> Iterator[None]:
        """Restrict every param group to the params ``keep`` accepts for the block."""
        saved = [g["params"] for g in self.optim.param_groups]
        try:
            for g in self.optim.param_groups:
                g["params"] = [p for p in g["params"] if keep(p)]
            yield
        finally:
            for g, params in zip(self.optim.param_groups, saved):
                g["params"] = params
