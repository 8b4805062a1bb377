"""minimum_waste_search: the chunk size that wastes the least padding.

Trainable parameters are packed greedily in order (definition order, or the traced order of first
use when ``inp``/``step_fn`` are given) into chunks of one size; a parameter that does not fit in
the current chunk starts the next one. The first and last chunks are trimmed to their contents, and
a few outlier parameters (embeddings, LM heads at least twice the size of anything else) may get
chunks of their own. The search tries every chunk size at which some run of consecutive parameters
fills a chunk exactly, plus a grid, and keeps the one with the least padding. Parameters held by more than
one module (tied weights) get their own replicated chunks. Frozen parameters (``requires_grad=False``,
of a dtype chunks hold) are packed the same way, apart, into frozen chunks of their own least-padding
size (``frozen_chunks=False`` leaves them out of chunks, whole on every rank). The rCache gets the fewest blocks that
let any single step run (its chunks and those of the calls enclosing it), plus look-ahead blocks
when ``prefetch``.

Nothing here allocates tensors: it works on meta-device models too.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn as nn
from rich.console import Console
from rich.table import Table
from torch.distributed.tensor import DTensor

from elixir.plan import CHUNKABLE_DTYPES, ChunkPlan, MeshLayout, Placement, SearchResult, dtype_name
from elixir.plan.footprint import element_bytes
from elixir.tables import number_column
from elixir.tracer import generate_tf_order

ALIGN = 16  # elements per rank a shard is aligned to
MAX_CANDIDATES = 1024
MAX_CHUNK_ELEMENTS = 64 * 2**20  # never larger than this unless one parameter is
MIN_CHUNKS = 4  # aim for at least this many sharded chunks when the model allows
MAX_OUTLIERS = 4  # at most this many very large params (embeddings, heads) get chunks of their own


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def shared_params(model: nn.Module) -> set[str]:
    """Names (first ``named_parameters`` name) of trainable params held by more than one module."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    return {n for n, p in model.named_parameters() if p.requires_grad and owners.get(id(p), 0) > 1}


