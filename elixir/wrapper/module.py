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
from typing import Any, Container, Iterator, Optional

import torch
import torch.nn as nn

from elixir import device as dev
from elixir import distributed as edist
from elixir.chunk import BlockCache, Chunk, GradBufferPool, MemoryLedger, Schedule
from elixir.lowp_gemm import widened_gemms
from elixir.plan import dtype_from_name
from elixir.tracer.hooks import map_tensors, tensors_in
from elixir.wrapper.backward_tracker import BackwardTracker, TrainingState
from elixir.wrapper.chunk_builder import (
    ChunkBuilder,
    Runtime,
    broadcast_non_chunked,
    build_schedule,
    move_rest_to_device,
)
from elixir.wrapper.chunk_group import ChunkGroup
from elixir.wrapper.dtensor_params import localize
from elixir.wrapper.fused_kernels import apply_fused_kernels
from elixir.wrapper.generation import generate as _generate
from elixir.wrapper.grad_sync import REDUCTIONS_IN_FLIGHT, GradientSync
from elixir.wrapper.hf_guard import guard_save_pretrained
from elixir.wrapper.host_memory import HostMemoryPolicy
from elixir.wrapper.materialize import Materializer, agreed_seed, has_meta_tensors
from elixir.wrapper.memory_report import MemoryAccounts, memory_report
from elixir.wrapper.mesh import require_runnable, resolve_mesh, tp_mesh
from elixir.wrapper.plan_check import PlanLike, agree_on_plan, as_plan, validate_plan
from elixir.wrapper.policies import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    frozen_format,
    module_policies,
    rcache_blocks,
    state_formats,
)
from elixir.wrapper.released import AccessGathers, install_release_guards
from elixir.wrapper.state_dict import full_grads, full_state_dict, load_full_state_dict
from elixir.wrapper.step_hooks import StepHooks
from elixir.wrapper.wrap_guard import WrappedParams, mark_owned, refuse_rewrap

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

