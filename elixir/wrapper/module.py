"""ElixirModule: executes a plan on a model (chunked ZeRO-3).

The trainable parameters become views into their chunk's payload. A "step" is one call of a module
that directly owns trainable parameters: in forward its pre-hook gathers and pins that module's
sharded chunks (also during recomputation under checkpointing) and its post-hook unpins them; in
backward a hook on the call's outputs gathers and pins them again before the module's own backward
runs. Pinned chunks are never evicted; unpinned ones stay in the rCache until a block is needed.

Frozen parameters the plan packs into frozen chunks (``plan.frozen_chunks``) become views into those
chunks' payloads the same way: gathered (and pinned) by the same hooks, released by the same rCache,
never reduced, with no master and no optimizer state. Their chunks are ``self.frozen_chunks`` (index
``len(self.chunks) + j``, so the rCache and the schedule key every chunk apart) and their slots are in
``self.frozen_map``. Frozen parameters outside frozen chunks are left as they are.

Gradients: a post-accumulate-grad hook per parameter adds ``p.grad`` into the chunk's gradient
buffer and frees ``p.grad``. When every parameter of a chunk expected to get a gradient has one, the
chunk is reduced (reduce-scatter for sharded chunks, all-reduce for replicated ones, mean over
ranks). A callback queued on the autograd engine finalises the rest at the end of backward, after
agreeing across ranks (one small all-reduce) on which parameters got a gradient on any rank.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Container, Iterator, Optional

import torch
import torch.nn as nn

from elixir import device as dev
from elixir import distributed as edist
from elixir.chunk import (
    BlockCache,
    Chunk,
    ChunkKind,
    ChunkSpec,
    GradBufferPool,
    GradState,
    MemoryLedger,
    Schedule,
    learned_schedule,
)
from elixir.lowp_gemm import widened_gemms
from elixir.offload.derived import DerivedShards
from elixir.offload.for_plan import StoreSite, shard_store_for_plan, store_for_plan
from elixir.offload.store import DiskStore
from elixir.plan import Placement, Sharding, dtype_from_name
from elixir.tracer.hooks import (
    StepKind,
    borrowed_children,
    install_step_hooks,
    map_tensors,
    step_params,
    tensors_in,
)
from elixir.wrapper.backward_tracker import BackwardTracker, TrainingState
from elixir.wrapper.dtensor_params import localize
from elixir.wrapper.fused_kernels import apply_fused_kernels
from elixir.wrapper.generation import generate as _generate
from elixir.wrapper.hf_guard import guard_save_pretrained
from elixir.wrapper.materialize import Materializer, agreed_seed, assign, has_meta_tensors
from elixir.wrapper.mesh import require_runnable, resolve_mesh, tp_mesh
from elixir.wrapper.param_map import ParamMap, ParamSlot
from elixir.wrapper.plan_check import PlanLike, agree_on_plan, as_plan, validate_plan
from elixir.wrapper.policies import MixedPrecisionPolicy, OffloadPolicy, module_policies
from elixir.wrapper.released import AccessGathers, install_release_guards
from elixir.wrapper.state_dict import full_state_dict, load_full_state_dict
from elixir.wrapper.wrap_guard import check_trainable_unchanged, mark_owned, refuse_rewrap, trainable_flags

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Reductions left running on the backend's thread while backward goes on (CPU, world size > 1):
# chunk i's collective runs while chunk i+1's gradients arrive, and completes (then the fused step
# steps chunk i) when chunk i+1's reduction is issued. Each one in flight holds its gradient
# buffer until then (the search counts one: cost_model.fixed_device_bytes).
REDUCTIONS_IN_FLIGHT = 1


@dataclass(frozen=True)
class _ModInfo:
    """Precomputed per hooked module: its sharded chunks and its direct trainable params."""

    chunks: tuple  # sharded Chunk objects, plan order
    chunk_set: frozenset
    params: tuple  # parameter indices
    ancestors: frozenset  # ids of the hooked modules that contain this one
    key: int  # id of the module


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors requiring grad inside nested outputs (tensors, tuples, lists, dicts, ModelOutput)."""
    return [t for t in tensors_in(obj) if t.requires_grad]


