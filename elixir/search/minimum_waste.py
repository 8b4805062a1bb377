"""minimum_waste_search: the chunk size that wastes the least padding.

Trainable parameters are packed greedily in order (definition order, or the traced order of first
use when ``inp``/``step_fn`` are given) into chunks of one size; a parameter that does not fit in
the current chunk starts the next one. The search tries chunk sizes between the largest parameter
and a cap, coarse then fine, and keeps the one with the least padding. Parameters held by more than
one module (tied weights) get their own replicated chunks. The rCache gets the fewest blocks that
let any single step run (its chunks and those of the calls enclosing it), plus look-ahead blocks
when ``prefetch``.

Nothing here allocates tensors: it works on meta-device models too.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from elixir.search.plan import ChunkPlan, Placement, SearchResult, dtype_name

ALIGN = 16  # elements per rank a shard is aligned to
MAX_CANDIDATES = 1024
MAX_CHUNK_ELEMENTS = 64 * 2**20  # never larger than this unless one parameter is
MIN_CHUNKS = 4  # aim for at least this many sharded chunks when the model allows


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


def pack(numels: Sequence[int], chunk_size: int) -> list[list[int]]:
    """Greedy in-order packing: indices of ``numels`` per chunk."""
    chunks: list[list[int]] = []
    used = chunk_size + 1
    for i, n in enumerate(numels):
        if used + n > chunk_size:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += n
    return chunks


def _waste(numels: Sequence[int], chunk_size: int) -> tuple[int, int]:
    """(padding elements, chunk count) of greedy packing, without building the lists."""
    count, used, pad = 0, chunk_size + 1, 0
    for n in numels:
        if used + n > chunk_size:
            if count:
                pad += chunk_size - used
            count += 1
            used = 0
        used += n
    if count:
        pad += chunk_size - used
    return pad, count


def best_chunk_size(numels: Sequence[int], align: int, cap: Optional[int] = None) -> int:
    """The multiple of ``align`` in [max(numels), cap] with the least padding (smallest on ties)."""
    if not numels:
        return 0
    lo = -(-max(numels) // align) * align
    total = sum(numels)
    if cap is None:
        cap = max(lo, min(MAX_CHUNK_ELEMENTS, -(-total // MIN_CHUNKS)))
    cap = max(lo, -(-cap // align) * align)

    def scan(a: int, b: int, step: int) -> tuple[int, int]:
        best = (None, None)
        s = a
        while s <= b:
            pad, _ = _waste(numels, s)
            if best[0] is None or pad < best[0]:
                best = (pad, s)
            s += step
        return best

    steps = max(1, (cap - lo) // align)
    stride = max(1, -(-steps // MAX_CANDIDATES)) * align
    _, size = scan(lo, cap, stride)
    while stride > align:  # refine around the optimum, 64 candidates a side per level
        finer = max(align, (stride // 64) // align * align)
        _, size = scan(max(lo, size - stride), min(cap, size + stride), finer)
        stride = finer
    return size


def _traced_order(model: nn.Module, inp, step_fn) -> list[tuple[str, ...]]:
    try:
        from elixir.tracer import generate_tf_order  # type: ignore[attr-defined]
    except ImportError:
        try:
            from elixir.tracer.order import generate_tf_order  # type: ignore[no-redef]
        except ImportError:
            raise RuntimeError(
                "minimum_waste_search(inp=..., step_fn=...) needs the tracer (elixir.tracer."
                "generate_tf_order), which is not available in this installation; call it without "
                "inp/step_fn to pack in definition order"
            ) from None
    steps = generate_tf_order(model, inp, step_fn)
    steps = getattr(steps, "params_per_step", steps)
    return [tuple(sorted(s)) for s in steps]


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


def cache_blocks_needed(chunk_of: dict[str, int], steps: Sequence[Sequence[str]], nested: Sequence[Sequence[str]] = ()) -> int:
    """Fewest rCache blocks that let every step run: the runtime pins a step's sharded chunks and
    those of the calls enclosing it (``nested[i]``, ancestors' params), in forward and in backward.
    ``chunk_of`` maps the params of sharded chunks to their chunk index."""
    need = 0
    for i, s in enumerate(steps):
        cs = {chunk_of[n] for n in s if n in chunk_of}
        if nested:
            cs |= {chunk_of[n] for n in nested[i] if n in chunk_of}
        need = max(need, len(cs))
    return need


def minimum_waste_search(
    model: nn.Module,
    group_size: int,
    unified_dtype: torch.dtype = torch.float,
    cpu_offload: bool = False,
    prefetch: bool = False,
    verbose: bool = False,
    pin_memory: bool = True,
    inp=None,
    step_fn: Optional[Callable] = None,
) -> SearchResult:
    """Plan ``model`` for ``group_size`` ranks with the chunk size that minimises padding.

    Args:
        model: the model (any device, meta included).
        group_size: data-parallel world size.
        unified_dtype: compute dtype recorded in the plan.
        cpu_offload: keep shards and optimizer state in host memory.
        prefetch: add look-ahead rCache blocks (and record the traced order when traced).
        verbose: print a rich table of the result.
        pin_memory: page-lock host shards (only matters with an accelerator).
        inp, step_fn: trace one step (``step_fn(model, inp)``) to pack in order of first use.
    """
    t0 = time.perf_counter()
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if (inp is None) != (step_fn is None):
        raise ValueError("give both inp and step_fn (to trace the order), or neither")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    frozen = tuple(n for n, p in model.named_parameters() if not p.requires_grad)
    names = {id(p): n for n, p in named}
    tied = shared_params(model)
    order: Optional[list[tuple[str, ...]]] = None
    if inp is not None:
        order = _traced_order(model, inp, step_fn)
        first_use: dict[str, int] = {}
        for i, s in enumerate(order):
            for n in s:
                first_use.setdefault(n, i)
        pos = {n: i for i, (n, _) in enumerate(named)}
        named.sort(key=lambda np_: (first_use.get(np_[0], len(order)), pos[np_[0]]))
    shapes = {n: tuple(p.shape) for n, p in named}
    sharded_names = [n for n, _ in named if n not in tied]
    numels = [_numel(shapes[n]) for n in sharded_names]
    align = ALIGN * group_size
    size = best_chunk_size(numels, align)
    place = Placement.HOST if cpu_offload else Placement.DEVICE
    dt = dtype_name(unified_dtype)
    chunks: list[ChunkPlan] = []
    for idx in pack(numels, size) if numels else []:
        ns = tuple(sharded_names[i] for i in idx)
        chunks.append(ChunkPlan(ns, tuple(shapes[n] for n in ns), size, dt, True, place, place))
    for n, _ in named:
        if n in tied:
            chunks.append(ChunkPlan((n,), (shapes[n],), _numel(shapes[n]), dt, False, Placement.DEVICE, place))

    chunk_of = {n: ci for ci, c in enumerate(chunks) if c.sharded for n in c.params}
    if order is not None:
        blocks = cache_blocks_needed(chunk_of, order)
    else:
        mods = _module_steps(model, names)
        blocks = cache_blocks_needed(chunk_of, [d for d, _ in mods], [a for _, a in mods])
    if chunk_of:
        blocks = max(1, blocks)
    depth = 0
    if prefetch and chunk_of:
        depth = 1
        blocks += 1
    sharded_count = sum(c.sharded for c in chunks)
    blocks = min(blocks, sharded_count)
    elapsed = time.perf_counter() - t0
    result = SearchResult(
        chunks=tuple(chunks),
        world_size=group_size,
        cache_blocks=blocks,
        prefetch_depth=depth,
        frozen_params=frozen,
        param_order=None if order is None or not prefetch else tuple(order),
        search="minimum_waste",
        info={
            "search_time_s": elapsed,
            "traced": order is not None,
            "pin_memory": pin_memory,
            "sharded_waste": 0.0 if not numels else 1 - sum(numels) / (size * max(1, sharded_count)),
        },
    )
    if verbose:
        print_plan(result, unified_dtype)
    return result


def print_plan(result: SearchResult, dtype: torch.dtype = torch.float) -> None:
    """Rich table: chunk size, chunk count, waste, rCache blocks, per-rank bytes, search time."""
    from rich.console import Console
    from rich.table import Table

    el = torch.empty((), dtype=dtype).element_size()
    sharded = [c for c in result.chunks if c.sharded]
    table = Table(title=f"elixir plan ({result.search}, world size {result.world_size})")
    for col in ("chunk size", "chunks", "replicated", "waste %", "rCache blocks", "shard MiB/rank", "cache MiB", "search s"):
        table.add_column(col, justify="right")
    table.add_row(
        f"{result.chunk_size:,}",
        str(len(sharded)),
        str(len(result.chunks) - len(sharded)),
        f"{100 * result.waste():.2f}",
        str(result.cache_blocks),
        f"{result.shard_bytes_per_rank(el) / 2**20:.1f}",
        f"{result.cache_bytes(el) / 2**20:.1f}",
        f"{result.info.get('search_time_s', 0.0):.3f}",
    )
    Console().print(table)
