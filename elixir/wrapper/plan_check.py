"""Checks that a plan fits a model and a world size, with errors that say what differs."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Union

import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.device import default_device
from elixir.plan import CHUNKABLE_DTYPES, LayoutMismatchError, MeshLayout, SearchResult
from elixir.plan.mesh import layout_argument

PlanLike = Union[SearchResult, str, os.PathLike]


class PlanMismatch(ValueError):
    """The plan was made for another model or another mesh layout."""


def _fmt(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more



def check_trainable_dtypes(module: nn.Module) -> None:
    """Raise ``TypeError`` naming every trainable parameter whose dtype a chunk cannot hold (complex,
    float64, integer, float8...): wrapping would silently cast it to a float dtype, and the error
    would only surface inside forward as a dtype mismatch."""
    bad = [f"{n} ({p.dtype})" for n, p in module.named_parameters() if p.requires_grad and p.dtype not in CHUNKABLE_DTYPES]
    if bad:
        raise TypeError(
            f"elixir chunks hold float32, float16 and bfloat16 parameters only; trainable parameters of "
            f"other dtypes: {_fmt(bad)}. Convert them before wrapping (e.g. model.float(); a complex "
            f"parameter as two real ones via torch.view_as_real), or freeze them (requires_grad=False)"
        )


def validate_plan(module: nn.Module, plan: SearchResult, layout: Union[MeshLayout, int]) -> None:
    """Raise :class:`PlanMismatch` unless ``plan`` packs exactly ``module``'s trainable parameters
    with their shapes, for the mesh ``layout`` (an int: plain data parallelism over that many ranks),
    and ``TypeError`` for a trainable parameter of a dtype chunks cannot hold (see
    :func:`check_trainable_dtypes`)."""
    check_trainable_dtypes(module)
    layout = MeshLayout.of(layout)
    try:
        plan.layout.require_same(
            layout, "the plan",
            f"re-run the search for this layout (optimal_search(model, {layout_argument(layout)}, ...))",
        )
    except LayoutMismatchError as e:
        raise PlanMismatch(str(e)) from None
    world_size = layout.dp_shard
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
        if chunk.state_sharded and chunk.chunk_size % world_size:
            raise PlanMismatch(
                f"plan chunk {ci} ({chunk.sharding.value}) capacity {chunk.chunk_size} is not a multiple of world size "
                f"{world_size}: a chunk whose state is split needs equal parts (re-plan, or make it replicated)"
            )
    missing = set(trainable) - set(planned)
    extra = set(planned) - set(trainable)
    problems = _frozen_chunk_problems(module, plan, world_size, set(planned))
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
    if plan.cache_blocks < 1 and any(c.sharded for c in plan.all_chunks):
        raise PlanMismatch("the plan has sharded chunks but no rCache blocks (cache_blocks must be >= 1)")


def _frozen_chunk_problems(module: nn.Module, plan: SearchResult, world_size: int, trainable_planned: set) -> list[str]:
    """What is wrong with the plan's frozen chunks for this model: each must pack frozen
    parameters of a chunkable dtype, each at most once, none also in a trainable chunk."""
    named = dict(module.named_parameters())
    seen: set[str] = set()
    problems = []
    for ci, chunk in enumerate(plan.frozen_chunks):
        if len(chunk.params) != len(chunk.shapes) or chunk.used > chunk.chunk_size:
            problems.append(f"frozen chunk {ci} is malformed (params/shapes/capacity)")
        if chunk.sharded and chunk.chunk_size % world_size:
            problems.append(f"frozen chunk {ci} capacity {chunk.chunk_size} is not a multiple of world size {world_size}")
        for n, shape in zip(chunk.params, chunk.shapes):
            p = named.get(n)
            if p is None:
                problems.append(f"frozen chunk {ci} names a parameter the model does not have: {n}")
            elif p.requires_grad:
                problems.append(f"frozen chunk {ci} holds a trainable parameter (requires_grad=True): {n}")
            elif p.dtype not in CHUNKABLE_DTYPES:
                problems.append(f"frozen chunk {ci} holds {n} of dtype {p.dtype} (chunks hold float32/16, bfloat16)")
            elif tuple(p.shape) != tuple(shape):
                problems.append(f"shapes differ: {n}: plan {tuple(shape)} vs model {tuple(p.shape)}")
            if n in seen or n in trainable_planned:
                problems.append(f"parameter {n!r} appears in more than one plan chunk")
            seen.add(n)
    return problems


def as_plan(plan: PlanLike) -> SearchResult:
    """A :class:`SearchResult`, or the path of one saved with ``SearchResult.save`` /
    ``elixir plan --out`` (loaded with ``SearchResult.load``); anything else is a ``TypeError``."""
    if isinstance(plan, SearchResult):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return SearchResult.load(plan)
    raise TypeError(
        f"search_result must be a SearchResult (from optimal_search / minimum_waste_search) or the path "
        f"of a plan file (elixir plan --out plan.json; SearchResult.load), got {type(plan).__name__}"
    )


def plan_fingerprint(plan: SearchResult) -> str:
    """A hash of everything in ``plan`` that decides the runtime's collectives: chunks (parameters,
    shapes, sizes, sharding, placements), world size, cache blocks, prefetch depth, traced order and
    frozen parameters. Search timings and predictions (``info``, ``prediction``) are left out."""
    d = plan.to_json()
    d.pop("info", None)
    d.pop("prediction", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def agree_on_plan(plan: SearchResult, group=None) -> None:
    """Check that every rank of ``group`` holds the same plan: one all-gather of an 8-byte
    fingerprint. Raises :class:`PlanMismatch` on every rank, naming which ranks hold which plan;
    ranks holding different plans would otherwise fail later with opaque transport errors."""
    world = edist.get_world_size(group)
    if world == 1:
        return
    mine = plan_fingerprint(plan)
    local = torch.tensor([int(mine[:15], 16)], dtype=torch.int64, device=default_device())
    every = torch.empty(world, dtype=torch.int64, device=default_device())
    edist.all_gather_into(every, local, group)
    prints = every.tolist()
    if len(set(prints)) == 1:
        return
    holders: dict[int, list[int]] = {}
    for r, f in enumerate(prints):
        holders.setdefault(f, []).append(r)
    groups = "; ".join(
        f"ranks {', '.join(map(str, rs))}: plan {f:015x}" for f, rs in sorted(holders.items(), key=lambda kv: kv[1][0])
    )
    raise PlanMismatch(
        f"the ranks hold different plans ({groups}); this is rank {edist.get_rank(group)}. Make the plan on "
        f"one rank and share it (plan.save(path) then SearchResult.load(path), or "
        f"elixir.distributed.broadcast_object(plan)), or seed every rank's search identically"
    )
