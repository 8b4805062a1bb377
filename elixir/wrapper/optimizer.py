"""ElixirOptimizer: runs any elementwise torch optimizer on this rank's fp32 master shards.

The optimizer is built by the user on the original parameters. Wrapping rebuilds its param groups
in place on *fragments* (:mod:`elixir.wrapper.fragments`: this rank's slices of the fp32 masters), so
LR schedulers built before or after keep working. ``ElixirOptimizer`` is a facade: it keeps the step's
phases (learning-rate checks, loss scale, clipping, skip on overflow), the torn-step bookkeeping and
the state dicts, and delegates the fragments to :class:`~elixir.wrapper.fragments.ShardFragments` and
the update itself to :class:`~elixir.wrapper.shard_step.ShardStepper`.
"""

from __future__ import annotations

import contextlib
import enum
import os
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

from elixir import distributed as edist
from elixir.offload.pipeline import staged
from elixir.offload.state_binding import FragmentState, bind_state
from elixir.optim.loss_scaler import DynamicLossScaler, LossScalePolicy
from elixir.optim.nvme import materialized
from elixir.wrapper import lowbit_state, optim_state
from elixir.wrapper.backward_step import BackwardStep, fallback_reason
from elixir.wrapper.clipping import GradNorm, clip_coefficient, global_grad_norm
from elixir.wrapper.fragments import Fragment, ShardFragments
from elixir.wrapper.loss_scaling import scale_outputs
from elixir.wrapper.module import ElixirModule
from elixir.wrapper.policies import loss_scale_policy as loss_scale_policy_of
from elixir.wrapper.shard_step import ShardStepper, UpdateKernel, choose_kernel


class StepTiming(enum.Enum):
    """When chunks are stepped; chosen once, from ``fused_step`` and what needs every gradient first."""

    DURING_BACKWARD = "during_backward"  # each chunk as soon as its gradient is final (wrapper/backward_step.py)
    AFTER_BACKWARD = "after_backward"  # every chunk in step(), after backward


def check_learning_rates(optimizer: torch.optim.Optimizer, at_construction: bool = False) -> None:
    """Refuse a negative learning rate (some inner optimizers do not check; a scheduler may set one)
    and warn when every group's is 0 at construction (an LR scheduler scales the initial lr, so a
    run built with lr=0 never trains)."""
    lrs = [float(g["lr"]) for g in optimizer.param_groups if "lr" in g and not isinstance(g["lr"], torch.Tensor)]
    bad = [(k, lr) for k, lr in enumerate(lrs) if lr < 0 or lr != lr]
    if bad:
        k, lr = bad[0]
        raise ValueError(
            f"elixir: param group {k} has learning rate {lr}: it must be >= 0. Pass a positive lr to the "
            "optimizer (and check the LR scheduler's schedule)"
        )
    if at_construction and lrs and all(lr == 0 for lr in lrs):
        warnings.warn(
            "elixir: every param group has lr=0, so no parameter will change (an LR scheduler scales this "
            "initial lr, so it stays 0 too). Pass the peak lr to the optimizer; a warm-up scheduler starts "
            "from it", stacklevel=3,
        )


