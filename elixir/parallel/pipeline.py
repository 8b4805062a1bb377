"""Pipeline parallelism on ``torch.distributed.pipelining``, each stage on elixir's chunks.

:class:`ElixirPipeline` cuts a decoder into stages by layer (:mod:`elixir.parallel.stages`),
wraps each stage this rank holds in an :class:`~elixir.wrapper.ElixirModule` over the stage's
data-parallel sub-mesh (``mesh["dp_shard", "tp"]``: chunks shard over ``dp_shard``; a ``tp`` axis
runs the stage tensor-parallel first, :func:`~elixir.parallel.tensor_parallel`) and runs torch's
schedules over the ``pp`` axis: ``"gpipe"``, ``"1f1b"`` and ``"interleaved_1f1b"`` (several
stages per rank, looped). torch's engine does the microbatching, the point-to-point sends and the
schedule; elixir adds:

- **one reduction per step.** Every microbatch's backward but the last runs under the stage's
  ``no_sync`` (gradients accumulate in the chunks' full-size buffers); the last one reduces each
  chunk once (:class:`ElixirPipelineStage`). The loss of each microbatch is divided by their
  number, so the accumulated gradient is the full batch's mean (torch's own ``scale_grads``
  divides ``p.grad``, which elixir's chunks hold instead: it is off);
- **steps, not microbatches.** ``ElixirModule.iteration`` counts optimizer steps here (the stage's
  ``pipeline_microbatch`` is set while a step runs), so errors name the step;
- **ties, clipping and loss scaling over the whole mesh**: :class:`~elixir.parallel.pipeline_optim.PipelineOptimizer`.

Build the mesh with :func:`pipeline_mesh` (dimensions ``pp``, ``dp_shard``, ``tp``, sizes of 1
allowed). Every rank passes the same model (same values); each keeps only its stages' parameters:
the others' become meta tensors (names and shapes kept, :func:`~elixir.parallel.stages.release_unheld`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import Shard

from elixir import device as dev
from elixir import distributed as edist
from elixir.parallel.stages import release_unheld, split_decoder, tied_names
from elixir.parallel.tensor import tensor_parallel
from elixir.plan import MeshLayout
from elixir.search import minimum_waste_search
from elixir.wrapper import ElixirModule

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
"""The schedules elixir runs, by name (ColossalAI's ``pp_style`` names: ``"1f1b"``, ``"interleaved"``
is ``"interleaved_1f1b"``)."""
_ALIASES = {"interleaved": "interleaved_1f1b", "1F1B": "1f1b", "GPipe": "gpipe"}
_REFUSED = {
    "zbv": "torch's zero-bubble schedules split each backward into input and weight passes; elixir's chunks reduce a "
           "stage's gradients in one pass, so they are not supported: use '1f1b' or 'interleaved_1f1b'",
}
_REFUSED["zero_bubble"] = _REFUSED["zbv"]


def pipeline_mesh(layout: MeshLayout) -> Any:
    """A CPU/accelerator ``DeviceMesh`` with dimensions ``("pp", "dp_shard", "tp")`` of ``layout``'s
    sizes (a replica axis is refused: use ``dp_shard``). Collective: every rank calls it."""
    # torch's DeviceMesh (imported here: a process group must exist first)
    from torch.distributed.device_mesh import init_device_mesh

    if layout.dp_replicate > 1:
        raise NotImplementedError(f"a pipeline mesh has pp, dp_shard and tp axes; {layout.describe()} has a replica "
                                  "axis: fold it into dp_shard")
    if layout.world_size != edist.get_world_size():
        raise ValueError(f"the layout ({layout.phrase()}) does not cover the {edist.get_world_size()} ranks of this run")
    return init_device_mesh(dev.default_device().type, (layout.pp, layout.dp_shard, layout.tp),
                            mesh_dim_names=("pp", "dp_shard", "tp"), backend_override=edist.mesh_backend_options(3))


def schedule_class(name: str) -> type:
    """torch's schedule class for ``name`` (:data:`SCHEDULES`); others refused naming the choices."""
    key = _ALIASES.get(name, name)
    if key in _REFUSED:
        raise NotImplementedError(f"schedule {name!r}: {_REFUSED[key]}")
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; elixir runs {', '.join(SCHEDULES)}")
    return SCHEDULES[key]