def _map_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating tensors in nested inputs/outputs to ``dtype`` (other values unchanged)."""
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


def _check_input_devices(args, kwargs, device: torch.device) -> None:
    """Raise for an input tensor on the meta device, or on an accelerator other than the module's
    (host inputs to an accelerator module are left to the model, as index tensors may stay there)."""
    values = list(args) + list(kwargs.values())
    for v in list(values):
        if isinstance(v, dict):
            values.extend(v.values())
    for v in values:
        if not isinstance(v, torch.Tensor):
            continue
        elsewhere = v.device.type != device.type or (device.index is not None and v.device.index != device.index)
        if v.device.type == "meta" or (v.device.type != "cpu" and elsewhere):
            raise ValueError(
                f"elixir: an input tensor {tuple(v.shape)} is on {v.device}, but the model computes on {device}: "
                f"move the batch there first (tensor.to({str(device)!r}))"
                + ("; a meta tensor holds no data (build inputs with real values)" if v.device.type == "meta" else "")
            )


class ElixirModule(nn.Module):
    """Wrap ``module`` so it runs sharded across ``process_group`` following ``search_result``.

    Args:
        module: the model (on CPU or the compute device; identical on every rank, or synced from
            rank 0 with ``sync_module_states``), or a model built on ``torch.device("meta")``:
            then each chunk is materialised in turn with the model's own initialisers and each
            rank keeps only its shards (:mod:`elixir.wrapper.materialize`; load weights after
            with :func:`elixir.checkpoint.load_pretrained`).
        search_result: the plan (from ``minimum_waste_search`` or ``optimal_search``), or the path of
            a saved one (``elixir plan --out``, ``SearchResult.save``). Every rank must hold the same
            plan: construction checks that with one small all-gather and names the ranks that differ.
        process_group: the data-parallel group every chunk is sharded over (default: the world).
        mesh: instead of ``process_group``, a ``DeviceMesh`` whose dimensions are named after
            elixir's axes (:class:`~elixir.plan.mesh.MeshLayout`): chunks shard over its
            ``dp_shard`` dimension. The plan must have been made for the same layout (one
            all-gather checks it names both when not). A ``tp`` dimension runs a model
            parallelised over ``mesh["tp"]`` (:func:`elixir.parallel.tensor_parallel`): chunks
            hold each rank's local shards (:mod:`elixir.wrapper.dtensor_params`). Pipeline and
            replica axes are refused with the reason.
        prefetch: follow the plan's traced order (``param_order``) to gather ahead
            (``plan.prefetch_depth`` steps, at least 1) and evict with Belady's rule; a plan
            without an order follows the order the first training iteration took, from the second.
        dtype: compute dtype of the chunks (fp32 masters are kept for bf16/fp16); an alias of
            ``mp_policy``'s ``param_dtype``, as are ``reduce_always_fp32`` (``reduce_dtype=torch.float32``),
            ``output_fp32`` (``output_dtype=torch.float32``) and ``grad_dtype``. On a CPU where torch
            has no native bf16/fp16 matrix kernel, the forward's low-precision products are widened
            to fp32 and rounded once (:mod:`elixir.lowp_gemm`; ``self.widened_products`` counts
            them per forward).
        reduce_always_fp32: reduce gradients in fp32 even when computing in low precision.
        output_fp32: cast floating outputs to fp32.
        use_fused_kernels: switch Hugging Face models running eager attention to torch's fused
            SDPA kernel, where that is exact (:func:`~elixir.wrapper.fused_kernels.apply_fused_kernels`;
            refuses with ``ValueError`` where it is not, warns when there is nothing to switch).
            ``self.fused_kernels`` lists what changed. Call ``apply_fused_kernels`` yourself before
            tracing for the search to see the fused step.
        memory_limit: optional device-memory budget in bytes for the runtime's own tensors; an
            allocation beyond it raises :class:`~elixir.chunk.ElixirMemoryError`.
        strict_cache: raise instead of temporarily exceeding the rCache when every block is pinned.
        sync_module_states: broadcast rank 0's initial values of parameters and buffers.
        offload_dir: directory for the fp32 masters and optimizer state of chunks the plan puts
            on disk (``optim_placement == DISK``); default: a per-run directory under
            ``tempfile.gettempdir()``. The file is unlinked as soon as it is open (nothing is left
            behind, even by a killed process). A directory that does not exist is created and
            removed again (if empty) when the file is closed; an existing one is left as it was.
            Unused (never created) when no chunk is on disk. A trainable chunk with its compute
            shard on disk too (``KK``) keeps no shard there: the shard is its master cast down,
            read from the master at each gather (``self.derived_shards``,
            :mod:`elixir.offload.derived`). Frozen shards the plan puts on disk go to a second file
            there, ``self.shard_store``, read only for a gather or a write. See
            :mod:`elixir.offload`; ``self.disk_store`` is the :class:`~elixir.offload.DiskStore`.
        offload_direct: also open the offload file with ``O_DIRECT`` (bypassing the page cache)
            for transfers whose buffers are page-aligned (torch aligns large host tensors when
            ``THP_MEM_ALLOC_ENABLE=1``); everything else stays buffered.
        grad_dtype: dtype of the reduced shard gradients kept for the optimizer (``torch.float32``,
            or ``torch.bfloat16``/``torch.float16`` to halve their bytes; CPUAdam/HybridAdam read
            them as they are, other optimizers get an fp32 copy of one chunk at a time). Default:
            the plan's ``grad_dtype`` (fp32 when it names none).
        init_seed: seed of the initialisers of a meta-device model (default: drawn from the
            global torch RNG on rank 0). The values depend only on the model and this seed, not on
            the plan or the world size; :func:`elixir.wrapper.materialize.materialize` gives the
            same values to a plain-torch copy.
        init_frozen: run the initialisers of a meta-device model's frozen parameters
            (``requires_grad=False``). ``False`` when a checkpoint will be loaded over them
            (:func:`elixir.checkpoint.load_pretrained` of a LoRA model's base): they start at zero
            instead, and the initialisation of a backbone that is overwritten anyway is skipped.
            Trainable parameters and buffers are initialised either way, with the same values
            (each unit has its own seed). A frozen weight the checkpoint lacks then stays zero:
            check ``load_pretrained``'s ``missing_keys``.
        mp_policy: the dtypes as one :class:`~elixir.wrapper.policies.MixedPrecisionPolicy`
            (instead of ``dtype``, ``reduce_always_fp32``, ``output_fp32``, ``grad_dtype``; giving
            both raises).
        offload_policy: ``offload_dir`` and ``offload_direct`` as one
            :class:`~elixir.wrapper.policies.OffloadPolicy` (giving both raises).
    """

    def __init__(
        self,
        module: nn.Module,
        search_result: PlanLike,
        process_group=None,
        prefetch: bool = False,
        dtype: torch.dtype = torch.float,
        reduce_always_fp32: bool = False,
        output_fp32: bool = False,
        use_fused_kernels: bool = False,
        memory_limit: Optional[int] = None,
        strict_cache: bool = False,
        sync_module_states: bool = True,
        offload_dir: Optional[str] = None,
        offload_direct: bool = False,
        grad_dtype: Optional[torch.dtype] = None,
        init_seed: Optional[int] = None,
        *,
        mp_policy: Optional[MixedPrecisionPolicy] = None,
        offload_policy: Optional[OffloadPolicy] = None,
        init_frozen: bool = True,
        mesh=None,
    ) -> None:
        super().__init__()
        refuse_rewrap(module)  # a second wrap would build chunks from the first one's views
        mp_policy, offload_policy = module_policies(
            mp_policy, offload_policy, dtype=dtype, reduce_always_fp32=reduce_always_fp32, output_fp32=output_fp32,
            grad_dtype=grad_dtype, offload_dir=offload_dir, offload_direct=offload_direct,
        )
        self.mp_policy, self.offload_policy = mp_policy, offload_policy
        search_result = as_plan(search_result)
        self.grad_dtype = mp_policy.grad_dtype or dtype_from_name(search_result.grad_dtype)
        self.module = module
        self.plan = search_result
        edist.bind_device()  # before any collective: NCCL and object collectives use the current device
        self.mesh = resolve_mesh(process_group, mesh)
        require_runnable(self.mesh.layout)  # the same on every rank: raised before any collective
        # DTensor (tensor-parallel) parameters become plain ones over their local shards
        self.tensor_parallel = localize(module, tp_mesh(self.mesh), self.mesh.layout.tp)
        self.group = self.mesh.shard_group
        self.rank = self.mesh.shard_rank
        self.world_size = self.mesh.shard_world
        agree_on_plan(search_result, self.group)  # first: a rank whose plan differs must not hang the others
        validate_plan(module, search_result, self.mesh.layout)
        self.dtype = mp_policy.param_dtype
        self.reduce_dtype = mp_policy.reduce
        self.output_fp32 = mp_policy.output_dtype == torch.float32
        self.use_fused_kernels = use_fused_kernels
        self.fused_kernels = apply_fused_kernels(module) if use_fused_kernels else []
        self.prefetch = prefetch
        self.device = dev.default_device()
        self.widened_products = 0  # low-precision products the last forward widened (elixir.lowp_gemm)
        # Streaming from disk: optimizer state, or frozen shards read at each gather (a LoRA plan
        # whose base is on disk has no trainable disk chunk, and was kept out of this until
        # issue 19 found its heap slack 2x the activations at hidden 6144: peak RSS above the
        # prediction, growing step after step).
        self.streams_from_disk = (any(cp.optim_placement is Placement.DISK for cp in search_result.chunks)
                                  or any(cp.shard_placement is Placement.DISK for cp in search_result.frozen_chunks))
        if not self.streams_from_disk:
            # reuse freed host memory: no page faults per gathered chunk and gradient buffer. Not
            # with disk chunks: their staging buffers churn through malloc's heap, and the holes
            # they leave made the peak RSS exceed every count of the bytes in use (issue 21).
            dev.keep_host_memory()
        else:  # give freed blocks back at once (the search counts live bytes), and trim after backward
            dev.return_host_memory()
        self.ledger = MemoryLedger(memory_limit)
        self.streams = dev.SideStreams(self.device)  # gather / reduce / copy streams of every chunk
        # recycled gradient buffers on a CPU device (not for plans that stream from disk, which
        # give memory back at once): elixir/chunk/buffers.py
        self.grad_buffers = GradBufferPool(enabled=self.device.type == "cpu" and not self.streams_from_disk)
        # sharded chunks gathered into host memory (a CPU device): their payloads churn through
        # malloc's heap every step, so backward's end trims it (see _finalize_backward)
        self._gathers_on_host = self.device.type == "cpu" and self.world_size > 1 and any(
            cp.sharded for cp in list(search_result.chunks) + list(search_result.frozen_chunks))
        self.cache = BlockCache(search_result.cache_blocks, strict=strict_cache)

        named = dict(module.named_parameters())
        self.materializer: Optional[Materializer] = None
        if has_meta_tensors(module):
            self.materializer = Materializer(module, agreed_seed(init_seed, process_group), init_frozen=init_frozen)
        if sync_module_states and self.world_size > 1:
            self._broadcast_non_chunked(named)
        self.chunks: list[Chunk] = []  # trainable chunks, plan order (index = position)
        self.frozen_chunks: list[Chunk] = []  # frozen chunks (index = len(chunks) + position)
        self.param_map = ParamMap(len(search_result.chunks))  # trainable parameters onto chunks
        n_all = len(search_result.chunks) + len(search_result.frozen_chunks)
        self.frozen_map = ParamMap(n_all)  # frozen parameters onto frozen chunks (global indices)
        self.slots: list[ParamSlot] = self.param_map.slots
        self.params: list[nn.Parameter] = self.param_map.params
        self._slot_of: dict[nn.Parameter, ParamSlot] = self.param_map.by_param
        self.offload_dir = offload_policy.offload_dir
        self.offload_direct = offload_policy.direct
        self.disk_store: Optional[DiskStore] = None
        self.shard_store: Optional[DiskStore] = None  # frozen compute shards placed on disk
        self.derived_shards: Optional[DerivedShards] = None  # trainable ones: their masters cast down
        self._build_chunks(named, sync_module_states)
        guard_save_pretrained(self)  # the HF model's own save_pretrained would read released payloads
        self._chunk_params: list[list[int]] = self.param_map.by_chunk
        self.ledger.reset_peaks()

        # per-backward bookkeeping and the training state
        self.tracker = BackwardTracker([s.chunk for s in self.slots], self._chunk_params)
        # the model's parameters raise instead of reading a released payload, or gather it when
        # read inside this module's step outside their owner's call (elixir/wrapper/released.py)
        self._access = AccessGathers()
        install_release_guards(self)
        mark_owned(self, self.params + self.frozen_map.params)
        self._bwd_stack: list[_ModInfo] = []  # hooked calls whose backward may still be running
        self.has_grad = [False] * len(self.slots)  # per param, agreed across ranks, until zero_grad
        self.iteration = 0  # training forwards so far (the step named if a collective fails)
        self._fwd_stack: list[tuple] = []
        self._no_sync = False
        self._pre_step_hooks: list = []
        self._grad_ready_hooks: list = []
        self._reducing: list[Chunk] = []  # deferred reductions in flight, oldest first
        self._memory_reporters: list = []
        self._backward_end_hooks: list = []
        self._drift_warned = False
        self.observed_order: list[frozenset] = []  # sharded chunk sets of the last iteration
        self.schedule = self._build_schedule() if prefetch else None  # untraced plan: learned in the first backward
        self._hook_handles: list = []
        self._mod_info: dict[nn.Module, _ModInfo] = {}
        self._register_hooks()
        self._wrapped_params = [id(p) for p in self.module.parameters()]  # see _check_unchanged
        self._wrapped_trainable = trainable_flags(self.module)

    # ------------------------------------------------------------------------------------------
    # construction

    _is_elixir_module = True  # refused as the model of another ElixirModule (wrap_guard.refuse_rewrap)

    @property
    def running(self) -> bool:
        """Inside this module's forward or backward (a training step's hooks may gather)."""
        return self.tracker.state is not TrainingState.IDLE

    def _gather_on_access(self, guard, param, func) -> bool:
        """A released parameter was read (see :mod:`elixir.wrapper.released`): gather its chunk
        when this module is running, else return False (the read raises)."""
        return self._access(self, guard, param)

    @property
    def all_chunks(self) -> list[Chunk]:
        """Trainable then frozen chunks: ``all_chunks[i].index == i``."""
        return self.chunks + self.frozen_chunks

    def is_chunked(self, p: nn.Parameter) -> bool:
        """Whether ``p`` lives in a chunk (trainable or frozen)."""
        return p in self._slot_of or p in self.frozen_map

    def _broadcast_non_chunked(self, named: dict) -> None:
        chunked = {n for c in self.plan.all_chunks for n in c.params}
        with torch.no_grad():
            for n, p in named.items():
                if n not in chunked and not p.is_meta:
                    edist.broadcast(p.data, 0, self.group)
            for b in self.module.buffers():
                if not b.is_meta:
                    edist.broadcast(b.data, 0, self.group)

    def _build_chunks(self, named: dict, sync: bool) -> None:
        plan = self.plan
        site = StoreSite(self.ledger, self.rank, self.world_size, self.group, self.offload_dir, self.offload_direct)
        self.disk_store = store_for_plan(plan, site)
        self.shard_store = shard_store_for_plan(plan, site, torch.empty((), dtype=self.dtype).element_size())
        if self.disk_store is not None and any(cp.sharded and cp.shard_placement is Placement.DISK for cp in plan.chunks):
            self.derived_shards = DerivedShards(self.disk_store, self.ledger)
        mat = self.materializer
        on_meta: list[tuple[nn.Parameter, nn.Parameter]] = []  # (meta param, its chunk view)
        # one staging buffer for every chunk's flat values: allocated once, so the shards kept
        # meanwhile are not interleaved with a freed temporary per chunk
        staging = torch.empty(max((cp.chunk_size for cp in plan.chunks), default=0), dtype=torch.float32, device=self.device)
        # frozen chunks are staged in the compute dtype: no fp32 copy of frozen weights anywhere
        frozen_staging = torch.empty(max((cp.chunk_size for cp in plan.frozen_chunks), default=0), dtype=self.dtype, device=self.device)
        todo = [(ci, cp, ChunkKind.TRAINABLE) for ci, cp in enumerate(plan.chunks)]
        todo += [(len(plan.chunks) + j, cp, ChunkKind.FROZEN) for j, cp in enumerate(plan.frozen_chunks)]
        for ci, cp, kind in todo:
            frozen = kind is ChunkKind.FROZEN
            # At world size 1 a device shard is the whole chunk: keep it resident (gathering would
            # only copy it), exactly like a replicated chunk; so is a ZeRO-1/2 chunk's state.
            sharding = cp.sharding
            if self.world_size == 1 and not (sharding is Sharding.SHARDED and cp.shard_placement is not Placement.DEVICE):
                sharding = Sharding.REPLICATED
            sharded = sharding.params_sharded
            spec = ChunkSpec(
                kind=kind,
                index=ci,
                capacity=cp.chunk_size,
                sharding=sharding,
                layout=self.mesh.layout,
                rank=self.rank,
                dtype=self.dtype,
                reduce_dtype=self.reduce_dtype,
                grad_dtype=self.grad_dtype,
                device=self.device,
                shard_placement=cp.shard_placement,  # read as the device where parameters are whole
                optim_placement=cp.optim_placement,  # and where a frozen chunk has no master
                pin_memory=bool(plan.info.get("pin_memory", True)),
            )
            chunk = Chunk(spec, self.ledger, self.group, streams=self.streams, buffers=self.grad_buffers)
            flat = (frozen_staging if frozen else staging)[: cp.chunk_size].zero_()
            offset = 0
            members = []
            pmap = self.frozen_map if frozen else self.param_map
            for name, shape in zip(cp.params, cp.shapes):
                p = named[name]
                n = p.numel()
                src = mat.take(p) if p.is_meta else p.detach()
                flat[offset : offset + n].copy_(src.reshape(-1))
                del src
                slot = pmap.add(p, name, ci, offset, shape)
                members.append((p, slot))
                offset += n
            if sync and self.world_size > 1 and mat is None:  # meta values are computed alike on every rank
                edist.broadcast(flat, 0, self.group)
            payload = chunk.init_from(flat)
            del flat
            for p, slot in members:
                view = payload[slot.offset : slot.offset + slot.numel].view(slot.shape)
                if p.is_meta:  # stays on meta (inert to later initialisers) until every chunk is built
                    on_meta.append((p, _own_version_param(view, p.requires_grad)))
                else:
                    p.data = view
            if sharded:
                chunk.release()
            if spec.master_on_disk:
                self.disk_store.register(chunk)
            if spec.shard_on_disk and spec.master_on_disk:  # KK: the shard is the master cast down
                self.derived_shards.register(ci, chunk.shard, ledger_kind=spec.shard_category)
                chunk.shard_store = self.derived_shards
            elif spec.shard_on_disk:
                self.shard_store.register_tensor(ci, "shard", chunk.shard, ledger_kind=spec.shard_category)
                chunk.shard_store = self.shard_store
            (self.frozen_chunks if frozen else self.chunks).append(chunk)
            if mat is not None:  # construction stays within the shards plus the staging area
                dev.trim_host_memory()
        del staging, frozen_staging
        if mat is not None:
            mat.finish(self.device, skip={id(p) for p, _ in on_meta})
            for p, view in on_meta:
                assign(p, view)
        self._move_rest_to_device()
        if self.dtype != torch.float32:
            with torch.no_grad():
                for p in self.module.parameters():
                    if not self.is_chunked(p) and p.is_floating_point():
                        p.data = p.data.to(self.dtype)
        # The model's own parameter tensors were freed as their values moved into chunks; under
        # keep_host_memory (no trimming) those below malloc's mmap threshold would stay resident
        # as free heap for the whole run (GPT-2 medium built eagerly: about 1.4 GB). Hand them back.
        dev.trim_host_memory()

    def _move_rest_to_device(self) -> None:
        """Frozen parameters and buffers go where the chunks are (a model built on the host runs on
        the accelerator); a no-op when they are already there."""
        with torch.no_grad():
            for p in self.module.parameters():
                if not self.is_chunked(p) and p.device != self.device and p.device.type != "meta":
                    p.data = p.data.to(self.device)
            for m in self.module.modules():
                for name, b in m._buffers.items():
                    if b is not None and b.device != self.device and b.device.type != "meta":
                        m._buffers[name] = b.to(self.device)

    def _build_schedule(self) -> Optional[Schedule]:
        order = self.plan.param_order
        if not order:
            return None
        chunk_of = {s.name: s.chunk for s in self.slots + self.frozen_map.slots}
        every = self.all_chunks
        steps = []
        for names in order:
            steps.append(frozenset(chunk_of[n] for n in names if n in chunk_of and every[chunk_of[n]].spec.sharded))
        return Schedule(steps, lookahead=max(1, self.plan.prefetch_depth))

    def _register_hooks(self) -> None:
        borrowed = borrowed_children(self.module)
        uses = {id(m): [p for p in step_params(m, borrowed) if self.is_chunked(p)] for m in self.module.modules()}
        owners = {m for m in self.module.modules() if uses[id(m)]}
        ancestors: dict[int, set] = {}

        def walk(m: nn.Module, above: frozenset) -> None:
            ancestors.setdefault(id(m), set()).update(above)
            for child in m.children():
                walk(child, above | {id(m)} if m in owners else above)

        walk(self.module, frozenset())
        for m in self.module.modules():
            if m in self._mod_info or m not in owners:
                continue
            idx = tuple(dict.fromkeys(self._slot_of[p].index for p in uses[id(m)] if p in self._slot_of))
            chunk_ids = list(dict.fromkeys((self._slot_of.get(p) or self.frozen_map.slot_of(p)).chunk for p in uses[id(m)]))
            every = self.all_chunks
            sharded = tuple(every[c] for c in sorted(chunk_ids) if every[c].spec.sharded)
            info = _ModInfo(sharded, frozenset(c.index for c in sharded), idx, frozenset(ancestors[id(m)]), id(m))
            self._mod_info[m] = info
        # the tracer's step hooks, so the runtime fires exactly the steps the plan was traced with
        hooks = install_step_hooks(
            self.module, on_forward=self._step_forward, on_backward=self._step_backward, on_forward_end=self._step_forward_end
        )
        self._hook_handles.extend(hooks.handles)
        for p in self.params:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ------------------------------------------------------------------------------------------
    # hooks

    def _use(self, info: _ModInfo) -> None:
        """Gather (or find in the rCache) and pin ``info``'s chunks; prefetch what follows."""
        sched = self.schedule
        self.observed_order.append(info.chunk_set)
        next_use = None
        if sched is not None and sched.active:
            if sched.observe(info.chunk_set):
                next_use = self._next_use
            elif not self._drift_warned:
                self._drift_warned = True
                warnings.warn(
                    "elixir: the execution order drifted from the plan's traced order (different "
                    "control flow?); gathering on demand with LRU eviction for the rest of this "
                    "iteration",
                    stacklevel=4,
                )
        for c in info.chunks:
            self.cache.acquire(c, next_use, info.chunk_set)
            c.pin()
        if next_use is not None:
            upcoming = sched.upcoming()
            protect = set(info.chunk_set) | set(upcoming)
            every = self.all_chunks
            for ci in upcoming:
                if not self.cache.prefetch(every[ci], next_use, protect):
                    break

    def _next_use(self, chunk: Chunk) -> float:
        return self.schedule.next_use(chunk.index)

    def _pre_forward(self, info: _ModInfo, module: nn.Module, args) -> None:
        if info.chunks:
            self._use(info)
        self._fwd_stack.append(info.chunks)
        if torch.is_grad_enabled():
            for i in info.params:
                self.tracker.expect(i)

    def _step_forward(self, kind: StepKind, name: str, module: nn.Module) -> None:
        info = self._mod_info.get(module)
        if info is not None:  # else a module whose parameters are all frozen
            self._pre_forward(info, module, None)

    def _step_forward_end(self, kind: StepKind, name: str, module: nn.Module) -> None:
        if module not in self._mod_info:
            return
        chunks = self._fwd_stack.pop() if self._fwd_stack else ()
        for c in chunks:
            c.unpin()

    def _step_backward(self, kind: StepKind, name: str, module: nn.Module) -> None:
        info = self._mod_info.get(module)
        if info is not None and info.chunks:
            self._pre_backward(info, None)

    def _pre_backward(self, info: _ModInfo, grad) -> None:
        self._enter_backward()
        self._unwind_forward()
        # Backward runs in reverse creation order, so a call whose backward is still running when
        # this one starts encloses it; the others are done: unpin them.
        stack = self._bwd_stack
        while stack and stack[-1].key not in info.ancestors:
            for c in stack.pop().chunks:
                c.unpin()
        self._use(info)
        stack.append(info)

    def _unwind_forward(self) -> None:
        """Drop pins of forwards that never finished (recomputation stopped early)."""
        while self._fwd_stack:
            for c in self._fwd_stack.pop():
                c.unpin()

    def _root_pre_backward(self, grad) -> None:
        self._enter_backward()

    def _enter_backward(self) -> None:
        if not self.tracker.in_backward:
            if self.tensor_parallel is not None:  # DTensor's collectives in this backward: see edist
                edist.python_free_backward()
            self.tracker.move(TrainingState.BACKWARD)
            edist.set_where(f"step {self.iteration}, backward")
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
            if self.world_size > 1 and not self._no_sync and self.slots:
                self.tracker.agree_on_uses(self._count_ranks, self.world_size)  # see there (issue 36)

    def _count_ranks(self, flags: list[int]) -> list[int]:
        t = torch.tensor(flags, dtype=torch.int32)
        edist.all_reduce(t, self.group)
        return t.tolist()

    def _on_grad(self, p: nn.Parameter) -> None:
        g = p.grad
        if g is None:
            return
        self._enter_backward()
        slot = self._slot_of[p]
        chunk = self.chunks[slot.chunk]
        i, ci = slot.index, slot.chunk
        if chunk.grad_state is GradState.REDUCING:
            self._finish_reductions(upto=chunk)  # a late gradient: as if reduced synchronously
        if self.tracker.ready[ci]:
            raise RuntimeError(
                f"elixir: a gradient of {slot.name!r} arrived after its chunk's gradient was final and "
                "the optimizer had stepped it during backward (fused_step): the parameter is used "
                "again after its gradient was complete (e.g. across reentrant checkpoint segments). "
                "Use ElixirOptimizer(..., fused_step=False) for this model."
            )
        chunk.add_grad(slot.offset, g)
        p.grad = None
        if self.tracker.arrive(i) and not self._no_sync and self.tracker.uniform[ci]:
            self._reduce_chunk(chunk, defer=True)

    def _reduce_chunk(self, chunk: Chunk, defer: bool = False) -> None:
        """Reduce ``chunk``'s gradient; with ``defer`` its collective may be left running
        (:data:`REDUCTIONS_IN_FLIGHT`), completed by a later reduction or at the end of backward."""
        chunk.reduce(defer=defer)
        if chunk.grad_state is GradState.REDUCING:
            self._reducing.append(chunk)
            while len(self._reducing) > REDUCTIONS_IN_FLIGHT:
                self._finish_reduction(self._reducing.pop(0))
        else:
            self._after_reduction(chunk)

    def _finish_reduction(self, chunk: Chunk) -> None:
        chunk.finish_reduction()
        self._after_reduction(chunk)

    def _finish_reductions(self, upto: Optional[Chunk] = None) -> None:
        """Complete the deferred reductions in flight, oldest first (through ``upto`` only). If one
        fails (a lost rank), the others are abandoned (each waits for its own collective) and the
        error is raised."""
        while self._reducing:
            c = self._reducing.pop(0)
            try:
                self._finish_reduction(c)
            except BaseException:
                rest, self._reducing = self._reducing, []
                for other in rest:
                    other.abandon_grad()
                raise
            if c is upto:
                break

    def _after_reduction(self, chunk: Chunk) -> None:
        if self._grad_ready_hooks and not self.tracker.ready[chunk.index]:
            # Early (during backward): final only when every parameter of the chunk got its
            # gradient here, so it has one on every rank; otherwise wait for the agreement.
            if self.tracker.chunk_complete(chunk.index):
                for i in self._chunk_params[chunk.index]:
                    self.has_grad[i] = True
                self._announce(chunk)

    def _announce(self, chunk: Chunk) -> None:
        self.tracker.ready[chunk.index] = True
        for fn in self._grad_ready_hooks:
            fn(chunk)

    def register_grad_ready_hook(self, fn) -> None:
        """``fn(chunk)`` runs once per backward (outside ``no_sync``) for every chunk whose reduced
        shard gradient is final: during backward as soon as all of the chunk's parameters got
        their gradients, else at the end of backward once the ranks agreed on which did
        (``has_grad`` is current for the chunk's parameters either way). A gradient that arrives
        for a chunk after that raises, since what ``fn`` did with it (an optimizer step) cannot be
        undone. ``fn`` may free the shard gradient (:meth:`Chunk.drop_grad`)."""
        self._grad_ready_hooks.append(fn)

    def remove_hook(self, fn) -> None:
        """Take ``fn`` off every hook list it was registered on (grad-ready, backward-end, memory
        reporter): an optimizer replaced by a newer one on this module."""
        for hooks in (self._grad_ready_hooks, self._backward_end_hooks, self._memory_reporters):
            while fn in hooks:
                hooks.remove(fn)

    def register_backward_end_hook(self, fn) -> None:
        """``fn(module)`` runs at the end of every backward outside ``no_sync``, after the last
        grad-ready hook."""
        self._backward_end_hooks.append(fn)

    def settle_chunk(self, chunk: Chunk) -> None:
        """Before ``chunk`` is stepped during backward: its reduction (on the reduce stream) must be
        done where the step reads the gradient. A host master is stepped by the host, which waits
        (and may then write host memory no side-stream copy still reads); a device master is
        stepped on the compute stream, which only has to wait on the device, so the host keeps
        queueing backward work."""
        if chunk.spec.master_on_host:
            self.streams.synchronize()
        else:
            self.streams.join()

    def _settle_reductions(self) -> None:
        """End of backward: the compute stream waits for the reductions (device-side), and where a
        reduced gradient was copied to host memory the host waits too, so the optimizer, clipping
        and ``full_grads`` read finished gradients."""
        self.streams.join()
        if any(c.shard_grad is not None and c.spec.master_on_host for c in self.chunks):
            self.streams.synchronize()

    def _finalize_backward(self) -> None:
        """End of backward: agree on which params got gradients, reduce the rest, reset state."""
        tracker = self.tracker
        tracker.move(TrainingState.FINALIZING)
        try:
            self._finish_reductions()
            n, k = len(self.slots), len(self.chunks)
            local = tracker.arrived_or_local()
            if self._no_sync:
                tracker.local_arrived = local  # remembered for the next synchronising backward
            else:
                tracker.local_arrived = [False] * n
                mask = torch.zeros(n + k, dtype=torch.int32)
                if n:
                    mask[:n] = torch.tensor(local, dtype=torch.int32)
                for c in self.chunks:
                    if c.grad_state is GradState.ACCUMULATING:
                        mask[n + c.index] = 1
                if self.world_size > 1:
                    edist.all_reduce(mask, self.group, op=torch.distributed.ReduceOp.MAX)
                got = mask.tolist()
                self.has_grad = [a or bool(b) for a, b in zip(self.has_grad, got[:n])]
                for c in self.chunks:
                    if got[n + c.index]:
                        c.open_grad()
                        self._reduce_chunk(c)
                    if self._grad_ready_hooks and not tracker.ready[c.index] and c.grad_valid:
                        self._announce(c)
                    c.end_backward()
                for fn in self._backward_end_hooks:
                    fn(self)
                self.finish_publishes()  # those the fused step issued during backward
            tracker.reset()
            self._access.release()
            while self._bwd_stack:
                for c in self._bwd_stack.pop().chunks:
                    c.unpin()
            self._unwind_forward()
            self.cache.release_all()
            self._settle_reductions()
            if self.prefetch and self.schedule is None:  # an untraced plan: follow the order this iteration took
                self.schedule = learned_schedule(self.observed_order, self.plan.prefetch_depth)
            if self.streams_from_disk or self._gathers_on_host:
                # backward freed the activations (and, with sharded chunks, the gathered payloads,
                # which malloc's heap did not reuse: GPT-2 medium in 18 MB chunks grew 0.25-0.75
                # GiB a step, to 6.1 GiB for a 4.6 GiB plan, 4.8 trimmed): hand the heap's free
                # pages back now, so the holes they leave are not resident beside the next step's
                # (the search counts live bytes)
                dev.release_free_host_memory()
        finally:
            tracker.move(TrainingState.IDLE)

    def _check_unchanged(self) -> None:
        """Raise if a parameter was added, removed or replaced since wrapping: chunks were built
        from the parameters then, so a new one would never be gathered, reduced or stepped (it
        would train silently wrong). A walk over the parameters per forward (tens of microseconds)."""
        now = [id(p) for p in self.module.parameters()]
        if now == self._wrapped_params:
            check_trainable_unchanged(self.module, self._wrapped_trainable)
            return
        was = set(self._wrapped_params)
        new = [n for n, p in self.module.named_parameters() if id(p) not in was]
        kept = {id(p) for p in self.module.parameters()}
        gone = len(was - kept)
        raise RuntimeError(
            f"elixir: the model's parameters changed after it was wrapped: {len(new)} new or replaced "
            f"({', '.join(new[:5])}{' ...' if len(new) > 5 else ''}), {gone} gone. ElixirModule packed the "
            "parameters into chunks when it was built, so a parameter added or replaced since is never "
            "gathered, reduced or stepped. Make every change to the model before wrapping it (and re-run "
            "the search for the changed model); to load new values, copy them in (checkpoint.load, "
            "load_state_dict)"
        )

    def _abandon_backward(self) -> None:
        """A backward raised (a disk fault, a lost rank) before its end-of-backward callback: forget
        its gradients, pins and arrivals, so the next step starts as after ``zero_grad``. (With
        the fused backward-and-step, chunks it stepped stay stepped: the optimizer refuses to go
        on from that partial step, :attr:`ElixirOptimizer.torn_step`.)"""
        self.cache.drain()  # prefetches in flight
        self._reducing.clear()  # each chunk waits for its own collective in abandon_grad
        self._settle_reductions()
        self._bwd_stack.clear()
        self._fwd_stack.clear()
        self._access.release()
        for c in self.all_chunks:
            c.unpin(all_pins=True)
        for c in self.chunks:
            c.abandon_grad()
        self.cache.release_all()
        self.tracker.reset()
        self.tracker.local_arrived = [False] * len(self.slots)
        self.has_grad = [False] * len(self.slots)
        self.tracker.move(TrainingState.FINALIZING)
        self.tracker.move(TrainingState.IDLE)

    # ------------------------------------------------------------------------------------------
    # forward

    def forward(self, *args, **kwargs):
        tracker = self.tracker
        if tracker.in_backward and torch._C._current_graph_task_id() == -1:
            self._abandon_backward()  # not a recomputation: the last backward raised midway
        outermost = tracker.state is TrainingState.IDLE  # not nested, not a recomputation in backward
        if not tracker.in_backward:
            self._check_unchanged()
            _check_input_devices(args, kwargs, self.device)
            if torch.is_grad_enabled():
                self.iteration += 1
            edist.set_where(f"step {self.iteration}, forward")
            self._unwind_forward()
            self._access.release()  # a forward with gradients whose backward never ran
            self.observed_order = []
            if self.schedule is not None:
                self.schedule.restart()
        if outermost:
            tracker.move(TrainingState.FORWARD)
        try:
            return self._forward(args, kwargs)
        finally:
            if outermost and tracker.state is TrainingState.FORWARD:
                tracker.move(TrainingState.IDLE)

    def _forward(self, args, kwargs):
        if self.dtype != torch.float32:
            args = _map_floats(args, self.dtype)
            kwargs = _map_floats(kwargs, self.dtype)
        with widened_gemms(self.dtype, self.device) as widened:  # None where torch has a native kernel
            out = self.module(*args, **kwargs)
        self.widened_products = 0 if widened is None else widened.widened
        if torch.is_grad_enabled():
            tensors = _grad_tensors(out)
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")
        elif not self.tracker.in_backward:
            self._access.release()
            self.cache.release_all()
        if self.mp_policy.output_dtype is not None:
            out = _map_floats(out, self.mp_policy.output_dtype)
        return out

    # ------------------------------------------------------------------------------------------
    # gradients and the optimizer's view

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally until a backward outside the block.

        On entry every sharded trainable chunk is gathered and kept (one all-gather each, issued
        here); frozen chunks are still gathered on demand through the rCache (they take no
        gradient, so keeping the whole frozen model gathered would only cost memory); gradients stay in
        full-size per-chunk buffers (see ``memory_report()['peak_grad_buffer_bytes']``) and are
        reduced by the next backward outside the block.
        """
        if self._no_sync:
            yield
            return
        self._no_sync = True
        held = []
        try:
            for c in self.chunks:
                if c.spec.sharded:
                    if c not in self.cache:
                        c.gather()
                        self.cache.admit(c)
                    c.pin()
                    held.append(c)
            yield
        finally:
            self._no_sync = False
            for c in held:
                c.unpin()
            if not self.tracker.in_backward:
                self.cache.release_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the reduced gradients (the shard gradients), as ``optimizer.zero_grad()`` does."""
        for c in self.chunks:
            c.zero_grad(set_to_none)
        self.has_grad = [False] * len(self.slots)
        for p in self.module.parameters():
            p.grad = None

    def register_pre_step_hook(self, fn) -> None:
        """``fn(module)`` runs in :meth:`ElixirOptimizer.step` before the inner optimizer steps."""
        self._pre_step_hooks.append(fn)

    def run_pre_step_hooks(self) -> None:
        """Run the hooks of :meth:`register_pre_step_hook` (the optimizer calls this before stepping)."""
        for hook in list(self._pre_step_hooks):
            hook(self)

    def after_optimizer_step(self, fresh: Container[int] = ()) -> None:
        """The masters changed: refresh compute shards (but those of the chunks in ``fresh``,
        already equal to their masters), publish the ZeRO-1/2 chunks' updated slices and drop
        every gathered (now stale) payload. Collective when any chunk publishes."""
        for c in self.chunks:
            if c.index not in fresh:
                c.refresh_from_master()  # on the copy stream
        self.publish_updates()
        self.streams.join()  # the next forward's compute waits for the refreshed shards
        self.cache.release_all()

    def publish_updates(self, chunks: Optional[list[int]] = None, wait: bool = True) -> None:
        """All-gather the updated slices of every ZeRO-1/2 chunk (of ``chunks`` when given) into
        its resident payload (:meth:`Chunk.publish`): after a step, or after a load wrote this
        rank's slices. Collective (a no-op without such chunks). With ``wait=False`` the
        all-gathers may still run (on CPU, on the backend's thread) when this returns, overlapping
        what the rank does next; :meth:`finish_publishes` completes them (the end of backward
        does, and so does every publish with ``wait``)."""
        for c in self.chunks if chunks is None else [self.chunks[i] for i in chunks]:
            c.publish(async_op=True)
        if wait:
            self.finish_publishes()

    def finish_publishes(self) -> None:
        """Wait for the asynchronous publishes in flight (:meth:`publish_updates` with ``wait=False``)."""
        for c in self.chunks:
            c.finish_publish()

    def drain(self) -> None:
        """Wait for the prefetch gathers still in flight (after a forward without backward, or
        before dropping the module or destroying the process group): then none of this module's
        collectives is running. Collective only in that every rank must have issued them."""
        self.cache.drain()

    def iter_shards(self) -> Iterator[tuple[Chunk, torch.Tensor, Optional[torch.Tensor]]]:
        """(chunk, fp32 master shard, shard gradient in ``grad_dtype`` or None) for this rank, plan order."""
        for c in self.chunks:
            yield c, c.master, (c.shard_grad if c.grad_valid else None)

    def full_grads(self) -> dict[str, Optional[torch.Tensor]]:
        """Every trainable parameter's full fp32 gradient (None when it got none). Collective."""
        if self._grad_ready_hooks:
            raise RuntimeError(
                "full_grads: with the fused backward-and-step (fused_step) each chunk's gradient is "
                "consumed by its optimizer step during backward; use fused_step=False to inspect gradients"
            )
        out: dict[str, Optional[torch.Tensor]] = {}
        for c in self.chunks:
            full = torch.zeros(c.spec.capacity, dtype=torch.float32, device=self.device)
            if c.grad_valid:
                if c.spec.state_sharded:
                    edist.all_gather_into(full, c.shard_grad.to(self.device, torch.float32), self.group)
                else:
                    full.copy_(c.shard_grad)
            elif c.spec.state_sharded:
                edist.all_gather_into(full, torch.zeros(c.spec.shard_numel, device=self.device), self.group)
            for i in self._chunk_params[c.index]:
                s = self.slots[i]
                out[s.name] = full[s.offset : s.offset + s.numel].view(s.shape).clone() if self.has_grad[i] else None
        return out

    # ------------------------------------------------------------------------------------------
    # accounting

    def memory_report(self) -> dict[str, int]:
        """Where this rank's bytes are: the runtime's own tensors by category (the ledger), the
        optimizer's state, the disk staging, and beside them the process as the OS sees it.

        Ledger and optimizer (current, and ``peak_*`` since :meth:`reset_peak_memory`):
        ``shard_*`` compute shards of trainable chunks; ``frozen_shard_*`` those of frozen chunks
        (all a frozen chunk costs between uses); ``master_bytes`` fp32 masters resident (disk masters only
        while staged); ``cache_bytes`` / ``gathered_bytes`` the rCache; ``grad_buffer`` full-size
        gradient buffers during backward; ``shard_grad_bytes`` reduced shard gradients, in
        ``grad_element_bytes`` per element (0 between steps with the fused backward-and-step);
        ``optimizer_state_bytes`` the inner optimizer's resident state (an ElixirOptimizer reports
        it); ``disk_staged_bytes`` masters+state of disk chunks staged in host memory.

        Process (CPU box: device and host are one pool): ``rss_bytes`` / ``peak_rss_bytes``;
        ``elixir_bytes`` what the ledger and the optimizer account for in host memory (with an
        accelerator, its device bytes are not in RSS and not counted here); ``untracked_bytes`` = RSS
        less elixir's bytes: the interpreter and libraries (the search's ``process`` term), the
        model's other tensors, activations alive now, transient copies and allocator slack;
        ``heap_free_bytes`` memory malloc holds free in its heap (slack: resident unless trimmed;
        with ``keep_host_memory`` it is never given back, so RSS keeps its high-water mark);
        ``grad_pool_free_bytes`` gradient buffers held free for the next backward (CPU:
        :class:`~elixir.chunk.GradBufferPool`).
        ``offload_page_cache_bytes`` the offload file's pages in the kernel's page cache (not in
        RSS, but charged to the same memory cgroup)."""
        L = self.ledger
        block = max((c.payload_bytes for c in self.all_chunks if c.spec.sharded), default=0)
        extra: dict[str, int] = {}
        for fn in self._memory_reporters:
            extra.update(fn())
        store = self.disk_store
        # RSS counts host memory only: on an accelerator the ledger's device bytes and the
        # optimizer state held there are not in it (on a CPU device both are host memory)
        on_host = ("host", "device") if not dev.is_accelerator(self.device) else ("host",)
        tracked = sum(n for (_, loc), n in L.current.items() if loc in on_host) + extra.get(
            "optimizer_state_host_bytes", extra.get("optimizer_state_bytes", 0))
        heap = dev.host_allocator_stats()
        rss = dev.rss_bytes()
        process = {
            "rss_bytes": rss,
            "peak_rss_bytes": dev.peak_rss_bytes(),
            "elixir_bytes": tracked,
            "heap_free_bytes": heap.get("heap_free_bytes", 0),
            "grad_pool_free_bytes": self.grad_buffers.free_bytes,
            "untracked_bytes": max(0, rss - tracked),
            "offload_page_cache_bytes": store.page_cache_bytes() if store is not None else 0,
        }
        return {
            "grad_element_bytes": torch.empty((), dtype=self.grad_dtype).element_size(),
            "peak_shard_grad_bytes": L.bytes("shard_grad", peak=True),
            "disk_staged_bytes": store.staged_bytes if store is not None else 0,
            "peak_disk_staged_bytes": store.peak_staged_bytes if store is not None else 0,
            **extra,
            **process,
            "shard_bytes": L.bytes("shard"),
            "shard_device_bytes": L.bytes("shard", "device"),
            "shard_host_bytes": L.bytes("shard", "host"),
            "frozen_shard_bytes": L.bytes("frozen_shard"),
            "frozen_shard_device_bytes": L.bytes("frozen_shard", "device"),
            "frozen_shard_host_bytes": L.bytes("frozen_shard", "host"),
            "master_bytes": L.bytes("master"),
            "cache_bytes": self.cache.capacity * block,
            "gathered_bytes": L.bytes("gathered"),
            "peak_gathered_bytes": L.bytes("gathered", peak=True),
            "peak_grad_buffer_bytes": L.bytes("grad_buffer", peak=True),
            "shard_grad_bytes": L.bytes("shard_grad"),
            "device_peak_bytes": L.device_peak,
            # torch's own statistics for the whole process on the device (0 on CPU), beside the
            # ledger's figures for the runtime's tensors
            "device_allocated_bytes": dev.memory_allocated(self.device),
            "device_max_allocated_bytes": dev.max_memory_allocated(self.device),
            "device_reserved_bytes": dev.memory_reserved(self.device),
        }

    @property
    def offload_stores(self) -> list:
        """This rank's offload stores that exist: masters and state (``disk_store``), frozen disk
        shards (``shard_store``), and the derived shards of ``KK`` chunks (``derived_shards``)."""
        return [s for s in (self.disk_store, self.shard_store, self.derived_shards) if s is not None]

    def reset_peak_memory(self) -> None:
        self.ledger.reset_peaks()
        for store in self.offload_stores:
            store.reset_peak()

    def register_memory_reporter(self, fn) -> None:
        """``fn()`` returns a dict of byte counts merged into :meth:`memory_report`."""
        self._memory_reporters.append(fn)

    # ------------------------------------------------------------------------------------------
    # state dict (full, unsharded, keys of the wrapped model)

    def state_dict(self, *args, rank0_only: bool = False, **kwargs) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The full state dict of the wrapped model with its own keys (tied weights under every
        name, as ``model.state_dict()`` gives them), on CPU. Collective: call on every rank.
        With ``rank0_only`` the other ranks get an empty dict."""
        return full_state_dict(self, rank0_only=rank0_only)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Load a full state dict (keys of the wrapped model). Every rank needs the full dict.
        ``assign=True`` is refused (the parameters are views of elixir's chunks)."""
        return load_full_state_dict(self, state_dict, strict=strict, assign=assign)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped Hugging Face model's ``generate``, each step run through this wrapper
        (``wrapper/generation.py``). Collective: call on every rank; ``synced_gpus`` defaults to
        True at world size > 1, so ranks that finish early keep stepping with the others."""
        return _generate(self, *args, **kwargs)

    def extra_repr(self) -> str:
        kinds: dict[str, int] = {}
        for c in self.chunks:
            kinds[c.spec.sharding.value] = kinds.get(c.spec.sharding.value, 0) + 1
        return (
            f"chunks={len(self.chunks)} ({', '.join(f'{v} {k}' for k, v in kinds.items())}), "
            f"frozen_chunks={len(self.frozen_chunks)}, cache_blocks={self.cache.capacity}, "
            f"world_size={self.world_size}, dtype={self.dtype}"
        )


def _own_version_param(view: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A parameter over ``view`` with a version counter of its own, as ``p.data = view`` gives an
    eagerly built parameter: ``nn.Parameter(view)`` would share the payload's counter, so gathering
    another parameter of the chunk in place would invalidate this one's saved-for-backward uses."""
    param = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=requires_grad)
    param.data = view
    return param