def _local_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape this rank holds of ``p``: its local shard for a tensor-parallel DTensor."""
    return tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)


def _up(n, align):
    return -(-n // align) * align


def pack(numels: Sequence[int], chunk_size: int, align: int = 1, oversize: Optional[int] = None) -> list[tuple[list[int], int]]:
    """Greedy in-order packing into chunks of ``chunk_size``: ``[(param indices, capacity)]``.

    A parameter that does not fit starts the next chunk. The first and the last chunk are trimmed to
    their contents (rounded up to ``align``): both are partial by construction (embeddings before a
    periodic body, the body's remainder). A parameter larger than ``oversize`` (default: the chunk
    size) gets a chunk of its own, sized to fit.
    """
    oversize = chunk_size if oversize is None else oversize
    chunks: list[tuple[list[int], int]] = []
    cur: list[int] = []
    used = 0

    def close() -> None:
        nonlocal cur, used
        if cur:
            cap = _up(used, align) if not chunks else chunk_size
            chunks.append((cur, cap))
        cur, used = [], 0

    for i, n in enumerate(numels):
        if n > oversize:
            close()
            chunks.append(([i], _up(n, align)))
            continue
        if cur and used + n > chunk_size:
            close()
        cur.append(i)
        used += n
    if cur:
        chunks.append((cur, _up(used, align)))
    return chunks


def _waste_many(numels: Sequence[int], sizes: np.ndarray, align: int, oversize: int) -> np.ndarray:
    """Padding of :func:`pack` for every candidate size at once (vectorised over sizes)."""
    used = np.full(sizes.shape, -1, dtype=np.int64)  # -1: no chunk open
    first = np.ones(sizes.shape, dtype=bool)  # no chunk closed yet
    pad = np.zeros(sizes.shape, dtype=np.int64)

    def close_pad(mask):
        open_ = mask & (used >= 0)
        trim = _up(np.maximum(used, 0), align) - np.maximum(used, 0)
        return np.where(open_, np.where(first, trim, sizes - used), 0), open_

    for n in numels:
        if n > oversize:
            p, closed = close_pad(np.ones(sizes.shape, dtype=bool))
            pad += p + (_up(n, align) - n)
            first[:] = False
            used[:] = -1
            continue
        new = (used < 0) | (used + n > sizes)
        p, closed = close_pad(new)
        pad += p
        first &= ~closed
        used = np.where(new, n, used + n)
    return pad + np.where(used >= 0, _up(np.maximum(used, 0), align) - np.maximum(used, 0), 0)


def best_chunk_size(numels: Sequence[int], align: int, cap: Optional[int] = None) -> int:
    """The chunk size with the least padding under :func:`pack` (see :func:`search_chunk_size`)."""
    return search_chunk_size(numels, align, cap)[0]


def search_chunk_size(numels: Sequence[int], align: int, cap: Optional[int] = None) -> tuple[int, int, int]:
    """``(chunk size, oversize threshold, padding)`` with the least padding under :func:`pack`.

    Chunk sizes are multiples of ``align`` in [largest packed parameter, ``cap``]. Greedy packing
    wastes least at sizes where some chunk is exactly full, so the candidates are the sums of every
    run of consecutive parameters (rounded up to ``align``), plus a uniform grid. The few largest
    parameters (embeddings, LM heads) may instead get chunks of their own when that wastes less.
    """
    if not numels:
        return 0, 0, 0
    if cap is None:
        cap = default_cap(numels)
    cap = _up(cap, align)
    distinct = sorted({n for n in numels if n <= cap}, reverse=True)
    thresholds = [cap]
    for d in distinct[:MAX_OUTLIERS]:  # outliers: few params at least twice the rest's largest
        body = [n for n in numels if n < d]
        if body and len(numels) - len(body) <= MAX_OUTLIERS and d >= 2 * max(body):
            thresholds.append(d - 1)
    best = None
    quarter = _up(-(-sum(numels) // MIN_CHUNKS), align)
    for thr, hi in [(t, h) for t in thresholds for h in _caps(numels, t, cap, quarter, align)]:
        body = [n for n in numels if n <= thr]
        if not body:  # every parameter is over the threshold: each gets a chunk of its own
            size = _up(max(numels), align)
            pad = int(_waste_many(numels, np.array([size], dtype=np.int64), align, thr)[0])
            if best is None or pad < best[2]:
                best = (size, thr, pad)
            continue
        lo = _up(max(body), align)
        hi = max(lo, hi)
        cands = set(range(lo, hi + 1, max(align, (hi - lo) // MAX_CANDIDATES // align * align or align)))
        for i in range(len(numels)):
            run = 0
            for n in numels[i:]:
                run += n
                if run > hi or n > thr:
                    break
                if run >= lo:
                    cands.add(_up(run, align))
            if len(cands) > 200_000:
                break
        sizes = np.array(sorted(cands), dtype=np.int64)
        pads = _waste_many(numels, sizes, align, thr)
        j = int(np.argmin(pads))  # the first (smallest size) on ties
        if best is None or pads[j] < best[2]:
            best = (int(sizes[j]), thr, int(pads[j]))
    return best


def _caps(numels: Sequence[int], thr: int, cap: int, quarter: int, align: int) -> list[int]:
    """Upper bounds tried for the chunk size: ``cap``, and 2x, 4x, 8x the largest packed parameter
    when those stay within a quarter of the model (large layers pack better in larger chunks)."""
    body_max = max((n for n in numels if n <= thr), default=0)
    out = [cap]
    for k in (2, 4, 8):
        c = _up(k * body_max, align)
        if cap < c <= quarter:
            out.append(c)
    return out


def default_cap(numels: Sequence[int]) -> int:
    """Largest chunk size considered: a quarter of the packed elements, at most 64 Mi elements."""
    return max(1, min(MAX_CHUNK_ELEMENTS, -(-sum(numels) // MIN_CHUNKS)))


def _traced_order(model: nn.Module, inp, step_fn) -> tuple[list[tuple[str, ...]], list[str]]:
    """(params per step, kind per step) from the tracer."""
    traced = generate_tf_order(model, inp, step_fn)
    order = traced.get("order") if isinstance(traced, dict) else traced
    if order is not None and hasattr(order, "steps"):
        return [tuple(s.params) for s in order.steps], [getattr(s.kind, "value", str(s.kind)) for s in order.steps]
    steps = traced["params_per_step"] if isinstance(traced, dict) else traced.params_per_step
    return [tuple(s) for s in steps], ["forward"] * len(steps)


def uses_checkpointing(model: nn.Module) -> bool:
    """Whether any module of ``model`` has gradient checkpointing switched on (HF style flag)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _module_steps(model: nn.Module, names: dict[int, str]) -> list[tuple[list[str], list[str]]]:
    """Per module owning trainable params, in definition order: (its params, its ancestors' params)."""
    out = []

    def walk(m: nn.Module, ancestors: list[str]) -> None:
        direct = [names[id(p)] for p in m._parameters.values() if p is not None and id(p) in names]
        if direct:
            out.append((direct, list(ancestors)))
        for child in m.children():
            walk(child, ancestors + direct)

    walk(model, [])
    return out


