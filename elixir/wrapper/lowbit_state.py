"""ElixirOptimizer's side of low-precision optimizer state (issue 33, :mod:`elixir.optim.lowbit`).

The module's :class:`~elixir.wrapper.policies.MixedPrecisionPolicy` (or its plan) names the
formats; the chunks hold masters in the master's dtype (:class:`~elixir.chunk.spec.ChunkSpec`'s
``master_dtype``); the inner CPUAdam/HybridAdam keeps each fragment's moments in the moments'
format, so host memory and the offload file (disk chunks bind every elementwise state entry to
a flat of its own dtype, :mod:`elixir.offload.state_binding`) hold the state at its own size.

State dicts and checkpoints hold each fragment's state as it is (bf16 moments and the Kahan
buffer in bf16). 8-bit moments: sharded checkpoints hold their codes and block scales as they are
(:mod:`elixir.checkpoint.quantised`, which decodes them for another layout); state dicts and mesh
checkpoints, which other layouts cut anew, the fp32 values they decode to (exactly). The format is
recorded beside them; loading into another format converts, with a warning naming the change.

A ``bf16-kahan`` chunk keeps its compensation beside its master from the initial weights on
(:attr:`elixir.chunk.Chunk.comp`: host memory, or a flat of the master's disk record); each
fragment's ``master_comp`` state is a view of it (:func:`comp_views`, taken up by the first step;
loaded state is copied into it), so the optimizer starts from the fp32 initial weights, not from
them rounded to bf16. Loading weights into a ``bf16-kahan`` master (:func:`load_values`: the
module's state dict, checkpoints, pretrained weights) sets the compensation too, to what the loaded values imply
(``round_bf16(value - p)`` with ``p`` the value rounded to nearest: zero for bf16-exact values),
or to the saved one when optimizer state that holds it is loaded with them; the compensation of
the old values would otherwise stay, and the master be ``p`` plus a stale residual.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Optional

import torch

from elixir.chunk.storage import kahan_split
from elixir.offload.store import COMP
from elixir.optim import lowbit
from elixir.optim.cpu_adam import CPUAdam
from elixir.plan.state_format import is_lossy
from elixir.wrapper.fused_step import write_compensated

if TYPE_CHECKING:
    from elixir.chunk import Chunk
    from elixir.wrapper.interfaces import ChunkedModel, ShardedOptimizer


def configure(eo: ShardedOptimizer, fused: bool) -> None:
    """Give the inner optimizer the module's state formats and one random stream per chunk (an
    element's index there is its place in the chunk, the same on every layout of the rank)."""
    master, moments = eo.module.state_formats
    opt = eo.optim
    if not is_lossy(master, moments):
        if isinstance(opt, CPUAdam) and opt.lossy:
            raise ValueError(
                f"{type(opt).__name__} was built with master={opt.state_format[0]!r}, moments={opt.state_format[1]!r} but "
                "the ElixirModule keeps fp32 state: put the formats in the module's MixedPrecisionPolicy(master=..., moments=...)"
            )
        return
    if not fused or not isinstance(opt, CPUAdam):
        raise ValueError(
            f"low-precision optimizer state (master={master!r}, moments={moments!r}) is stepped by elixir's fused Adam "
            f"only: build the optimizer as elixir.optim.CPUAdam or HybridAdam, not {type(opt).__name__}"
        )
    opt.set_state_format(master, moments)
    opt.rng_streams = {id(f.tensor): (f.chunk, eo.module.chunks[f.chunk].spec.shard_offset + f.lo) for f in eo.fragments}
    opt.comp_views = comp_views(eo)


def formats(eo: ShardedOptimizer) -> dict:
    """The recorded formats of ``eo``'s state (state dicts and checkpoints carry this)."""
    master, moments = eo.module.state_formats
    return {"master": master, "moments": moments}


def export_state(eo: ShardedOptimizer, st: Optional[dict], numel: int, decode: bool = True) -> Optional[dict]:
    """A fragment's state as state dicts and checkpoints hold it: 8-bit moments as the fp32 values
    they decode to (with ``decode=False``, meta tensors of that dtype: for the layout pass, which
    must not read disk chunks), everything else as it is."""
    if not st or eo.module.state_formats[1] != "int8" or "exp_avg_absmax" not in st:
        return st
    out = {k: v for k, v in st.items() if k not in lowbit.SCALE_KEYS}
    if decode:
        m, v = lowbit.decode_moments(st, "int8")
    else:
        m = v = torch.empty(numel, dtype=torch.float32, device="meta")
    out["exp_avg"], out["exp_avg_sq"] = m.view(st["exp_avg"].shape), v.view(st["exp_avg_sq"].shape)
    return out