class ElixirOptimizer:
    """Step ``optimizer`` (built on ``module``'s original parameters) on this rank's shards.

    Args:
        module: the :class:`ElixirModule` whose parameters ``optimizer`` was built on.
        optimizer: an elementwise torch optimizer (AdamW, Adam, SGD, Adagrad, ...). State it already
            holds (Adagrad's initial sums, or a trained optimizer's moments) is cut into the shards.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the dynamic loss scale (:class:`~elixir.optim.loss_scaler.LossScalePolicy`),
            used only when the module computes in fp16. Outputs of the module are then wrapped so
            a plain ``loss.backward()`` produces scaled gradients (see
            :mod:`elixir.wrapper.loss_scaling`); do not scale the loss yourself. An inf/NaN gradient
            on any rank makes every rank skip the step (one agreed decision). Aliases of
            ``loss_scale_policy``.
        max_norm, norm_type: clip the global gradient norm at every step when ``max_norm > 0``.
        init_step: create the optimizer state now, changing no parameter, hyper-parameter or step
            count.
        offload_dir: where the module keeps disk-placed masters and optimizer state. The module
            owns that store (``ElixirModule(..., offload_dir=...)``); giving another directory
            here is an error, and it is ignored when no chunk is on disk.
        fused_step: step each chunk as soon as its gradient is final, during backward, and free
            the gradient then (:mod:`elixir.wrapper.backward_step`); ``step()`` then only closes
            the iteration. Default: the plan's ``fused_step``. Where ``max_norm`` clipping or fp16
            loss scaling needs every gradient first, it falls back to the separate step with a
            warning (``fused_step_fallback`` holds the reason). Accumulate with ``no_sync()``.
        loss_scale_policy: the dynamic loss scale as one
            :class:`~elixir.optim.loss_scaler.LossScalePolicy` (instead of ``initial_scale`` ...
            ``hysteresis``; giving both raises).

    Chunks the plan puts on disk are stepped one at a time while staged (the next one is read
    while one steps, so at most two are in host memory; :mod:`elixir.offload.pipeline`), and
    ``step`` returns once every write finished. With a plain torch optimizer that means one inner
    ``step()`` call per disk chunk (restricted to its fragments) after one for the rest.

    With CPUAdam/HybridAdam inside, unscaling and clipping fold into the kernel's ``div_scale`` and
    the kernel writes low-precision compute shards directly (:mod:`elixir.wrapper.fused_step`).
    """

    def __init__(
        self,
        module: ElixirModule,
        optimizer: torch.optim.Optimizer,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2.0**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        init_step: bool = False,
        offload_dir: Optional[str] = None,
        fused_step: Optional[bool] = None,
        *,
        loss_scale_policy: Optional[LossScalePolicy] = None,
    ) -> None:
        if not isinstance(module, ElixirModule):
            raise TypeError("ElixirOptimizer needs the ElixirModule (wrap the model first)")
        store = module.disk_store
        if offload_dir is not None and store is not None and os.path.dirname(store.path) != os.path.abspath(offload_dir):
            raise ValueError(
                f"the module keeps its disk chunks in {os.path.dirname(store.path)!r}, not {offload_dir!r}: "
                "pass offload_dir to ElixirModule (the optimizer state goes where the masters are)"
            )
        if max_norm < 0:
            raise ValueError(f"max_norm must be >= 0 (0 disables clipping), got {max_norm}")
        scale_policy = loss_scale_policy_of(
            loss_scale_policy, initial_scale=initial_scale, min_scale=min_scale, max_scale=max_scale,
            growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval,
            hysteresis=hysteresis,
        )
        check_learning_rates(optimizer, at_construction=True)
        pre_state = optimizer.state_dict() if any(len(s) for s in optimizer.state.values()) else None
        previous = getattr(module, "elixir_optimizer", None)
        if previous is not None:
            previous.retire()  # one optimizer per module: the newest takes over
        module.elixir_optimizer = self
        self.retired = False
        self.module = module
        self.optim = optimizer
        self.shards = ShardFragments(module, optimizer)
        self.fragments: list[Fragment] = self.shards.fragments
        self.disk_store = store
        self.disk_chunks: list[int] = sorted(store.chunks) if store is not None else []
        self.layout = optim_state.capture_layout(module, optimizer)
        self.shards.rebuild_groups()
        self._init_precision(scale_policy, max_norm, norm_type)
        lowbit_state.configure(self, self.kernel is UpdateKernel.FUSED)  # the module's state formats
        module.register_memory_reporter(self._memory_report)
        self.stepper = ShardStepper(self, self.shards, self.kernel, self.disk_chunks)
        self.torn_step: Optional[int] = None  # a step a disk fault left partly applied
        self.backward_step: Optional[BackwardStep] = None
        self.fused_step_fallback: Optional[str] = None
        self.timing = StepTiming.AFTER_BACKWARD
        if module.plan.fused_step if fused_step is None else fused_step:
            self.fused_step_fallback = fallback_reason(self.max_norm, self.scaler is not None)
            if self.fused_step_fallback is None:
                self.timing = StepTiming.DURING_BACKWARD
                self.backward_step = BackwardStep(self)
            else:
                warnings.warn(f"elixir: fused_step falls back to a separate optimizer step: {self.fused_step_fallback}", stacklevel=2)
        if pre_state is not None:
            optim_state.scatter_full_state(self, pre_state)
            self.bind_disk_state()
            lowbit_state.refresh_host_shards(self)
        if init_step:
            optim_state.init_state(self)

    # ---- structure ---------------------------------------------------------------------------

    def chunk_fragments(self, index: int) -> list[Fragment]:
        """This rank's fragments of chunk ``index`` (plan order)."""
        return self.shards.chunk_fragments(index)

    def fragment_states(self, index: int) -> list[FragmentState]:
        """(state, lo, hi) of this rank's fragments of chunk ``index`` (:meth:`ShardFragments.fragment_states`)."""
        return self.shards.fragment_states(index)

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def iter_master_shards(self) -> Iterator[tuple]:
        """(chunk, fp32 master shard, fp32 shard gradient or None, whether the master is split) on this rank."""
        for c, master, grad in self.module.iter_shards():
            yield c, master, grad, c.spec.state_sharded

    # ---- stepping ----------------------------------------------------------------------------

    def grad_of(self, f: Fragment) -> Optional[torch.Tensor]:
        """The gradient attached to fragment ``f`` for this step (any dtype), or None."""
        return self.shards.grad_of(f)

    def step(self, closure: Optional[Callable] = None):
        """One optimizer step on the shards, then refresh what the next gather reads.

        fp16: skipped on every rank when any rank holds an inf/NaN gradient (the loss scale then
        backs off). Gradients are unscaled and clipped (``max_norm``, and any pending
        :meth:`clip_grad_norm_`) in one pass, or inside the kernel on the fused path."""
        if closure is not None:
            raise NotImplementedError("ElixirOptimizer.step does not take a closure")
        edist.set_where(f"step {self.module.iteration}, optimizer step")
        self.refuse_retired()
        self.refuse_torn_step()
        check_learning_rates(self.optim)
        # The host is about to write masters and host shards that side-stream copies may still
        # read (gathers of host shards, last step's refreshes): let those finish first.
        self.module.streams.synchronize()
        if self.backward_step is not None:
            self.backward_step.finish_step()
            if not any(c.grad_valid for c in self.module.chunks):
                self.last_step_skipped = False
                return None  # every chunk stepped during backward
        self.shards.attach_grads()
        self.module.run_pre_step_hooks()
        try:
            if self.max_norm > 0:
                self.clip_grad_norm_(self.max_norm, self.norm_type)
            skip = False
            if self.scaler is not None:
                found_inf = self._found_inf
                if found_inf is None:  # no norm taken this step: one pass (aminmax) and one all-reduce
                    found_inf = global_grad_norm(self.module, float("inf")).found_inf
                self.scaler.update(found_inf)
                skip = found_inf
            self.last_step_skipped = skip
            if skip:
                return None
            fresh = self.stepper.apply(self._pending_factor())
        finally:
            self._grad_factor = None
            self._found_inf = None
            self.shards.detach_grads()
        # the chunks whose compute shard the kernel wrote need no master -> shard copy
        self.module.after_optimizer_step(fresh=fresh)
        return None

    def _memory_report(self) -> dict[str, int]:
        """Host/device bytes of the inner optimizer's tensor state resident now (a disk chunk's
        state counts only while staged)."""
        seen, total, host = set(), 0, 0
        for st in self.optim.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() >= 1:
                    key = v.untyped_storage().data_ptr()
                    if key and key not in seen:
                        seen.add(key)
                        total += v.untyped_storage().nbytes()
                        host += v.untyped_storage().nbytes() if v.device.type == "cpu" else 0
        return {"optimizer_state_bytes": total, "optimizer_state_host_bytes": host}

    def retire(self) -> None:
        """A newer ElixirOptimizer was built on this module: take this one's hooks off the module
        (with the fused backward-and-step both would step every chunk) and refuse to step."""
        em = self.module
        self.retired = True
        if self.backward_step is not None:
            self.backward_step.detach()
        em.remove_hook(self._memory_report)
        if self._scale_hook is not None:
            self._scale_hook.remove()
            self._scale_hook = None

    def refuse_retired(self) -> None:
        if self.retired:
            raise RuntimeError(
                "elixir: this ElixirOptimizer was replaced by a newer one built on the same ElixirModule "
                "(one optimizer per module: it steps the module's chunks). Step the newest one, or build a "
                "single ElixirOptimizer whose inner optimizer holds every param group"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.refuse_retired()
        self.module.zero_grad(set_to_none)
        self._grad_factor = None
        self._found_inf = None
        self.shards.detach_grads()

    # ---- precision, clipping, state (issue 5) --------------------------------------------------

    @property
    def fused(self) -> bool:
        """Whether the native fused kernel steps the chunks (:attr:`UpdateKernel.FUSED`)."""
        return self.kernel is UpdateKernel.FUSED

    def _init_precision(self, policy: LossScalePolicy, max_norm: float, norm_type: float) -> None:
        self.max_norm = float(max_norm)
        self.norm_type = float(norm_type)
        self.kernel = choose_kernel(self.optim, self.module.grad_dtype)
        for c in self.module.chunks:  # the fused kernel reads bf16/fp16 gradients as they are
            c.narrow_grads_ok = self.kernel is UpdateKernel.FUSED
        self.scaler: Optional[DynamicLossScaler] = None
        self.last_step_skipped = False
        self._grad_factor: Optional[torch.Tensor] = None  # pending fp32 multiplier (clip / scale)
        self._found_inf: Optional[bool] = None  # agreed overflow flag, when a norm was taken
        self._scale_hook = None
        if self.module.dtype == torch.float16:
            self.scaler = DynamicLossScaler(policy)
            self._scale_hook = self.module.register_forward_hook(self._scale_outputs)

    def _scale_outputs(self, module, args, output):
        if not torch.is_grad_enabled():
            return output
        return scale_outputs(output, lambda: self.loss_scale)

    def stop_scaling_outputs(self) -> None:
        """Leave the module's outputs unscaled (fp16): a pipeline stage before the last, whose output
        gradients arrive from the next stage already scaled by the last stage's loss scale."""
        if self._scale_hook is not None:
            self._scale_hook.remove()
            self._scale_hook = None

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 when the module does not compute in fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``: scaling is automatic (kept for code written for other wrappers).
        Under tensor parallelism a DTensor collective failing (a dead peer) raises CollectiveFailed."""
        tp = self.module.tensor_parallel is not None
        with edist.engine_collectives("tensor-parallel backward") if tp else contextlib.nullcontext():
            loss.backward()

    def _pending_factor(self) -> torch.Tensor:
        if self._grad_factor is None:
            return torch.tensor(1.0 / self.loss_scale, dtype=torch.float32)
        return self._grad_factor

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm like ``torch.nn.utils.clip_grad_norm_``; return the norm
        (of the unscaled gradients; inf/NaN on overflow). Collective: call on every rank.

        Call it between backward and :meth:`step`; the clip is applied at ``step`` in the same
        pass as unscaling (or inside the fused kernel). Each call clips the result of the last."""
        if self.backward_step is not None:
            raise RuntimeError(
                "clip_grad_norm_ cannot clip with fused_step: each chunk was stepped during backward, "
                "before the global norm was known. Use ElixirOptimizer(..., fused_step=False, max_norm=...)."
            )
        return self.clip_by(global_grad_norm(self.module, norm_type), max_norm)

    def clip_by(self, gn: GradNorm, max_norm: Optional[float]) -> torch.Tensor:
        """:meth:`clip_grad_norm_` with a norm taken over more than this module (a pipeline's
        stages, :mod:`elixir.parallel.pipeline_optim`): records its overflow flag for
        :meth:`step`, and with ``max_norm`` (not None) clips by it. Returns the unscaled norm."""
        factor = self._pending_factor()
        self._found_inf = bool(self._found_inf) or gn.found_inf
        if gn.found_inf or max_norm is None:
            return torch.tensor(gn.norm, dtype=torch.float32) * (1.0 if gn.found_inf else factor)
        total = torch.tensor(gn.norm, dtype=torch.float64) * factor.double()
        total32 = total.to(torch.float32)
        self._grad_factor = (factor * clip_coefficient(float(total32), float(max_norm))).to(torch.float32)
        return total32

    def plain_step(self, factor: Optional[torch.Tensor] = None) -> None:
        """``optimizer.step()`` over every fragment with a gradient (:meth:`ShardStepper.plain_step`)."""
        self.stepper.plain_step(factor)

    def step_chunk(self, i: int) -> None:
        """Step chunk ``i`` alone, unscaled and unclipped (:meth:`ShardStepper.step_chunk`)."""
        self.stepper.step_chunk(i)

    def for_each_disk_chunk(self, work: Callable[[int], None], chunks: Optional[list[int]] = None) -> None:
        """Run ``work(i)`` on each disk chunk while staged (:meth:`ShardStepper.for_each_disk_chunk`)."""
        self.stepper.for_each_disk_chunk(work, chunks)

    @contextlib.contextmanager
    def marking_torn_step(self) -> Iterator[None]:
        """Record a step that a disk fault left partly applied (:attr:`torn_step`, see
        :mod:`elixir.wrapper.disk_faults`): the block raised :class:`~elixir.distributed.DiskFault`
        (on every rank alike)."""
        try:
            yield
        except edist.DiskFault:
            self.torn_step = self.module.iteration
            raise

    def forget_torn_step(self) -> None:
        """A checkpoint was loaded: a step a disk fault left partly applied is behind us."""
        self.torn_step = None
        if self.backward_step is not None:
            self.backward_step.finish_step()

    def refuse_torn_step(self) -> None:
        """Raise (on every rank alike) if a disk fault left the last step partly applied."""
        if self.torn_step is not None:
            raise RuntimeError(
                f"elixir: step {self.torn_step} was applied to only some chunks when a disk fault stopped it "
                "(see that error), so training on would mix two steps. Load a checkpoint "
                "(checkpoint.load(path, model, optimizer), or optimizer.load_state_dict) before stepping again"
            )

    def state_dict(self, rank0_only: bool = False) -> dict[str, Any]:
        """The full (unsharded) state dict in the inner optimizer's torch format, keyed like the
        optimizer the user built (indices in original group order): it loads into that optimizer
        type on the unwrapped model. Collective. The loss scaler goes under ``"loss_scaler"``."""
        with materialized(self.optim):  # moments the optimizer keeps on its own disk, read back
            sd = optim_state.gather_full_state(self, rank0_only=rank0_only)
        if sd and self.scaler is not None:
            sd["loss_scaler"] = self.scaler.state_dict()
        if sd:
            sd["state_format"] = lowbit_state.formats(self)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full torch-format optimizer state dict (from :meth:`state_dict` or a plain torch
        optimizer on the unwrapped model). Every rank needs the whole dict; no collective."""
        lowbit_state.warn_format_change(state_dict.get("state_format"), self, "load_state_dict")
        optim_state.scatter_full_state(self, state_dict)
        self.bind_disk_state()
        lowbit_state.refresh_host_shards(self)  # bf16-kahan: the loaded compensation into the compute shards
        self.forget_torn_step()
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])

    def bind_disk_state(self) -> None:
        """Move freshly installed optimizer state of disk chunks to the disk (after a load): each
        chunk is staged in turn, takes the new state into its flats, and is written back (its
        compute shard refreshed with a loaded bf16-kahan compensation meanwhile)."""
        if self.disk_store is None:
            return
        for i in self.disk_chunks:
            with staged(self.disk_store, [i], before_write=lambda j: bind_state(self.disk_store, j, self.fragment_states(j))):
                lowbit_state.refresh_shard(self, i)

    def __repr__(self) -> str:
        return f"ElixirOptimizer({type(self.optim).__name__}, {len(self.fragments)} fragments)"