def cache_blocks_needed(
    chunk_of: dict[str, int],
    steps: Sequence[Sequence[str]],
    nested: Sequence[Sequence[str]] = (),
    kinds: Sequence[str] = (),
) -> int:
    """Fewest rCache blocks that let every step run. The runtime pins a step's sharded chunks and
    those of the calls enclosing it (``nested[i]``: ancestors' params); a recomputation step
    (``kinds[i] == "recompute"``) also runs while the chunks of the last backward step stay pinned.
    ``chunk_of`` maps the params of sharded chunks to their chunk index."""
    need = 0
    last_bwd: set = set()
    for i, s in enumerate(steps):
        cs = {chunk_of[n] for n in s if n in chunk_of}
        if nested:
            cs |= {chunk_of[n] for n in nested[i] if n in chunk_of}
        kind = kinds[i] if kinds else "forward"
        if kind == "recompute":
            cs |= last_bwd
        elif kind == "backward":
            last_bwd = set(cs)
        need = max(need, len(cs))
    return need


def minimum_waste_search(
    model: nn.Module,
    group_size: Union[int, MeshLayout],
    unified_dtype: torch.dtype = torch.float,
    cpu_offload: bool = False,
    prefetch: bool = False,
    verbose: bool = False,
    pin_memory: bool = True,
    inp=None,
    step_fn: Optional[Callable] = None,
    frozen_chunks: bool = True,
    max_chunk_size: Optional[int] = None,
    accumulation: bool = False,
) -> SearchResult:
    """Plan ``model`` for ``group_size`` ranks with the chunk size that minimises padding.

    Args:
        model: the model (any device, meta included).
        group_size: data-parallel world size (the ranks chunks shard over), or the
            :class:`~elixir.plan.mesh.MeshLayout` of the run (``dp_shard`` and ``tp`` axes; chunks pack each rank's local tensor-parallel shards).
        unified_dtype: compute dtype recorded in the plan.
        cpu_offload: keep shards and optimizer state in host memory.
        prefetch: add look-ahead rCache blocks (and record the traced order when traced).
        verbose: print a rich table of the result.
        pin_memory: page-lock host shards (only matters with an accelerator).
        inp, step_fn: trace one step (``step_fn(model, inp)``) to pack in order of first use.
        frozen_chunks: pack frozen parameters into sharded frozen chunks (placed like the rest);
            False leaves them out of chunks (``frozen_params``), whole on every rank.
        max_chunk_size: the largest chunk size (elements) to consider (a parameter larger than it
            gets a chunk of its own); default: the search's own cap.
        accumulation: the run accumulates gradients under ``ElixirModule.no_sync()``, which holds
            every sharded trainable chunk gathered for the whole block: the rCache gets those
            blocks plus what any step needs of the frozen chunks (a LoRA plan would otherwise go
            over its cache at every micro-step).
    """
    t0 = time.perf_counter()
    mesh = _plannable_mesh(group_size, inp, step_fn)
    group_size = mesh.dp_shard
    named, frozen_named, frozen = _split_params(model, frozen_chunks)
    names = {id(p): n for n, p in named + frozen_named}
    tied = shared_params(model)
    order: Optional[list[tuple[str, ...]]] = None
    kinds: list[str] = []
    if inp is not None:
        order, kinds = _traced_order(model, inp, step_fn)
        _sort_by_first_use(order, named, frozen_named)
    shapes = {n: _local_shape(p) for n, p in named + frozen_named}  # a DTensor's local shard (tensor parallel)
    align = ALIGN * group_size
    place = Placement.HOST if cpu_offload else Placement.DEVICE
    dt = dtype_name(unified_dtype)
    chunks, numels = _trainable_chunks(named, tied, shapes, align, dt, place, max_chunk_size)
    fchunks = _frozen_chunks(frozen_named, shapes, align, dt, place)
    mods = _module_steps(model, names)
    blocks, depth = _cache_blocks(model, chunks, fchunks, mods, order, kinds, accumulation, prefetch)
    elapsed = time.perf_counter() - t0
    result = SearchResult(
        chunks=tuple(chunks),
        world_size=group_size,
        layout=mesh,
        cache_blocks=blocks,
        prefetch_depth=depth,
        frozen_params=frozen,
        frozen_chunks=tuple(fchunks),
        param_order=None if order is None or not prefetch else tuple(order),
        search="minimum_waste",
        info={
            "search_time_s": elapsed,
            "traced": order is not None,
            "pin_memory": pin_memory,
            "sharded_waste": 0.0 if not numels else 1 - sum(numels) / sum(c.chunk_size for c in chunks if c.sharded),
        },
    )
    if verbose:
        print_plan(result, unified_dtype)
    return result


