"""Full (unsharded) state dicts for ElixirModule, with the wrapped model's own keys.

Saving gathers one chunk at a time (a collective) and copies its parameters to CPU. Tied
parameters appear under every name the wrapped model's ``state_dict()`` gives them, exactly as
``transformers`` models produce them, so the result loads into the plain model. Loading writes
each rank's own slice into its shards and masters; the only collective is the all-gather that
publishes ZeRO-1/2 chunks' slices into their whole payloads.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable, Optional

import torch

from elixir import distributed as edist
from elixir.offload.pipeline import staged
from elixir.wrapper import lowbit_state

if TYPE_CHECKING:
    from elixir.wrapper.interfaces import ChunkedModel


class StateDictMismatch(RuntimeError):
    """A state dict's keys or shapes do not match the wrapped model."""


def _read_on_every_rank(em: ChunkedModel, chunk, read: Callable[[], torch.Tensor], on_disk: bool) -> torch.Tensor:
    """``read()`` this rank's part of ``chunk``; where it comes from disk, every rank raises
    :class:`~elixir.distributed.DiskFault` if any rank's read failed (else the others would wait
    in the gather that follows). Nothing changes on a failed read."""
    if not on_disk:
        return read()
    error, mine = None, None
    try:
        mine = read()
    except OSError as e:
        error = e
    edist.agree_on_disk_fault(error, em.group, f"reading chunk {chunk.index} for a state dict after step {em.iteration}",
                              "; nothing changed: fix the disk and try again")
    return mine


def _gathered(em: ChunkedModel, chunk, dtype: torch.dtype, read, on_disk: bool, split: bool) -> torch.Tensor:
    """``chunk``'s full values on CPU: each rank's piece (``read()``, every rank told of a disk
    fault) all-gathered when the chunk is ``split`` over the ranks, else copied as it is."""
    full = torch.empty(chunk.spec.capacity, dtype=dtype, device=em.device)
    mine = _read_on_every_rank(em, chunk, read, on_disk)
    if split:
        edist.all_gather_into(full, mine, em.group)
    else:
        full.copy_(mine)
    return full.cpu()


def chunk_values(em: ChunkedModel, chunk) -> torch.Tensor:
    """The full fp32 values of ``chunk`` (gathered from the masters), on CPU; a frozen chunk's
    values in its own (compute) dtype, gathered from its shards."""
    if chunk.spec.frozen:
        return frozen_values(em, chunk)

    def read() -> torch.Tensor:
        with staged(em.disk_store, [chunk.index], write_back=False):  # a disk master: read, not written
            return chunk.master.to(em.device, torch.float32, copy=True)

    return _gathered(em, chunk, torch.float32, read, chunk.spec.master_on_disk, chunk.spec.state_sharded)


def warn_dequantised(chunk, what: str) -> None:
    """Warn that ``what`` holds a quantised frozen chunk's values dequantised: a precision change
    (the values the model computes with, not the original weights; loading them quantises again)."""
    fmt, dtype = chunk.spec.frozen_format, str(chunk.spec.dtype).removeprefix("torch.")
    warnings.warn(
        f"elixir: {what} holds the frozen weights dequantised from {fmt} to {dtype} (a precision change: they are "
        f"the values the model computes with, not the original weights, and loading them quantises to {fmt} "
        "again). To save only what training changed, pass frozen=False to checkpoint.save; the base stays the "
        "pretrained checkpoint it was loaded from", stacklevel=3)


def frozen_values(em: ChunkedModel, chunk) -> torch.Tensor:
    """The full values of the frozen ``chunk``, in its dtype, on CPU (one all-gather); a quantised
    chunk's values dequantised (with :func:`warn_dequantised`'s warning)."""
    if chunk.spec.frozen_format is not None:
        warn_dequantised(chunk, "a state dict")

    def read() -> torch.Tensor:
        with chunk.shard_access(write=False) as shard:  # a disk shard: read in for the gather
            return shard.to(em.device, copy=True)

    return _gathered(em, chunk, chunk.spec.dtype, read, chunk.spec.shard_on_disk, chunk.spec.sharded)


