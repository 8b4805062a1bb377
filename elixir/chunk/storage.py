"""Where one chunk's bytes live: the gathered payload, this rank's shard and its fp32 master.

:class:`ChunkStorage` owns the three tensors and their ledger bookings; it issues no collective
(that is :class:`~elixir.chunk.comm.ChunkComm`'s) and keeps no state machine (that is the chunk's).

- ``payload``: the full flat compute-dtype tensor that parameter views point into. For a sharded
  chunk its storage is resized to 0 when released and back when gathered, so any view of it (also
  the views autograd saved for backward) sees the re-gathered values;
- ``shard``: this rank's compute-dtype slice (the whole chunk when replicated), on the device, in
  host memory, or in an offload file (read in only while used: :meth:`shard_access`); for a chunk
  whose parameters are whole but whose state is split (ZeRO-1/2) it is this rank's slice *of the
  payload* (a view);
  A frozen chunk with a ``frozen_format`` keeps its shard quantised (:mod:`elixir.chunk.quant`):
  one ``uint8`` buffer of codes and scales, dequantised into the payload by each gather
  (:meth:`ChunkStorage.decode_gather`) and, for a reader or writer of values
  (:meth:`ChunkStorage.shard_access`: loads, state dicts, checkpoints), into a transient
  compute-dtype copy, quantised again after a write;
- ``master``: the fp32 slice the optimizer updates: the very tensor ``shard`` is when the compute
  dtype is fp32 and both live in the same place (:func:`master_is_shard`), else a copy on the
  device, in host memory, or in an offload file (staged by :mod:`elixir.offload`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from elixir import device as dev
from elixir.chunk.accounting import MemoryLedger
from elixir.chunk.quant import FrozenCodec
from elixir.chunk.spec import ChunkSpec
from elixir.plan import Placement
from elixir.plan.footprint import element_bytes, master_shares_shard


def location(placement: Placement) -> str:
    """The ledger location of a placement: ``"device"``, or ``"host"`` (a disk tier is staged in host memory)."""
    return "device" if placement is Placement.DEVICE else "host"


def nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of ``numel`` elements of ``dtype`` (the footprint rule's element sizes)."""
    return numel * element_bytes(dtype)


def master_is_shard(spec: ChunkSpec) -> bool:
    """The master is the shard tensor itself (:func:`elixir.plan.footprint.master_shares_shard`,
    the rule the cost model prices by): the compute dtype is the master's (fp32, or bf16 with a
    bf16 master), both in the same place, and not on disk."""
    return master_shares_shard(spec.dtype, spec.master_dtype, spec.shard_placement, spec.optim_placement)