def conform_loaded(eo: ShardedOptimizer, new_state: dict) -> None:
    """Convert freshly loaded fragment states (not yet bound to the disk) to the run's formats, so
    each state key keeps one dtype per chunk; the change of format is warned about by the caller."""
    if not isinstance(eo.optim, CPUAdam):
        return
    master, moments = eo.optim.state_format
    views = eo.optim.comp_views if master == "bf16-kahan" else {}
    for t, st in new_state.items():
        if st and "exp_avg" in st:
            _adopt_compensation(st, views.get(id(t)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # warned once, by warn_format_change
                lowbit.conform_state(st, t.numel(), master, moments)
            if not is_lossy(master, moments):
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = st[k].to(t.dtype)


def warn_format_change(saved: Optional[dict], eo: ShardedOptimizer, where: str) -> None:
    """Warn when state saved in one format is loaded into another (None: saved in fp32)."""
    saved = saved or {"master": "fp32", "moments": "fp32"}
    now = formats(eo)
    if saved != now:
        warnings.warn(
            f"elixir: {where}: optimizer state saved with master={saved['master']!r}, moments={saved['moments']!r} is "
            f"converted to master={now['master']!r}, moments={now['moments']!r} (a precision change)", stacklevel=3,
        )


def load_values(em: ChunkedModel, chunk: Chunk, lo: int, hi: int, src: torch.Tensor, master: Optional[torch.Tensor] = None,
                state: Optional[dict] = None) -> None:
    """Write loaded values ``src`` (1-D) of ``chunk``'s shard range ``[lo, hi)`` into its master
    (``master``: the chunk's, or a mapping of its disk copy) and compute shard: the one way loading
    weights writes masters. bf16-kahan (module docstring): the master is ``src`` rounded to nearest
    and the compensation the chunk keeps beside it (the optimizer state's, or the one its first
    step takes up) what is left, or, when ``state`` (the fragment's loaded optimizer state, about
    to be installed) holds one, the saved compensation. An fp32 compute shard gets the two added,
    other shards ``src`` as before."""
    master = chunk.master if master is None else master
    m = master[lo:hi]
    m.copy_(src)
    value = src
    if chunk.comp is not None:
        saved = state.get(COMP) if state else None
        comp = saved.reshape(-1).to(m.device) if saved is not None else kahan_split(src.to(m.device))[1]
        _write_compensation(em, chunk, lo, hi, comp)
        if chunk.shard is not None and chunk.shard.dtype == torch.float32:
            value = m.float() + comp.float()
    if chunk.shard is not chunk.master and chunk.shard is not master:
        chunk.shard[lo:hi].copy_(value)


def _write_compensation(em: ChunkedModel, chunk: Chunk, lo: int, hi: int, comp: torch.Tensor) -> None:
    """``comp`` into ``chunk``'s compensation (the optimizer state's ``master_comp`` entries are
    views of it): in memory, or, for a disk chunk not staged (its master mapped by a checkpoint
    load), through a writable mapping of its disk copy."""
    store = em.disk_store
    if not chunk.spec.master_on_disk or store.is_resident(chunk.index):
        chunk.comp[lo:hi].copy_(comp)
    else:
        store.mapped(chunk.index, writable=True)[COMP][lo:hi].copy_(comp)


def comp_views(eo: ShardedOptimizer) -> dict[int, torch.Tensor]:
    """``id(fragment tensor)`` -> its part of its chunk's bf16-kahan compensation (a view, bytes
    only while a disk chunk is staged): what the fragment's ``master_comp`` state is from its first
    step on (:attr:`elixir.optim.CPUAdam.comp_views`), and what loaded state is copied into."""
    em, out = eo.module, {}
    for c in em.chunks:
        if c.comp is None:
            continue
        with em.disk_store.sliceable(c.index) if c.spec.master_on_disk else contextlib.nullcontext():
            for f in eo.chunk_fragments(c.index):
                out[id(f.tensor)] = c.comp[f.lo : f.hi].view(f.tensor.shape)
    return out


def _adopt_compensation(st: dict, view: Optional[torch.Tensor]) -> None:
    """Make a loaded fragment state's compensation the one its chunk keeps (``view``): copied in
    when in memory (a disk chunk's is copied when the state is bound to the disk); a state saved
    without one keeps the chunk's."""
    if view is None:
        return
    loaded = st.get(COMP)
    if loaded is None:
        st[COMP] = view
    elif view.untyped_storage().nbytes() >= (view.storage_offset() + view.numel()) * view.element_size():
        view.copy_(loaded.reshape(view.shape))
        st[COMP] = view


def refresh_shard(eo: ShardedOptimizer, index: int) -> None:
    """After optimizer state was loaded (bf16-kahan): chunk ``index``'s compute shard (its master
    in memory: host, or staged) gets the master plus the loaded compensation, as a step writes it;
    a shard that is the master, or derived from it at each read, is left alone."""
    c = eo.module.chunks[index]
    if eo.module.state_formats[0] != "bf16-kahan" or c.shard is None or c.shard is c.master:
        return
    write_compensated(eo, [f for f in eo.chunk_fragments(index) if COMP in (eo.optim.state.get(f.tensor) or {})])


def refresh_host_shards(eo: ShardedOptimizer) -> None:
    """:func:`refresh_shard` for every chunk whose master is in memory (disk chunks: while
    :meth:`~elixir.wrapper.ElixirOptimizer.bind_disk_state` stages them)."""
    for c in eo.module.chunks:
        if not c.spec.master_on_disk:
            refresh_shard(eo, c.index)