__all__ = ["ElixirModule", "REDUCTIONS_IN_FLIGHT"]  # the rule itself lives in grad_sync.py


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors requiring grad inside nested outputs (tensors, tuples, lists, dicts, ModelOutput)."""
    return [t for t in tensors_in(obj) if t.requires_grad]


def _tp_engine(tensor_parallel: Any, phase: str) -> Any:
    """Around a tensor-parallel module's ``phase``: a DTensor collective failing (a dead peer) raises
    CollectiveFailed naming it (:func:`elixir.distributed.engine_collectives`)."""
    return edist.engine_collectives(f"tensor-parallel {phase}") if tensor_parallel is not None else contextlib.nullcontext()


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
        self.state_formats = state_formats(mp_policy, search_result)  # (master, moments), issue 33
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
        self.host_memory = HostMemoryPolicy(search_result, self.device, self.world_size)
        self.host_memory.apply()  # before the runtime allocates anything
        self.streams_from_disk = self.host_memory.streams_from_disk
        self.ledger = MemoryLedger(memory_limit)
        self.streams = dev.SideStreams(self.device)  # gather / reduce / copy streams of every chunk
        self.grad_buffers = GradBufferPool(enabled=self.host_memory.pool_grad_buffers)
        self.cache = BlockCache(rcache_blocks(search_result, frozen_format(mp_policy, search_result)), strict=strict_cache)
        self.offload_dir = offload_policy.offload_dir
        self.offload_direct = offload_policy.direct
        self.materializer: Optional[Materializer] = None
        if has_meta_tensors(module):
            self.materializer = Materializer(module, agreed_seed(init_seed, process_group), init_frozen=init_frozen)
        self._build_chunks(sync_module_states)
        self._install_hooks()

    # ------------------------------------------------------------------------------------------
    # construction

    _is_elixir_module = True  # refused as the model of another ElixirModule (wrap_guard.refuse_rewrap)

    def _build_chunks(self, sync: bool) -> None:
        """The chunks, parameter maps and offload stores of the plan (``chunk_builder.py``)."""
        named = dict(self.module.named_parameters())
        if sync and self.world_size > 1:
            broadcast_non_chunked(self.module, self.plan, named, self.group)
        rt = Runtime(self.mesh, self.ledger, self.streams, self.grad_buffers, self.dtype, self.reduce_dtype, self.grad_dtype,
                     self.device, self.state_formats, frozen_format(self.mp_policy, self.plan))
        built = ChunkBuilder(self.module, self.plan, rt, self.offload_policy, self.materializer).build(named, sync)
        # trainable chunks (index = position), then frozen ones (index = len(chunks) + position),
        # and the parameters in them (the frozen map's indices are global): see BuiltChunks
        self.chunks, self.frozen_chunks = built.chunks, built.frozen_chunks
        self.param_map, self.frozen_map = built.param_map, built.frozen_map
        self.disk_store, self.shard_store, self.derived_shards = built.disk_store, built.shard_store, built.derived_shards
        self.slots, self.params, self._slot_of = self.param_map.slots, self.param_map.params, self.param_map.by_param
        guard_save_pretrained(self)  # the HF model's own save_pretrained would read released payloads
        self._chunk_params: list[list[int]] = self.param_map.by_chunk
        self.ledger.reset_peaks()

    def _install_hooks(self) -> None:
        """The training state, the release guards, the gradient side and the step hooks."""
        self.tracker = BackwardTracker([s.chunk for s in self.slots], self._chunk_params)
        self._access = AccessGathers()  # a released parameter read in a step: elixir/wrapper/released.py
        install_release_guards(self)
        mark_owned(self, self.params + self.frozen_map.params)
        self.grad_sync = GradientSync(self.chunks, self.param_map, self.tracker, self.streams, self.group, self.world_size)
        self.iteration = 0  # training forwards so far (the step named if a collective fails)
        # set by a pipeline (elixir.parallel.pipeline) while its step runs: forwards are that
        # step's microbatches, and `iteration` counts the pipeline's steps instead
        self.pipeline_microbatch: Optional[int] = None
        self._no_sync = False
        self._pre_step_hooks: list = []
        self.accounts = MemoryAccounts(self.ledger, (self.disk_store, self.shard_store, self.derived_shards))
        self.group_ops = ChunkGroup(self.chunks, self.streams, self.cache)
        # untraced plan: the schedule is learned in the first backward
        schedule = build_schedule(self.plan, self.slots + self.frozen_map.slots, self.all_chunks) if self.prefetch else None
        self.step_hooks = StepHooks(self.module, self.all_chunks, self.param_map, self.frozen_map, self.cache,
                                    self.tracker, self._enter_backward, schedule)
        self.step_hooks.install()
        for p in self.params:
            self.step_hooks.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._wrapped = WrappedParams(self.module)  # see WrappedParams.check

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

    def _move_rest_to_device(self) -> None:
        move_rest_to_device(self.module, self.device, self.is_chunked)

    @property
    def schedule(self) -> Optional[Schedule]:
        """The prefetch schedule (None without prefetch, or before an untraced plan's first backward)."""
        return self.step_hooks.schedule

    @property
    def observed_order(self) -> list[frozenset]:
        """The sharded chunk sets the last iteration's steps used, in order."""
        return self.step_hooks.observed_order

    @property
    def has_grad(self) -> list[bool]:
        """Per trainable parameter: whether it got a gradient (agreed across ranks) since ``zero_grad``."""
        return self.grad_sync.has_grad

    @has_grad.setter
    def has_grad(self, value: list[bool]) -> None:
        self.grad_sync.has_grad = value

    # ------------------------------------------------------------------------------------------
    # the training state: forward, backward, their end

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
                self.tracker.agree_on_uses(self.grad_sync.count_ranks, self.world_size)  # see there (issue 36)

    def _on_grad(self, p: nn.Parameter) -> None:
        g = p.grad
        if g is None:
            return
        self._enter_backward()
        self.grad_sync.add(p, g, self._no_sync)

    def register_grad_ready_hook(self, fn) -> None:
        """``fn(chunk)`` runs once per backward (outside ``no_sync``) for every chunk whose reduced
        shard gradient is final (:attr:`GradientSync.grad_ready_hooks`); ``fn`` may free it."""
        self.grad_sync.grad_ready_hooks.append(fn)

    def remove_hook(self, fn) -> None:
        """Take ``fn`` off every hook list it was registered on (grad-ready, backward-end, memory
        reporter): an optimizer replaced by a newer one on this module."""
        for hooks in (self.grad_sync.grad_ready_hooks, self.grad_sync.backward_end_hooks, self.accounts.reporters):
            while fn in hooks:
                hooks.remove(fn)

    def register_backward_end_hook(self, fn) -> None:
        """``fn(module)`` runs at the end of every backward outside ``no_sync``, after the last
        grad-ready hook."""
        self.grad_sync.backward_end_hooks.append(fn)

    def settle_chunk(self, chunk: Chunk) -> None:
        """Before ``chunk`` is stepped during backward (:meth:`GradientSync.settle_chunk`)."""
        self.grad_sync.settle_chunk(chunk)

    def _finalize_backward(self) -> None:
        """End of backward: agree on which params got gradients, reduce the rest, reset state."""
        tracker = self.tracker
        tracker.move(TrainingState.FINALIZING)
        try:
            self.grad_sync.finish_backward(self._no_sync, self)
            if not self._no_sync:
                self.finish_publishes()  # those the fused step issued during backward
            tracker.reset()
            self._access.release()
            self.step_hooks.release_pins()
            self.cache.release_all()
            self.grad_sync.settle_reductions()
            if self.prefetch:  # an untraced plan: follow the order this iteration took
                self.step_hooks.learn_schedule(self.plan.prefetch_depth)
            self.host_memory.after_backward()
        finally:
            tracker.move(TrainingState.IDLE)

    def _abandon_backward(self) -> None:
        """A backward raised (a disk fault, a lost rank) before its end-of-backward callback: forget
        its gradients, pins and arrivals, so the next step starts as after ``zero_grad``. (With
        the fused backward-and-step, chunks it stepped stay stepped: the optimizer refuses to go
        on from that partial step, :attr:`ElixirOptimizer.torn_step`.)"""
        self.cache.drain()  # prefetches in flight
        self.grad_sync.drop_in_flight()  # each chunk waits for its own collective in abandon_grad
        self.grad_sync.settle_reductions()
        self._access.release()
        self.step_hooks.abandon()  # every pin of every chunk goes
        for c in self.chunks:
            c.abandon_grad()
        self.cache.release_all()
        self.tracker.reset()
        self.tracker.local_arrived = [False] * len(self.slots)
        self.has_grad = [False] * len(self.slots)
        self.tracker.move(TrainingState.FINALIZING)
        self.tracker.move(TrainingState.IDLE)

    def forward(self, *args, **kwargs):
        tracker = self.tracker
        if tracker.in_backward and torch._C._current_graph_task_id() == -1:
            self._abandon_backward()  # not a recomputation: the last backward raised midway
        outermost = tracker.state is TrainingState.IDLE  # not nested, not a recomputation in backward
        if not tracker.in_backward:
            self._wrapped.check()
            _check_input_devices(args, kwargs, self.device)
            if torch.is_grad_enabled() and self.pipeline_microbatch is None:
                self.iteration += 1
            mb = "" if self.pipeline_microbatch is None else f", microbatch {self.pipeline_microbatch}"
            edist.set_where(f"step {self.iteration}{mb}, forward")
            self.step_hooks.unwind_forward()
            self._access.release()  # a forward with gradients whose backward never ran
            self.step_hooks.start_iteration()
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
        with widened_gemms(self.dtype, self.device) as widened, _tp_engine(self.tensor_parallel, "forward"):
            out = self.module(*args, **kwargs)  # widened: None where torch has a native kernel
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
        try:
            with self.step_hooks.hold(self.chunks):
                yield
        finally:
            self._no_sync = False
            if not self.tracker.in_backward:
                self.cache.release_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the reduced gradients (the shard gradients), as ``optimizer.zero_grad()`` does."""
        self.group_ops.zero_grad(set_to_none)
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
        self.group_ops.after_step(fresh)

    def publish_updates(self, chunks: Optional[list[int]] = None, wait: bool = True) -> None:
        """All-gather the updated slices of every ZeRO-1/2 chunk (of ``chunks`` when given) into
        its resident payload (:meth:`Chunk.publish`): after a step, or after a load wrote this
        rank's slices. Collective (a no-op without such chunks). With ``wait=False`` the
        all-gathers may still run (on CPU, on the backend's thread) when this returns, overlapping
        what the rank does next; :meth:`finish_publishes` completes them (the end of backward
        does, and so does every publish with ``wait``)."""
        self.group_ops.publish(chunks, wait)

    def finish_publishes(self) -> None:
        """Wait for the asynchronous publishes in flight (:meth:`publish_updates` with ``wait=False``)."""
        self.group_ops.finish_publishes()

    def drain(self) -> None:
        """Wait for the prefetch gathers still in flight (after a forward without backward, or
        before dropping the module or destroying the process group): then none of this module's
        collectives is running. Collective only in that every rank must have issued them."""
        self.cache.drain()

    def iter_shards(self) -> Iterator[tuple[Chunk, torch.Tensor, Optional[torch.Tensor]]]:
        """(chunk, fp32 master shard, shard gradient in ``grad_dtype`` or None) for this rank, plan order."""
        yield from self.group_ops.shards()

    def full_grads(self) -> dict[str, Optional[torch.Tensor]]:
        """Every trainable parameter's full fp32 gradient (None when it got none). Collective."""
        return full_grads(self, fused=bool(self.grad_sync.grad_ready_hooks))

    # ------------------------------------------------------------------------------------------
    # accounting

    def memory_report(self) -> dict[str, int]:
        """Where this rank's bytes are, by category: see :func:`elixir.wrapper.memory_report.memory_report`."""
        return memory_report(self.ledger, self.all_chunks, self.cache, self.device, self.grad_dtype,
                             self.grad_buffers, self.disk_store, self.accounts.extra())

    @property
    def offload_stores(self) -> list:
        """This rank's offload stores that exist: masters and state (``disk_store``), frozen disk
        shards (``shard_store``), and the derived shards of ``KK`` chunks (``derived_shards``)."""
        return list(self.accounts.stores)

    def reset_peak_memory(self) -> None:
        self.accounts.reset_peaks()

    def register_memory_reporter(self, fn) -> None:
        """``fn()`` returns a dict of byte counts merged into :meth:`memory_report`."""
        self.accounts.reporters.append(fn)

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
        kinds = ", ".join(f"{v} {k}" for k, v in self.group_ops.kinds().items())
        return (f"chunks={len(self.chunks)} ({kinds}), frozen_chunks={len(self.frozen_chunks)}, "
                f"cache_blocks={self.cache.capacity}, world_size={self.world_size}, dtype={self.dtype}")