def full_state_dict(em: ChunkedModel, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    keep = not rank0_only or em.rank == 0
    values: dict[int, torch.Tensor] = {}  # id(param) -> full value
    for chunk in em.all_chunks:
        full = chunk_values(em, chunk)
        pmap = em.frozen_map if chunk.spec.frozen else em.param_map
        if keep:
            for i in pmap.chunk_params(chunk.index):
                s = pmap.slots[i]
                values[id(pmap.params[i])] = full[s.offset : s.offset + s.numel].view(s.shape).clone()
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, t in em.module.state_dict(keep_vars=True).items():
        v = values.get(id(t))
        out[key] = v if v is not None else t.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(em: ChunkedModel, state_dict: dict, strict: bool = True, assign: bool = False):
    """Copy a full state dict (the wrapped model's keys) into the chunks and buffers.

    ``assign=True`` (torch: the state dict's tensors become the module's parameters) is refused:
    the parameters are views of chunks elixir owns, so another tensor cannot take their place."""
    if assign:
        raise ValueError(
            "ElixirModule.load_state_dict(assign=True) is not supported: the parameters are views of chunks "
            "elixir owns, so the state dict's tensors cannot become them. Use assign=False: the values are "
            "copied into the chunks (in the chunk dtype), which is what assign=True gives a model built on "
            "meta, with no extra full copy (the chunks are already allocated)"
        )
    expected = em.module.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise StateDictMismatch(
            f"state dict does not match the wrapped model: missing keys {missing}, unexpected keys "
            f"{unexpected} (pass strict=False to load the common keys)"
        )
    by_param: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key, t in expected.items():
            if key not in state_dict:
                continue
            v = state_dict[key]
            if tuple(v.shape) != tuple(t.shape):
                raise StateDictMismatch(f"{key}: shape {tuple(v.shape)} in the state dict, {tuple(t.shape)} in the model")
            if isinstance(t, torch.nn.Parameter) and em.is_chunked(t):
                by_param.setdefault(id(t), v)
            else:
                t.data.copy_(v)
        em.cache.release_all()
        em.streams.synchronize()  # no side-stream copy still reads what the host overwrites
        for chunk in em.chunks:
            # a disk master (and a disk shard): staged, written back
            with staged(em.disk_store, [chunk.index]), chunk.shard_access(write=True):
                for piece in em.param_map.shard_pieces(chunk.spec):
                    v = by_param.get(id(em.params[piece.param_index]))
                    if v is None:
                        continue
                    src = v.reshape(-1)[piece.start : piece.start + piece.hi - piece.lo]
                    lowbit_state.load_values(em, chunk, piece.lo, piece.hi, src)  # master, compensation, shard
        for chunk in em.frozen_chunks:
            with chunk.shard_access(write=True) as shard:  # a disk shard: written back
                for piece in em.frozen_map.shard_pieces(chunk.spec):
                    v = by_param.get(id(em.frozen_map.params[piece.param_index]))
                    if v is not None:
                        shard[piece.lo : piece.hi].copy_(v.reshape(-1)[piece.start : piece.start + piece.hi - piece.lo])
        em.publish_updates()  # ZeRO-1/2 chunks: every rank wrote its slice of the payload
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def full_grads(em: ChunkedModel, fused: bool) -> dict[str, Optional[torch.Tensor]]:
    """Every trainable parameter's full fp32 gradient (None when it got none), keyed by its name.
    Collective. ``fused``: a fused backward-and-step consumes the gradients, so this refuses."""
    if fused:
        raise RuntimeError(
            "full_grads: with the fused backward-and-step (fused_step) each chunk's gradient is "
            "consumed by its optimizer step during backward; use fused_step=False to inspect gradients"
        )
    out: dict[str, Optional[torch.Tensor]] = {}
    for c in em.chunks:
        full = torch.zeros(c.spec.capacity, dtype=torch.float32, device=em.device)
        if c.grad_valid:
            if c.spec.state_sharded:
                edist.all_gather_into(full, c.shard_grad.to(em.device, torch.float32), em.group)
            else:
                full.copy_(c.shard_grad)
        elif c.spec.state_sharded:
            edist.all_gather_into(full, torch.zeros(c.spec.shard_numel, device=em.device), em.group)
        for i in em.param_map.by_chunk[c.index]:
            s = em.param_map.slots[i]
            out[s.name] = full[s.offset : s.offset + s.numel].view(s.shape).clone() if em.has_grad[i] else None
    return out
