"""Building an ElixirModule's chunks from its plan (FSDP2's ``_fully_shard`` init role).

:class:`ChunkBuilder` turns the plan's chunks into :class:`~elixir.chunk.Chunk` objects: the spec of
each (the plan's placements and sharding on this rank), its flat values staged once and broadcast
from rank 0 where asked, the model's parameters turned into views of the payload, the offload
stores registered, and a meta-device model's values computed chunk by chunk. What it builds is a
:class:`BuiltChunks`; the facade keeps it. The builder reads nothing of the facade.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from elixir import device as dev
from elixir import distributed as edist
from elixir.chunk import Chunk, ChunkKind, ChunkSpec, GradBufferPool, MemoryLedger, Schedule
from elixir.offload.derived import DerivedShards
from elixir.offload.for_plan import StoreSite, shard_store_for_plan, store_for_plan
from elixir.offload.store import DiskStore
from elixir.plan import Placement
from elixir.plan.footprint import disk_bytes_per_element, element_bytes, resident_sharding
from elixir.plan.state_format import master_torch_dtype
from elixir.progress import Progress
from elixir.wrapper.materialize import Materializer, assign
from elixir.wrapper.mesh import RunMesh
from elixir.wrapper.param_map import ParamMap, ParamSlot
from elixir.wrapper.policies import OffloadPolicy


@dataclass
class BuiltChunks:
    """What the builder made: the chunks, the parameter maps and the offload stores."""

    chunks: list[Chunk] = field(default_factory=list)  # trainable chunks, plan order (index = position)
    frozen_chunks: list[Chunk] = field(default_factory=list)  # frozen chunks (index = len(chunks) + position)
    param_map: ParamMap = field(default_factory=lambda: ParamMap(0))  # trainable parameters onto chunks
    frozen_map: ParamMap = field(default_factory=lambda: ParamMap(0))  # frozen ones (global indices)
    disk_store: Optional[DiskStore] = None
    shard_store: Optional[DiskStore] = None  # frozen compute shards placed on disk
    derived_shards: Optional[DerivedShards] = None  # trainable ones: their masters cast down

    def is_chunked(self, p: nn.Parameter) -> bool:
        return p in self.param_map or p in self.frozen_map


@dataclass(frozen=True)
class Runtime:
    """The runtime parts every chunk shares, and the dtypes and device it computes in."""

    mesh: RunMesh
    ledger: MemoryLedger
    streams: dev.SideStreams
    grad_buffers: GradBufferPool
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype
    device: torch.device
    state_formats: tuple[str, str] = ("fp32", "fp32")  # (master, moments), issue 33
    frozen_format: Optional[str] = None  # frozen chunks' shards quantised ("nf4", "int8"), issue 33


def own_version_param(view: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A parameter over ``view`` with a version counter of its own, as ``p.data = view`` gives an
    eagerly built parameter: ``nn.Parameter(view)`` would share the payload's counter, so gathering
    another parameter of the chunk in place would invalidate this one's saved-for-backward uses."""
    param = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=requires_grad)
    param.data = view
    return param


def broadcast_non_chunked(module: nn.Module, plan: Any, named: dict, group: Any) -> None:
    """Rank 0's values of the parameters no chunk holds, and of every buffer, to the other ranks."""
    chunked = {n for c in plan.all_chunks for n in c.params}
    with torch.no_grad():
        for n, p in named.items():
            if n not in chunked and not p.is_meta:
                edist.broadcast(p.data, 0, group)
        for b in module.buffers():
            if not b.is_meta:
                edist.broadcast(b.data, 0, group)


def move_rest_to_device(module: nn.Module, device: torch.device, is_chunked: Callable[[nn.Parameter], bool]) -> None:
    """Frozen parameters and buffers go where the chunks are (a model built on the host runs on
    the accelerator); a no-op when they are already there."""
    with torch.no_grad():
        for p in module.parameters():
            if not is_chunked(p) and p.device != device and p.device.type != "meta":
                p.data = p.data.to(device)
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and b.device != device and b.device.type != "meta":
                    m._buffers[name] = b.to(device)