class ElixirPipelineStage(PipelineStage):
    """torch's :class:`PipelineStage` over an :class:`ElixirModule`: each backward but the stage's
    last of a step runs under ``no_sync``; the last reduces every chunk once."""

    def forward_maybe_with_nosync(self, *args, **kwargs):
        em: ElixirModule = self.submod
        if em.pipeline_microbatch is not None:
            em.pipeline_microbatch += 1  # named by errors: "step 3, microbatch 2, forward"
        return super().forward_maybe_with_nosync(*args, **kwargs)  # DTensor's failures: ElixirModule names them

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        em: ElixirModule = self.submod
        if backward_type != "full":
            raise NotImplementedError(f"elixir pipeline stages run full backwards only ({_REFUSED['zbv']})")
        if last_backward:
            # the forwards that marked this backward's parameters may have run before an earlier
            # microbatch's backward reset the marks: expect every gradient, so no chunk is reduced
            # before all of its parameters' gradients are in (an unused one waits for backward's end)
            for i in range(len(em.slots)):
                em.tracker.expect(i)
            with edist.engine_collectives(_phase(em, "backward")):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with em.no_sync(), edist.engine_collectives(_phase(em, "backward")):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def _phase(em: ElixirModule, phase: str) -> str:
    """What a failed collective inside a stage's compute was part of (named by CollectiveFailed)."""
    return f"tensor-parallel {phase}" if em.tensor_parallel is not None else f"pipeline stage {phase}"


def _default_plan(stage: nn.Module, layout: MeshLayout) -> Any:
    """A stage's plan: every backward but a step's last runs under ``no_sync``, which holds each
    sharded chunk gathered, so the rCache has a block for each (``accumulation``)."""
    return minimum_waste_search(stage, layout, accumulation=True)