def _plannable_mesh(group_size: Union[int, MeshLayout], inp, step_fn: Optional[Callable]) -> MeshLayout:
    """The run's mesh, refused (with the way out) where this search cannot plan it."""
    if isinstance(group_size, int) and group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    mesh = MeshLayout.of(group_size)
    if mesh.pp > 1 or mesh.dp_replicate > 1:
        raise NotImplementedError(
            f"minimum_waste_search plans dp_shard and tp axes; this mesh is {mesh.describe()}. Plan each pipeline "
            "stage's module on its own sub-mesh: minimum_waste_search(stage, MeshLayout(dp_shard=..., tp=...))")
    if (inp is None) != (step_fn is None):
        raise ValueError("give both inp and step_fn (to trace the order), or neither")
    if mesh.tp > 1 and inp is not None:
        raise NotImplementedError("minimum_waste_search cannot trace a tensor-parallel model yet: call it without inp/step_fn")
    return mesh


def _split_params(model: nn.Module, frozen_chunks: bool) -> tuple[list, list, tuple[str, ...]]:
    """(trainable (name, param)s, frozen ones packed in chunks, names of frozen ones left whole)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    frozen_named = [(n, p) for n, p in model.named_parameters()
                    if not p.requires_grad and frozen_chunks and p.dtype in CHUNKABLE_DTYPES]
    in_chunks = {n for n, _ in frozen_named}
    frozen = tuple(n for n, p in model.named_parameters() if not p.requires_grad and n not in in_chunks)
    return named, frozen_named, frozen


def _sort_by_first_use(order: Sequence[Sequence[str]], named: list, frozen_named: list) -> None:
    """Sort ``named`` and ``frozen_named`` in place by the traced step that first uses each
    parameter (unused ones last), ties in declaration order."""
    first_use: dict[str, int] = {}
    for i, s in enumerate(order):
        for n in s:
            first_use.setdefault(n, i)
    pos = {n: i for i, (n, _) in enumerate(named + frozen_named)}
    named.sort(key=lambda np_: (first_use.get(np_[0], len(order)), pos[np_[0]]))
    frozen_named.sort(key=lambda np_: (first_use.get(np_[0], len(order)), pos[np_[0]]))


def _trainable_chunks(named: list, tied: set[str], shapes: dict, align: int, dt: str, place: Placement,
                      max_chunk_size: Optional[int]) -> tuple[list[ChunkPlan], list[int]]:
    """The trainable parameters packed at the least-padding chunk size (sharded), then each tied
    parameter in a replicated chunk of its own; and the sizes of the sharded parameters."""
    sharded_names = [n for n, _ in named if n not in tied]
    numels = [_numel(shapes[n]) for n in sharded_names]
    if max_chunk_size is not None and max_chunk_size < 1:
        raise ValueError(f"max_chunk_size must be >= 1 element, got {max_chunk_size}")
    size, oversize, _ = search_chunk_size(numels, align, max_chunk_size) if numels else (0, 0, 0)
    chunks: list[ChunkPlan] = []
    for idx, capacity in pack(numels, size, align, oversize) if numels else []:
        ns = tuple(sharded_names[i] for i in idx)
        chunks.append(ChunkPlan(ns, tuple(shapes[n] for n in ns), capacity, dt, True, place, place))
    for n, _ in named:
        if n in tied:
            chunks.append(ChunkPlan((n,), (shapes[n],), _numel(shapes[n]), dt, False, Placement.DEVICE, place))
    return chunks, numels


def _cache_blocks(model: nn.Module, chunks: list, fchunks: list, mods: list, order, kinds: list[str],
                  accumulation: bool, prefetch: bool) -> tuple[int, int]:
    """(rCache blocks, prefetch depth) for these chunks: what the module steps (or the traced
    order) pin at once, doubled under activation checkpointing, under ``no_sync`` every trainable
    chunk, plus one look-ahead block with ``prefetch``; never more than the sharded chunks."""
    chunk_of = {n: ci for ci, c in enumerate(chunks + fchunks) if c.sharded for n in c.params}
    blocks = cache_blocks_needed(chunk_of, [d for d, _ in mods], [a for _, a in mods])
    if order is not None:
        blocks = max(blocks, cache_blocks_needed(chunk_of, order, kinds=kinds))
    elif uses_checkpointing(model):
        blocks *= 2  # recomputation runs while the backward step's chunks stay pinned
    if accumulation:
        blocks = max(blocks, no_sync_blocks(chunks, fchunks, mods, order, kinds))
    if chunk_of:
        blocks = max(1, blocks)
    depth = 0
    if prefetch and chunk_of:
        depth = 1
        blocks += 1
    sharded_count = sum(c.sharded for c in chunks + fchunks)
    return min(blocks, sharded_count), depth


def no_sync_blocks(chunks: list, fchunks: list, mods: list, order, kinds) -> int:
    """rCache blocks under ``no_sync``: every sharded trainable chunk held, plus the sharded frozen
    chunks any one step needs (frozen chunks are still gathered on demand there)."""
    held = sum(c.sharded for c in chunks)
    frozen_of = {n: len(chunks) + j for j, c in enumerate(fchunks) if c.sharded for n in c.params}
    need = cache_blocks_needed(frozen_of, [d for d, _ in mods], [a for _, a in mods])
    if order is not None:
        need = max(need, cache_blocks_needed(frozen_of, order, kinds=kinds))
    return held + need


def _frozen_chunks(named: list, shapes: dict, align: int, dt: str, place: Placement) -> list[ChunkPlan]:
    """Frozen parameters, in order, packed at their own least-padding chunk size."""
    names = [n for n, _ in named]
    numels = [_numel(shapes[n]) for n in names]
    if not numels:
        return []
    size, oversize, _ = search_chunk_size(numels, align)
    out = []
    for idx, capacity in pack(numels, size, align, oversize):
        ns = tuple(names[i] for i in idx)
        out.append(ChunkPlan(ns, tuple(shapes[n] for n in ns), capacity, dt, True, place, Placement.DEVICE))
    return out


def print_plan(result: SearchResult, dtype: torch.dtype = torch.float, console: Optional[Console] = None) -> None:
    """Rich table, one figure a row (so it reads at 80 columns): chunk size, chunk count, waste,
    rCache blocks, per-rank bytes, search time."""
    el = element_bytes(dtype)
    sharded = [c for c in result.chunks if c.sharded]
    table = Table(title=f"elixir plan ({result.search}, world size {result.world_size})")
    table.add_column("")
    number_column(table, "value")
    for name, value in (
        ("chunk size", f"{result.chunk_size:,}"),
        ("chunks (sharded)", str(len(sharded))),
        ("chunks (replicated)", str(len(result.chunks) - len(sharded))),
        ("waste %", f"{100 * result.waste():.2f}"),
        ("rCache blocks", str(result.cache_blocks)),
        ("shard MiB/rank", f"{result.shard_bytes_per_rank(el) / 2**20:.1f}"),
        ("cache MiB", f"{result.cache_bytes(el) / 2**20:.1f}"),
        ("search s", f"{result.info.get('search_time_s', 0.0):.3f}"),
    ):
        table.add_row(name, value)
    (console or Console()).print(table)
