"""The optimizer of an :class:`~elixir.parallel.pipeline.ElixirPipeline`: one
:class:`~elixir.wrapper.ElixirOptimizer` per stage module, stepped as one over the whole mesh.

Before the stages step, :class:`PipelineOptimizer`:

- **sums tied gradients.** A weight tied between the first and the last stage (GPT-2's ``wte`` and
  ``lm_head``) is one parameter on each; after both stages reduced their gradients over dp, each
  copy's gradient is replaced by the sum of the two (an all-reduce over ``pp``, the other stages
  adding zeros), which is the gradient of the tied weight in an untied run. Both copies then take
  the same step from the same value and stay equal;
- **takes the global gradient norm over the whole mesh**: each stage's norm over its dp and tp
  ranks (:func:`~elixir.wrapper.clipping.global_grad_norm`), summed over ``pp``, the last stage's
  copy of a tied weight left out (counted once, as in an untied model). Every stage clips by the
  same coefficient;
- **agrees on overflow** (fp16): the inf/NaN flag is the same on every rank of the mesh, so every
  stage skips or steps together and every stage's loss scaler moves the same way. Only the last
  stage scales its outputs' gradients (the loss); the others receive gradients already scaled.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from elixir import distributed as edist
from elixir.wrapper import ElixirModule, ElixirOptimizer
from elixir.wrapper.clipping import GradNorm, global_grad_norm

# ElixirPipeline is only named in type hints (floor 4 files of one part may import each other one way)
Pipeline = Any


def _slot(em: ElixirModule, name: str):
    for s in em.slots:
        if s.name == name:
            return s
    raise KeyError(f"no trainable parameter {name!r} in stage {em.module.index}")


def _window(em: ElixirModule, slot) -> tuple[Any, int, int, int]:
    """(chunk, a, b, lo): the part [a, b) of the slot's chunk range this rank's shard gradient holds,
    the shard starting at chunk offset lo."""
    c = em.chunks[slot.chunk]
    lo = c.spec.shard_offset if c.spec.state_sharded else 0
    n = c.spec.shard_numel if c.spec.state_sharded else c.spec.capacity
    return c, max(slot.offset, lo), min(slot.offset + slot.numel, lo + n), lo


def stage_grad(em: ElixirModule, name: str) -> torch.Tensor:
    """Parameter ``name``'s reduced gradient (flat, fp32, whole over dp). Collective over dp."""
    slot = _slot(em, name)
    c, a, b, lo = _window(em, slot)
    full = torch.zeros(slot.numel, dtype=torch.float32, device=em.device)
    if c.grad_valid and a < b:
        full[a - slot.offset:b - slot.offset] = c.shard_grad[a - lo:b - lo].to(em.device, torch.float32)
    if c.spec.state_sharded and em.world_size > 1:
        edist.all_reduce(full, em.group)  # the shards' windows are disjoint
    return full


def set_stage_grad(em: ElixirModule, name: str, full: torch.Tensor) -> None:
    """Write this rank's window of ``full`` into ``name``'s reduced gradient."""
    slot = _slot(em, name)
    c, a, b, lo = _window(em, slot)
    if not c.grad_valid:
        raise RuntimeError(f"stage {em.module.index}: the tied parameter {name!r} got no gradient this step")
    if a < b:
        c.shard_grad[a - lo:b - lo].copy_(full[a - slot.offset:b - slot.offset])