def build_schedule(plan: Any, slots: list[ParamSlot], all_chunks: list[Chunk]) -> Optional[Schedule]:
    """The prefetch schedule of the plan's traced order (None for a plan without one)."""
    order = plan.param_order
    if not order:
        return None
    chunk_of = {s.name: s.chunk for s in slots}
    steps = []
    for names in order:
        steps.append(frozenset(chunk_of[n] for n in names if n in chunk_of and all_chunks[chunk_of[n]].spec.sharded))
    return Schedule(steps, lookahead=max(1, plan.prefetch_depth))


class ChunkBuilder:
    """Builds the chunks of ``plan`` over ``module``'s parameters (see the module docstring)."""

    def __init__(self, module: nn.Module, plan: Any, rt: Runtime, offload: OffloadPolicy,
                 materializer: Optional[Materializer]) -> None:
        self.module, self.plan, self.rt, self.offload, self.mat = module, plan, rt, offload, materializer
        n_all = len(plan.chunks) + len(plan.frozen_chunks)
        self.out = BuiltChunks(param_map=ParamMap(len(plan.chunks)), frozen_map=ParamMap(n_all))
        self.on_meta: list[tuple[nn.Parameter, nn.Parameter]] = []  # (meta param, its chunk view)

    def build(self, named: dict, sync: bool) -> BuiltChunks:
        plan, rt, out, mat = self.plan, self.rt, self.out, self.mat
        self._open_stores()
        # one staging buffer for every chunk's flat values: allocated once, so the shards kept
        # meanwhile are not interleaved with a freed temporary per chunk
        staging = torch.empty(max((cp.chunk_size for cp in plan.chunks), default=0), dtype=torch.float32, device=rt.device)
        # frozen chunks are staged in the compute dtype: no fp32 copy of frozen weights anywhere
        frozen_staging = torch.empty(max((cp.chunk_size for cp in plan.frozen_chunks), default=0), dtype=rt.dtype, device=rt.device)
        todo = [(ci, cp, ChunkKind.TRAINABLE) for ci, cp in enumerate(plan.chunks)]
        todo += [(len(plan.chunks) + j, cp, ChunkKind.FROZEN) for j, cp in enumerate(plan.frozen_chunks)]
        progress = Progress("building chunks", len(todo), enabled=edist.get_rank() == 0)
        for ci, cp, kind in todo:
            frozen = kind is ChunkKind.FROZEN
            chunk = self._build_one(ci, cp, kind, frozen_staging if frozen else staging, named, sync)
            (out.frozen_chunks if frozen else out.chunks).append(chunk)
            if mat is not None:  # construction stays within the shards plus the staging area
                dev.trim_host_memory()
            progress.advance()
        del staging, frozen_staging
        if mat is not None:
            mat.finish(rt.device, skip={id(p) for p, _ in self.on_meta})
            for p, view in self.on_meta:
                assign(p, view)
        move_rest_to_device(self.module, rt.device, out.is_chunked)
        if rt.dtype != torch.float32:
            with torch.no_grad():
                for p in self.module.parameters():
                    if not out.is_chunked(p) and p.is_floating_point():
                        p.data = p.data.to(rt.dtype)
        # The model's own parameter tensors were freed as their values moved into chunks; under
        # keep_host_memory (no trimming) those below malloc's mmap threshold would stay resident
        # as free heap for the whole run (GPT-2 medium built eagerly: about 1.4 GB). Hand them back.
        dev.trim_host_memory()
        return out

    def _open_stores(self) -> None:
        plan, rt, out = self.plan, self.rt, self.out
        m = rt.mesh
        site = StoreSite(rt.ledger, m.shard_rank, m.shard_world, m.shard_group, self.offload.offload_dir, self.offload.direct)
        out.disk_store = store_for_plan(plan, site, disk_bytes_per_element(formats=rt.state_formats))
        out.shard_store = shard_store_for_plan(plan, site, element_bytes(rt.dtype), rt.frozen_format)
        if out.disk_store is not None and any(cp.sharded and cp.shard_placement is Placement.DISK for cp in plan.chunks):
            out.derived_shards = DerivedShards(out.disk_store, rt.ledger)

    def _spec(self, ci: int, cp: Any, kind: ChunkKind) -> ChunkSpec:
        rt = self.rt
        # At world size 1 a device shard is the whole chunk: kept resident like a replicated chunk
        # (the footprint rule, which the cost model prices by)
        # A quantised frozen chunk is always sharded: dequantised into an rCache block per use
        quantised = kind is ChunkKind.FROZEN and rt.frozen_format is not None
        sharding = resident_sharding(cp.sharding, cp.shard_placement, rt.mesh.shard_world, quantised)
        return ChunkSpec(
            kind=kind,
            index=ci,
            capacity=cp.chunk_size,
            sharding=sharding,
            layout=rt.mesh.layout,
            rank=rt.mesh.shard_rank,
            dtype=rt.dtype,
            reduce_dtype=rt.reduce_dtype,
            grad_dtype=rt.grad_dtype,
            device=rt.device,
            shard_placement=cp.shard_placement,  # read as the device where parameters are whole
            optim_placement=cp.optim_placement,  # and where a frozen chunk has no master
            pin_memory=bool(self.plan.info.get("pin_memory", True)),
            master_dtype=master_torch_dtype(rt.state_formats[0]),
            frozen_format=rt.frozen_format if quantised else None,
            filled=cp.used,
        )

    def _build_one(self, ci: int, cp: Any, kind: ChunkKind, staging: torch.Tensor, named: dict, sync: bool) -> Chunk:
        """One chunk: its values staged (and broadcast), its parameters made views of its payload."""
        rt, out, mat = self.rt, self.out, self.mat
        spec = self._spec(ci, cp, kind)
        group, world = rt.mesh.shard_group, rt.mesh.shard_world
        chunk = Chunk(spec, rt.ledger, group, streams=rt.streams, buffers=rt.grad_buffers)
        flat = staging[: cp.chunk_size].zero_()
        offset = 0
        members = []
        pmap = out.frozen_map if kind is ChunkKind.FROZEN else out.param_map
        for name, shape in zip(cp.params, cp.shapes):
            p = named[name]
            n = p.numel()
            src = mat.take(p) if p.is_meta else p.detach()
            flat[offset : offset + n].copy_(src.reshape(-1))
            del src
            slot = pmap.add(p, name, ci, offset, shape)
            members.append((p, slot))
            offset += n
        if sync and world > 1 and mat is None:  # meta values are computed alike on every rank
            edist.broadcast(flat, 0, group)
        payload = chunk.init_from(flat, compensated=rt.state_formats[0] == "bf16-kahan")
        del flat
        for p, slot in members:
            view = payload[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if p.is_meta:  # stays on meta (inert to later initialisers) until every chunk is built
                self.on_meta.append((p, own_version_param(view, p.requires_grad)))
            else:
                p.data = view
        if spec.sharding.params_sharded:
            chunk.release()
        self._register_offload(chunk)
        return chunk

    def _register_offload(self, chunk: Chunk) -> None:
        out, spec, ci = self.out, chunk.spec, chunk.spec.index
        if spec.master_on_disk:
            out.disk_store.register(chunk)  # transfers the shard's filled part only (spec.shard_filled)
        if spec.shard_on_disk and spec.master_on_disk:  # KK: the shard is the master cast down
            out.derived_shards.register(ci, chunk.shard, ledger_kind=spec.shard_category)
            chunk.shard_store = out.derived_shards
        elif spec.shard_on_disk:
            filled = None if spec.frozen_format else spec.shard_filled  # a quantised shard is packed bytes
            out.shard_store.register_tensor(ci, "shard", chunk.shard, ledger_kind=spec.shard_category, filled=filled)
            chunk.shard_store = out.shard_store
