"""ElixirOptimizer: runs any elementwise torch optimizer on this rank's fp32 master shards.

The optimizer is built by the user on the original parameters. Wrapping rebuilds its param groups
in place on *fragments*: for every parameter, the slice of its chunk's fp32 master that falls in
this rank's shard (the whole parameter for replicated chunks). Hyper-parameters, group structure
and the optimizer object itself are kept, so LR schedulers built before or after keep working.
A fragment's ``.grad`` is the matching slice of the chunk's reduced shard gradient, or None when the
parameter got no gradient on any rank (so the optimizer skips it, as torch does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from elixir.wrapper.module import ElixirModule


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter held by this rank: ``master[lo:hi]`` of chunk ``chunk``."""

    param_index: int
    chunk: int
    lo: int  # offset in this rank's shard
    hi: int
    tensor: torch.Tensor  # the optimizer's param (a view of the master shard)


class ElixirOptimizer:
    """Step ``optimizer`` (built on ``module``'s original parameters) on this rank's shards.

    Args:
        module: the :class:`ElixirModule` whose parameters ``optimizer`` was built on.
        optimizer: an elementwise torch optimizer (AdamW, Adam, SGD, Adagrad, ...), without state yet.
    """

    def __init__(self, module: ElixirModule, optimizer: torch.optim.Optimizer, **kwargs) -> None:
        if kwargs:
            raise TypeError(
                f"ElixirOptimizer got options {sorted(kwargs)} that this version does not implement "
                f"(loss scaling and clipping come with the full ElixirOptimizer)"
            )
        if not isinstance(module, ElixirModule):
            raise TypeError("ElixirOptimizer needs the ElixirModule (wrap the model first)")
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("wrap the optimizer before its first step (it already has state)")
        self.module = module
        self.optim = optimizer
        self.fragments: list[Fragment] = []
        self._frags_of: dict[int, list[Fragment]] = {}
        self._cut_fragments()
        self._rebuild_groups()
        self._sync_grads: list[Callable] = []

    # ---- structure ---------------------------------------------------------------------------

    def _cut_fragments(self) -> None:
        m = self.module
        for c in m.chunks:
            lo, n = c.spec.shard_offset, c.spec.shard_numel
            for i in m._chunk_params[c.index]:
                s = m.slots[i]
                a, b = max(lo, s.offset), min(lo + n, s.offset + s.numel)
                if a >= b:
                    continue
                f = Fragment(i, c.index, a - lo, b - lo, c.master[a - lo : b - lo])
                self.fragments.append(f)
                self._frags_of.setdefault(i, []).append(f)

    def _rebuild_groups(self) -> None:
        m = self.module
        seen: set[int] = set()
        for group in self.optim.param_groups:
            new_params = []
            for p in group["params"]:
                slot = m._slot_of.get(p)
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

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def iter_master_shards(self) -> Iterator[tuple]:
        """(chunk, fp32 master shard, fp32 shard gradient or None, sharded) on this rank."""
        for c, master, grad in self.module.iter_shards():
            yield c, master, grad, c.spec.sharded

    # ---- stepping ----------------------------------------------------------------------------

    def _attach_grads(self) -> None:
        m = self.module
        for f in self.fragments:
            c = m.chunks[f.chunk]
            if c.grad_valid and m.has_grad[f.param_index]:
                f.tensor.grad = c.shard_grad[f.lo : f.hi]
            else:
                f.tensor.grad = None

    def step(self, closure: Optional[Callable] = None):
        """One optimizer step on the shards, then refresh what the next gather reads."""
        if closure is not None:
            raise NotImplementedError("ElixirOptimizer.step does not take a closure")
        self._attach_grads()
        for hook in list(self.module._pre_step_hooks):
            hook(self.module)
        self.optim.step()
        for f in self.fragments:
            f.tensor.grad = None
        self.module.after_optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad()
        for f in self.fragments:
            f.tensor.grad = None

    def __repr__(self) -> str:
        return f"ElixirOptimizer({type(self.optim).__name__}, {len(self.fragments)} fragments)"