class PipelineOptimizer:
    """Step every stage of ``pipe`` (see the module docstring).

    Args:
        pipe: the :class:`~elixir.parallel.pipeline.ElixirPipeline`.
        make_optimizer: ``make_optimizer(params) -> torch.optim.Optimizer`` for each stage module's
            parameters (e.g. ``lambda ps: torch.optim.AdamW(ps, lr=1e-3)``), an optimizer whose
            class and defaults are used that way (its ``param_groups`` beyond the defaults are not),
            or a list of ready optimizers, one per stage module of this rank, each on that
            module's parameters.
        max_norm, norm_type: clip the global norm over the whole mesh (0: no clipping).
        follow_first: before each step, give every other stage module's optimizer the first one's
            hyperparameters, group by group (``lr``, ...): the others are copies of one user
            optimizer, and an LR scheduler built on it changes only the first.
        **optimizer_kwargs: passed to each :class:`ElixirOptimizer` (loss-scale policy, ...).
    """

    def __init__(self, pipe: Pipeline, make_optimizer: Any, max_norm: float = 0.0, norm_type: float = 2.0,
                 follow_first: bool = False, **optimizer_kwargs: Any) -> None:
        if optimizer_kwargs.get("fused_step"):
            raise ValueError("a pipeline steps after the tied gradients are summed over the stages: fused_step=False")
        if isinstance(make_optimizer, (list, tuple)):  # one ready optimizer per stage module
            if len(make_optimizer) != len(pipe.modules):
                raise ValueError(f"{len(make_optimizer)} optimizers for {len(pipe.modules)} stage modules on this rank")
            inner = list(make_optimizer)
        else:
            make = _maker(make_optimizer)
            inner = [make(list(em.parameters())) for em in pipe.modules]
        self.pipe = pipe
        self.follow_first = follow_first
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self.optimizers = [ElixirOptimizer(em, opt, fused_step=False, **optimizer_kwargs)
                           for em, opt in zip(pipe.modules, inner)]
        for opt, em in zip(self.optimizers, pipe.modules):
            if not em.module.is_last:
                opt.stop_scaling_outputs()
        self.last_norm: Optional[float] = None

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def last_step_skipped(self) -> bool:
        return any(opt.last_step_skipped for opt in self.optimizers)

    @property
    def loss_scale(self) -> float:
        return self.optimizers[0].loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def sync_tied(self) -> None:
        """Replace each tied copy's gradient by the sum over the stages that hold it. Collective."""
        pipe = self.pipe
        for (first, last), numel in zip(pipe.tied, pipe.tied_numels):
            full = torch.zeros(numel, dtype=torch.float32, device=pipe.modules[0].device)
            held = [(em, first if em.module.is_first else last) for em in pipe.modules
                    if em.module.is_first or em.module.is_last]
            for em, name in held:
                full += stage_grad(em, name)
            edist.all_reduce(full, pipe.pp_group)
            for em, name in held:
                set_stage_grad(em, name, full)

    def grad_norm(self, norm_type: float = 2.0) -> GradNorm:
        """The global gradient norm over every stage (tied weights once) and the agreed overflow
        flag. Collective over the whole mesh."""
        p = float(norm_type)
        is_inf = math.isinf(p)
        partial, flags = 0.0, 0.0
        for em in self.pipe.modules:
            gn = global_grad_norm(em, p)
            flags = max(flags, float(gn.found_inf))
            if not gn.found_inf:
                partial = max(partial, gn.norm) if is_inf else partial + gn.norm ** p
        if not is_inf:
            partial -= self._tied_correction(p)
        packed = torch.tensor([partial, flags], dtype=torch.float64)
        if is_inf:
            edist.all_reduce(packed, self.pipe.pp_group, op=torch.distributed.ReduceOp.MAX)
        else:
            flag = packed[1:].clone()
            edist.all_reduce(packed, self.pipe.pp_group)
            edist.all_reduce(flag, self.pipe.pp_group, op=torch.distributed.ReduceOp.MAX)
            packed[1] = flag[0]
        total, found = packed.tolist()
        if found:
            return GradNorm(float("inf"), True, p)
        return GradNorm(total if is_inf else max(total, 0.0) ** (1.0 / p), False, p)

    def _tied_correction(self, p: float) -> float:
        """The ``p``-th power sum of the last stage's tied copies (counted by its stage's norm, left
        out of the whole's), summed over tp where the tie is sharded there (as the stage norm did)."""
        out = torch.zeros((), dtype=torch.float64)
        for em in self.pipe.modules:
            if em.module.is_last and not em.module.is_first:
                for _, last in self.pipe.tied:
                    g = stage_grad(em, last)  # already summed over the stages by sync_tied
                    out += torch.linalg.vector_norm(g, p, dtype=torch.float32).double() ** p
        if self.pipe.tied_tp_sharded:
            edist.all_reduce(out, self.pipe.tp_group)
        return float(out)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global norm over the whole mesh (applied at :meth:`step`); returns it. Collective."""
        gn = self.grad_norm(norm_type)
        out = None
        for opt in self.optimizers:
            out = opt.clip_by(gn, max_norm)
        return out

    def step(self) -> None:
        """Sum tied gradients, clip over the whole mesh (``max_norm``), agree on overflow, then step
        every stage. Collective over the whole mesh."""
        self.sync_tied()
        if self.follow_first:
            for opt in self.optimizers[1:]:
                for g, g0 in zip(opt.param_groups, self.optimizers[0].param_groups):
                    g.update({k: v for k, v in g0.items() if k != "params"})
        scaled = self.optimizers[0].scaler is not None
        if self.max_norm > 0:
            self.last_norm = float(self.clip_grad_norm_(self.max_norm, self.norm_type))
        elif scaled:
            gn = self.grad_norm(float("inf"))
            for opt in self.optimizers:
                opt.clip_by(gn, None)
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        return {f"stage{em.module.index}": opt.state_dict() for em, opt in zip(self.pipe.modules, self.optimizers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for em, opt in zip(self.pipe.modules, self.optimizers):
            opt.load_state_dict(state[f"stage{em.module.index}"])


def _maker(make: Any) -> Callable[[list], torch.optim.Optimizer]:
    if isinstance(make, torch.optim.Optimizer):
        cls, defaults = type(make), dict(make.defaults)
        return lambda params: cls(params, **defaults)
    if callable(make):
        return make
    raise TypeError("PipelineOptimizer needs make_optimizer(params) -> optimizer, or an optimizer to copy")