class ElixirPipeline:
    """A decoder run as a pipeline of :class:`ElixirModule` stages (see the module docstring).

    Args:
        model: a Hugging Face causal LM (:func:`~elixir.parallel.stages.split_decoder` names the
            families), the same on every rank.
        mesh: from :func:`pipeline_mesh`.
        num_microbatches: microbatches per step (the batch must divide by it; a multiple of ``pp``
            for the interleaved schedule); or instead
        microbatch_size: the rows of one microbatch (each batch is cut into as many as it holds).
        layers_per_stage: decoder layers of each stage (default: as even as can be).
        tp_plan: the tensor-parallel plan where the mesh has a tp axis (default: elixir's plan for
            the model, :func:`~elixir.parallel.tensor.plan_for`).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        stages_per_rank: stages each rank holds (``"interleaved_1f1b"`` needs 2 or more; the
            others 1).
        plan_fn: ``plan_fn(stage_module, layout) -> plan`` for each stage (default
            :func:`~elixir.search.minimum_waste_search` with ``accumulation=True``: the
            microbatches' backwards but the last run under ``no_sync``; a ``MeshLayout(dp_shard, tp)``).
        loss_fn: ``loss_fn(logits, target) -> mean loss of a microbatch`` (default: the causal-LM
            loss, targets shifted by one as Hugging Face's ``labels=``).
        **module_kwargs: passed to every stage's :class:`ElixirModule` (``dtype=``, ``prefetch=``, ...).
    """

    def __init__(self, model: nn.Module, mesh: Any, num_microbatches: Optional[int] = None, schedule: str = "1f1b",
                 stages_per_rank: Optional[int] = None, plan_fn: Optional[Callable[[nn.Module, MeshLayout], Any]] = None,
                 loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                 microbatch_size: Optional[int] = None, layers_per_stage: Optional[list[int]] = None,
                 tp_plan: Optional[dict] = None, **module_kwargs: Any) -> None:
        self.schedule_cls = schedule_class(schedule)
        interleaved = issubclass(self.schedule_cls, ScheduleInterleaved1F1B)
        v = stages_per_rank if stages_per_rank is not None else (2 if interleaved else 1)
        if interleaved != (v > 1):
            raise ValueError(f"schedule {schedule!r} with stages_per_rank={v}: the interleaved schedule holds 2 or more "
                             "stages per rank, the others one")
        if interleaved and mesh["pp"].size() < 2:
            raise ValueError("the interleaved schedule needs pp >= 2 (with one pipeline rank, use '1f1b' or no pipeline)")
        names = tuple(mesh.mesh_dim_names or ())
        if names != ("pp", "dp_shard", "tp"):
            raise ValueError(f"ElixirPipeline needs a mesh with dimensions ('pp', 'dp_shard', 'tp') (pipeline_mesh), got {names}")
        self.mesh = mesh
        self.layout = MeshLayout(pp=mesh["pp"].size(), dp_shard=mesh["dp_shard"].size(), tp=mesh["tp"].size())
        self.pp, self.pp_rank = self.layout.pp, mesh.get_local_rank("pp")
        self.pp_group = mesh["pp"].get_group()
        self.num_stages = self.pp * v
        self.interleaved = interleaved
        if num_microbatches is not None:
            self._check_microbatches(num_microbatches)
        elif microbatch_size is None or microbatch_size < 1:
            raise ValueError("ElixirPipeline needs num_microbatches, or microbatch_size (a positive int)")
        self.num_microbatches = num_microbatches
        self.microbatch_size = microbatch_size
        self.config = model.config
        if self.layout.tp > 1:
            tensor_parallel(model, mesh, plan=tp_plan)  # torch's parallelize_module over mesh["tp"], ties re-tied
        self.tied = tied_names(model, self.num_stages, layers_per_stage)
        params = dict(model.named_parameters(remove_duplicate=False))
        self.tied_numels = [_local(params[first]).numel() for first, _ in self.tied]
        # a tie sharded over tp (vocab-parallel): its norm is summed over tp (clipping)
        self.tied_tp_sharded = any(any(isinstance(pl, Shard) for pl in getattr(params[first], "placements", ()))
                                   for first, _ in self.tied)
        self.stage_ids = [self.pp_rank + k * self.pp for k in range(v)]
        sub = mesh["dp_shard", "tp"]
        inner = MeshLayout(dp_shard=self.layout.dp_shard, tp=self.layout.tp)
        plan_fn = plan_fn or _default_plan
        stages = split_decoder(model, self.num_stages, self.stage_ids, layers_per_stage)
        self.released = release_unheld(model, stages)  # other ranks' layers: meta (names and shapes kept)
        self.modules: list[ElixirModule] = [ElixirModule(s, plan_fn(s, inner), mesh=sub, **module_kwargs) for s in stages]
        self.loss_fn = loss_fn or causal_lm_loss
        self.steps = 0
        self._n = num_microbatches or 1
        self.outputs: Any = None
        self._built: Optional[tuple] = None  # (microbatch input shape, schedule)
        self._losses: list[torch.Tensor] = []

    def _check_microbatches(self, n: int) -> None:
        if n < 1 or (self.interleaved and n % self.pp):
            raise ValueError(f"{n} microbatches: at least 1, and a multiple of pp ({self.pp}) for the interleaved schedule")

    # ---- where this rank sits -------------------------------------------------------------------

    @property
    def is_first_stage(self) -> bool:
        """This rank holds stage 0 (it feeds the inputs)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last stage (it computes the loss)."""
        return self.pp_rank == self.pp - 1

    @property
    def dp_group(self) -> Any:
        return self.mesh["dp_shard"].get_group()

    @property
    def tp_group(self) -> Any:
        return self.mesh["tp"].get_group()

    def parameters(self):
        for em in self.modules:
            yield from em.parameters()

    # ---- the step ---------------------------------------------------------------------------------

    def _schedule(self, input_shape: tuple, n: int) -> Any:
        if self._built is not None and self._built[0] == (input_shape, n):
            return self._built[1]
        mb, seq = input_shape
        stages = [self._stage(em, mb, seq) for em in self.modules]
        sched = self.schedule_cls(stages if len(stages) > 1 else stages[0], n, loss_fn=self._microbatch_loss,
                                  scale_grads=False)
        self._built = ((input_shape, n), sched)
        return sched

    def _stage(self, em: ElixirModule, mb: int, seq: int) -> ElixirPipelineStage:
        stage = em.module
        dtype = em.mp_policy.output_dtype or em.dtype
        # requires_grad: the receiving stage's input buffers take a gradient to send back
        hidden = torch.empty(mb, seq, self.config.hidden_size, dtype=dtype, device=em.device, requires_grad=True)
        ids = torch.empty(mb, seq, dtype=torch.long, device=em.device)
        out = torch.empty(mb, seq, self.config.vocab_size, dtype=dtype, device=em.device) if stage.is_last else hidden
        return ElixirPipelineStage(em, stage.index, self.num_stages, em.device, input_args=ids if stage.is_first else hidden,
                                   output_args=out, group=self.pp_group)

    def _microbatch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        self._losses.append(loss.detach())
        return loss / self._n  # the accumulated gradient is the full batch's mean

    def step(self, input_ids: Optional[torch.Tensor], target: Optional[torch.Tensor] = None,
             return_outputs: bool = False) -> Optional[torch.Tensor]:
        """Forward and backward of one batch (this dp rank's share) through the pipeline. The first
        stage's ranks pass ``input_ids``, the last stage's ``target``; others may pass either or
        None. Returns the batch's mean loss on the last stage's ranks, None elsewhere (with
        ``return_outputs``, the last stage's whole-batch output is ``self.outputs``). Collective
        over the whole mesh. Then step the :class:`~elixir.parallel.pipeline_optim.PipelineOptimizer`."""
        ref = input_ids if input_ids is not None else target
        if ref is None or ref.dim() != 2:
            raise ValueError("ElixirPipeline.step needs [batch, seq] input_ids (first stage) or target (last stage)")
        batch, seq = ref.shape
        n = self.num_microbatches or max(1, batch // self.microbatch_size)
        self._check_microbatches(n)
        if batch % n:
            raise ValueError(f"a batch of {batch} does not split into {n} microbatches")
        sched = self._schedule((batch // n, seq), n)
        self._n = n
        self.steps += 1
        self._losses = []
        edist.set_where(f"step {self.steps}, before microbatch 1")  # a stage's first receive names this step
        for em in self.modules:
            em.iteration = self.steps
            em.pipeline_microbatch = 0
        args = (input_ids.to(self.modules[0].device),) if self.is_first_stage else ()
        kwargs: dict[str, Any] = {}
        if self.is_last_stage:
            kwargs["target"] = target.to(self.modules[-1].device)
        try:
            with edist.engine_collectives("pipeline send/recv"):  # torch's p2p sends: see elixir.distributed
                self.outputs = sched.step(*args, return_outputs=return_outputs, **kwargs)
        finally:
            for em in self.modules:
                em.pipeline_microbatch = None
        if not self.is_last_stage:
            return None
        return torch.stack(self._losses).mean()

    def drain(self) -> None:
        """Wait for every stage's prefetches in flight (before teardown)."""
        for em in self.modules:
            em.drain()


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return p.to_local() if hasattr(p, "to_local") else p


def causal_lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``labels=`` loss: token ``t`` predicts ``target[t + 1]``; mean over tokens
    (``-100`` ignored), in fp32."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                       target[:, 1:].reshape(-1), ignore_index=-100)
