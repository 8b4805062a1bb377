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

Loading weights into a ``bf16-kahan`` master (:func:`load_values`: the module's state dict,
checkpoints, pretrained weights) sets the compensation too, to what the loaded values imply
(``round_bf16(value - p)`` with ``p`` the value rounded to nearest: zero for bf16-exact values),
or to the saved one when optimizer state that holds it is loaded with them; the compensation of
the old values would otherwise stay, and the master be ``p`` plus a stale residual.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable, Optional

import torch

from elixir.optim import lowbit
from elixir.optim.cpu_adam import CPUAdam
from elixir.plan.state_format import is_lossy
from elixir.wrapper.fused_step import write_compensated

if TYPE_CHECKING:
    from elixir.chunk import Chunk
    from elixir.offload.state_binding import FragmentState
    from elixir.wrapper.interfaces import ChunkedModel, ShardedOptimizer

COMP = "master_comp"


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
    for t, st in new_state.items():
        if st and "exp_avg" in st:
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


def optimizer_of(em: ChunkedModel) -> Optional[ShardedOptimizer]:
    """The ElixirOptimizer stepping ``em`` (None before one is built, or once it was replaced)."""
    eo = getattr(em, "elixir_optimizer", None)
    return None if eo is None or eo.retired else eo


def states_to_bind(em: ChunkedModel, eo: Optional[ShardedOptimizer]) -> Optional[Callable[[int], list[FragmentState]]]:
    """The ``fragment_states`` a checkpoint load binds to the disk once its masters are no longer
    mapped: the loaded optimizer's, or (bf16-kahan) the module's optimizer's, whose compensation
    of disk chunks :func:`load_values` replaced; None when nothing needs binding."""
    if eo is not None:
        return eo.fragment_states
    own = optimizer_of(em)
    return own.fragment_states if own is not None and em.state_formats[0] == "bf16-kahan" else None


def load_values(em: ChunkedModel, chunk: Chunk, lo: int, hi: int, src: torch.Tensor, master: Optional[torch.Tensor] = None,
                state: Optional[dict] = None) -> None:
    """Write loaded values ``src`` (1-D) of ``chunk``'s shard range ``[lo, hi)`` into its master
    (``master``: the chunk's, or a mapping of its disk copy) and compute shard: the one way loading
    weights writes masters. bf16-kahan (module docstring): the master is ``src`` rounded to nearest
    and the compensation what is left, or, when ``state`` (the fragment's loaded optimizer state,
    about to be installed) holds one, the saved compensation; it goes to ``state``, else to the
    optimizer's current state where that exists. An fp32 compute shard gets the compensated master,
    other shards ``src`` as before."""
    master = chunk.master if master is None else master
    m = master[lo:hi]
    m.copy_(src)
    value = src
    if m.dtype == torch.bfloat16 and em.state_formats[0] == "bf16-kahan":
        saved = state.get(COMP) if state else None
        if saved is not None:
            comp = saved.reshape(-1).to(m.device)
        else:
            wide = torch.float64 if src.dtype == torch.float64 else torch.float32
            comp = (src.to(m.device, wide) - m.to(wide)).to(torch.bfloat16)
            if state and "exp_avg" in state:
                state[COMP] = comp
            elif state is None:
                _store_compensation(em, chunk.index, lo, hi, comp)
        if chunk.shard is not None and chunk.shard.dtype == torch.float32:
            value = m.float() + comp.float()
    if chunk.shard is not chunk.master and chunk.shard is not master:
        chunk.shard[lo:hi].copy_(value)


def _store_compensation(em: ChunkedModel, index: int, lo: int, hi: int, comp: torch.Tensor) -> None:
    """Put ``comp`` (chunk ``index``'s range ``[lo, hi)``) into the optimizer's current state: in
    place where the state is in memory (host, or a staged disk chunk); a disk chunk's state not
    staged (its master mapped by a checkpoint load) is replaced, whole fragments only, and bound
    to the disk again after the load (:func:`states_to_bind`)."""
    eo = optimizer_of(em)
    if eo is None:
        return
    for f in eo.chunk_fragments(index):
        a, b = max(lo, f.lo), min(hi, f.hi)
        st = eo.optim.state.get(f.tensor) if a < b else None
        t = st.get(COMP) if st else None
        if t is None:
            continue
        piece = comp[a - lo : b - lo]
        if t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size():
            t.view(-1)[a - f.lo : b - f.lo].copy_(piece)
        elif (a, b) == (f.lo, f.hi):
            st[COMP] = piece.clone().view(t.shape)
        else:
            raise RuntimeError(
                f"chunk {index}: a load wrote part of fragment [{f.lo}, {f.hi}) whose optimizer state is on disk and not "
                "staged; stage the chunk for the write (elixir.offload.pipeline.staged) or write whole fragments"
            )


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