def kahan_split(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16-kahan master of ``values`` (fp32 or fp64): the values rounded to nearest bf16, and
    the compensation, what is left rounded to bf16 (``elixir.optim.lowbit``'s invariant)."""
    wide = torch.float64 if values.dtype == torch.float64 else torch.float32
    rounded = values.to(torch.bfloat16)
    return rounded, (values.to(wide) - rounded.to(wide)).to(torch.bfloat16)


def _copy_of(src: torch.Tensor, dtype: torch.dtype, placement: Placement, spec: ChunkSpec) -> torch.Tensor:
    """A copy of ``src`` in ``dtype``: in (pinned, as the spec says) host memory or on the spec's device."""
    if placement is not Placement.DEVICE:
        out = dev.empty_host(src.numel(), dtype, pin=spec.pin_memory)
        out.copy_(src)
        return out
    return src.to(device=spec.device, dtype=dtype, copy=True)


class ChunkStorage:
    """The payload, shard and master of one chunk on this rank (see the module docstring)."""

    def __init__(self, spec: ChunkSpec, ledger: MemoryLedger) -> None:
        self.spec = spec
        self.ledger = ledger
        self.payload_bytes = nbytes(spec.capacity, spec.dtype)
        self.payload = torch.empty(0, dtype=spec.dtype, device=spec.device)
        self.shard: Optional[torch.Tensor] = None
        self.master: Optional[torch.Tensor] = None
        self.comp: Optional[torch.Tensor] = None  # a bf16-kahan master's compensation (init_from)
        self.shard_store: Any = None  # the DiskStore holding the shard (spec.shard_on_disk), set by its owner
        fmt = spec.frozen_format
        self.codec = FrozenCodec(fmt, spec.shard_numel, spec.dtype) if fmt is not None else None
        # bytes of this rank's shard: compute-dtype values, or the quantised buffer
        self.shard_bytes = self.codec.nbytes if self.codec is not None else nbytes(spec.shard_numel, spec.dtype)

    def init_from(self, flat: torch.Tensor, compensated: bool = False) -> torch.Tensor:
        """Build payload, shard and master from the full flat values ``flat`` (``capacity``
        elements, identical on every rank); the payload is left allocated and booked.
        ``compensated`` (a bf16-kahan master): the master is the values rounded to nearest and
        :attr:`comp` what is left, rounded to bf16 (the optimizer state's ``master_comp`` from its
        first step on); an fp32 payload and shard hold the two added, as a step writes them."""
        spec = self.spec
        if flat.numel() != spec.capacity:
            raise ValueError(f"chunk {spec.index}: expected {spec.capacity} elements, got {flat.numel()}")
        split = kahan_split(flat) if compensated and not spec.frozen else None
        if split is not None and spec.dtype == torch.float32:
            flat = split[0].float() + split[1].float()
        lo, n = spec.shard_offset, spec.shard_numel
        self.ledger.alloc("gathered" if spec.sharded else spec.shard_category, "device", self.payload_bytes,
                          f"chunk {spec.index}")
        self.payload = flat.to(device=spec.device, dtype=spec.dtype, copy=True)
        src = flat[lo : lo + n]
        dtype = spec.dtype
        if self.codec is not None:  # quantised where the values are, then moved as bytes
            src, dtype = self.codec.encode(self.payload[lo : lo + n]), torch.uint8
        if spec.shard_on_disk:  # plain (resizable) host memory: the store frees it once written
            self.shard = src.to(device="cpu", dtype=dtype, copy=True)
            self.ledger.alloc(spec.shard_category, "host", self.shard_bytes)
        elif spec.sharded:
            self.shard = _copy_of(src, dtype, spec.shard_placement, spec)
            self.ledger.alloc(spec.shard_category, location(spec.shard_placement), self.shard_bytes)
        else:  # parameters whole: the payload is always resident, this rank's shard a view of it
            self.shard = self.payload[lo : lo + n] if spec.state_sharded else self.payload
        if spec.frozen:
            return self.payload  # weights only: no master
        if master_is_shard(spec):
            self.master = self.shard
        else:
            if spec.master_on_disk:  # plain (resizable) host memory: elixir.offload frees it
                self.master = src.to(device="cpu", dtype=spec.master_dtype, copy=True)
            else:
                self.master = _copy_of(src, spec.master_dtype, spec.optim_placement, spec)
            self.ledger.alloc("master", location(spec.optim_placement), nbytes(n, spec.master_dtype))
        if split is not None:
            self._keep_compensation(*split)
        return self.payload

    def _keep_compensation(self, rounded: torch.Tensor, comp: torch.Tensor) -> None:
        """The master is ``rounded`` (the values rounded once: their sum with ``comp`` rounds back
        to it but for ties) and :attr:`comp` this rank's part of ``comp``, placed as the master
        (plain host memory for a disk master: the offload store takes both over). Not booked in
        the ledger: the optimizer reports it as its state (``master_comp``)."""
        spec = self.spec
        lo, n = spec.shard_offset, spec.shard_numel
        if self.master is not self.shard:
            self.master.copy_(rounded[lo : lo + n])
        if spec.master_on_disk:
            self.comp = comp[lo : lo + n].to(device="cpu", copy=True)
        else:
            self.comp = _copy_of(comp[lo : lo + n], torch.bfloat16, spec.optim_placement, spec)

    # ---- the payload ----------------------------------------------------------------------

    def allocate_payload(self, why: str) -> None:
        """Book and allocate the gathered payload (before a gather)."""
        self.ledger.alloc("gathered", "device", self.payload_bytes, why)
        self.payload.untyped_storage().resize_(self.payload_bytes)

    def free_payload(self) -> None:
        """Free the gathered payload's storage (views of it keep their shape, with no bytes)."""
        self.payload.untyped_storage().resize_(0)
        self.ledger.free("gathered", "device", self.payload_bytes)

    # ---- the shard --------------------------------------------------------------------------

    def gather_source(self, staging: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What this rank contributes to a gather: the shard, brought to the device first when it
        lives in host memory and the device is an accelerator (non-blocking from pinned memory),
        into ``staging`` when given (allocated by the caller on the compute stream, so every chunk
        buffer comes from one stream's pool; marked in use on the current, gather, stream).
        On a CPU host and device are one memory: the shard itself (a copy there was a transient
        chunk's worth of RSS that no prediction counted)."""
        src = self.shard
        if self.spec.shard_on_host and dev.is_accelerator(self.spec.device):
            non_blocking = dev.non_blocking_ok(src, self.spec.device)
            if staging is None:
                return src.to(self.spec.device, non_blocking=non_blocking, copy=True)
            staging.copy_(src, non_blocking=non_blocking)
            dev.record_stream(staging, dev.current_stream(self.spec.device))
            return staging
        return src

    def stage_shard(self, into_payload: bool = False) -> None:
        """Read a disk shard into host memory (raises ``OSError`` if the read failed);
        ``into_payload``: its values straight into the payload instead (nothing staged; see
        :meth:`can_stage_into_payload`)."""
        if into_payload:
            self.shard_store.stage_into(self.spec.index, self.payload)
        else:
            self.shard_store.stage(self.spec.index)

    def shard_is_derived(self) -> bool:
        """Whether the compute shard is derived from the master at each read (``KK``:
        ``offload/derived.py``), so a step need not stage or refresh it."""
        return bool(getattr(self.shard_store, "in_place", False))

    def refreshing_shard(self) -> contextlib.AbstractContextManager:
        """The block a step refreshes the compute shard in: the shard staged for it and written
        back after (:meth:`shard_access`), or nothing for a derived shard (its next read derives
        it from the stepped master)."""
        return contextlib.nullcontext() if self.shard_is_derived() else self.shard_access(write=True)

    def can_stage_into_payload(self) -> bool:
        """Whether the shard's store can fill the payload directly: a shard derived from its master
        (``offload/derived.py``) covering the whole payload (world size 1), unquantised."""
        return self.codec is None and self.shard_is_derived() and self.spec.shard_numel == self.spec.capacity

    def drop_staged_shard(self, write: bool = False) -> None:
        """Drop a staged disk shard (writing it back first with ``write``)."""
        self.shard_store.offload(self.spec.index, write=write)

    def discard_staged_shard(self) -> None:
        """Drop a staged disk shard whose disk copy is current (after its gather)."""
        self.shard_store.discard(self.spec.index)

    @contextlib.contextmanager
    def shard_access(self, write: bool) -> Iterator[torch.Tensor]:
        """The compute shard's values, resident for the block: a disk shard is read in and, with
        ``write``, written back after (else dropped); other shards are resident already. A
        quantised shard yields its values dequantised (a transient compute-dtype copy), quantised
        again after the block with ``write``."""
        if self.codec is None:
            with self.stored_shard(write) as shard:
                yield shard
            return
        with self.stored_shard(write) as packed:
            values = self.codec.decode(packed)
            yield values
            if write:
                self.codec.encode(values, out=packed)

    def decode_gather(self, comm: Any) -> None:
        """Gather a quantised shard into the payload: the shard's bytes (brought to the device
        when they live in host memory), all-gathered as bytes at world size > 1 (a quarter of
        bf16's traffic for NF4), dequantised rank by rank into the payload."""
        src, spec, codec = self.shard, self.spec, self.codec
        if spec.shard_on_host and dev.is_accelerator(spec.device):
            src = src.to(spec.device, non_blocking=dev.non_blocking_ok(src, spec.device), copy=True)
        if spec.shard_world == 1:
            codec.decode(src, out=self.payload)
            return
        every = torch.empty(spec.shard_world * codec.nbytes, dtype=torch.uint8, device=spec.device)
        comm.all_gather(every, src)
        n, b = spec.shard_numel, codec.nbytes
        for r in range(spec.shard_world):
            codec.decode(every[r * b : (r + 1) * b], out=self.payload[r * n : (r + 1) * n])

    @contextlib.contextmanager
    def stored_shard(self, write: bool) -> Iterator[torch.Tensor]:
        """The shard as stored (a quantised one's bytes), resident for the block (see
        :meth:`shard_access`)."""
        if not self.spec.shard_on_disk:
            yield self.shard
            return
        self.stage_shard()
        try:
            yield self.shard
        finally:
            self.drop_staged_shard(write=write)

    def refresh_from_master(self, streams: dev.SideStreams) -> None:
        """After an optimizer step: copy the fp32 master into the compute shard when they differ
        (on the copy stream). A disk master is not resident here: the disk path refreshed the
        shard while it was staged."""
        if self.master is not None and self.master is not self.shard and not self.spec.master_on_disk:
            with torch.no_grad(), streams.issue(streams.copy):
                self.shard.copy_(self.master, non_blocking=dev.non_blocking_ok(self.master, self.shard.device))
