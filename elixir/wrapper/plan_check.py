"""Checks that a plan fits a model and a world size, with errors that say what differs."""

from __future__ import annotations

import torch.nn as nn

from elixir.search.plan import SearchResult


class PlanMismatch(ValueError):
    """The plan was made for another model or another world size."""


def _fmt(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def validate_plan(module: nn.Module, plan: SearchResult, world_size: int) -> None:
    """Raise :class:`PlanMismatch` unless ``plan`` packs exactly ``module``'s trainable parameters
    with their shapes, for ``world_size`` ranks."""
    if plan.world_size != world_size:
        raise PlanMismatch(
            f"the plan is for world size {plan.world_size} but this process group has {world_size} ranks; "
            f"re-run the search with group_size={world_size}"
        )
    trainable = {n: tuple(p.shape) for n, p in module.named_parameters() if p.requires_grad}
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    planned: dict[str, tuple] = {}
    for ci, chunk in enumerate(plan.chunks):
        if len(chunk.params) != len(chunk.shapes):
            raise PlanMismatch(f"plan chunk {ci} lists {len(chunk.params)} params but {len(chunk.shapes)} shapes")
        for n, s in zip(chunk.params, chunk.shapes):
            if n in planned:
                raise PlanMismatch(f"parameter {n!r} appears in more than one plan chunk")
            planned[n] = tuple(s)
        if chunk.used > chunk.chunk_size:
            raise PlanMismatch(f"plan chunk {ci} holds {chunk.used} elements but has capacity {chunk.chunk_size}")
        if chunk.sharded and chunk.chunk_size % world_size:
            raise PlanMismatch(f"plan chunk {ci} capacity {chunk.chunk_size} is not a multiple of world size {world_size}")
    missing = set(trainable) - set(planned)
    extra = set(planned) - set(trainable)
    problems = []
    if missing:
        problems.append(f"trainable parameters not in the plan: {_fmt(missing)}")
    if extra:
        frozen_extra = extra & frozen
        other = extra - frozen
        if frozen_extra:
            problems.append(f"plan chunks frozen parameters (requires_grad=False): {_fmt(frozen_extra)}")
        if other:
            problems.append(f"plan names parameters the model does not have: {_fmt(other)}")
    shape_diff = [
        f"{n}: plan {planned[n]} vs model {trainable[n]}" for n in sorted(set(planned) & set(trainable))
        if planned[n] != trainable[n]
    ]
    if shape_diff:
        problems.append("shapes differ: " + "; ".join(shape_diff[:8]))
    if problems:
        raise PlanMismatch(
            "the plan does not match this model (was it made for another model or another "
            "requires_grad setting?): " + " | ".join(problems)
        )
    if plan.cache_blocks < 1 and any(c.sharded for c in plan.chunks):
        raise PlanMismatch("the plan has sharded chunks but no rCache blocks (cache_blocks must be >= 1)")
