"""One rank's step on a (pipeline, data, tensor) mesh, as the data-parallel search sees it.

:func:`search_mesh` plans a hybrid run by planning one pipeline stage at a time on its
data-parallel axis, with the usual search (:func:`~elixir.search.optimal.search_profile`), from
a :class:`~elixir.search.step_profile.StepProfile` cut down to what one rank of that stage holds:

- **Pipeline stages** (:func:`stage_profiles`): the decoder's layers split evenly over ``pp``
  stages by the layer index in each parameter's name; what comes before the first layer (the
  embeddings) goes to the first stage, what comes after (final norm, head) to the last, and a tied
  embedding to both (each keeps its own copy, its gradient summed between them). A stage's share
  of the activations is its share of the layers times the microbatches it holds at once: all
  ``m`` under GPipe (``m / m`` of the batch), ``pp - s`` for stage ``s`` under 1F1B and
  interleaved 1F1B (``(pp - s) / m`` of the batch, at most all of it).
- **Tensor parallelism** (:func:`tensor_profile`): each parameter at the shape one tp rank holds
  (:func:`elixir.plan.tensor_plans.local_shapes`, the runtime's own plan), the matmul work
  divided with the split weights, and the activations by Korthikanti et al. 2022 ("Reducing
  Activation Recomputation in Large Transformer Models", Table 2): per layer ``sbh(10 + 24/t)``
  of ``sbh * 34`` bytes without sequence parallelism (the attention scores are not counted:
  SDPA does not keep them), all of it divided by ``t`` with it.
- **What the mesh adds** (:func:`mesh_seconds`): the tensor axis's collectives (per layer two
  all-reduces of the layer's output in forward, two in backward, two more when it recomputes;
  a reduce-scatter and an all-gather each under sequence parallelism), the point-to-point sends
  of each microbatch's activations and gradients between stages (priced as a two-rank
  all-gather of both directions' bytes, the profile's measured curve), and the schedule's
  bubble: ``(pp - 1) / m`` of the forward and backward time for GPipe and 1F1B, ``/ v`` more for
  interleaved 1F1B with ``v`` stages per rank.

- **The process's step growth**: each stage's plan counts the bytes a training step adds to the
  process beyond the priced terms (the hardware profile's ``step_extra_bytes`` of the stage's
  activations), as ``optimal_search`` does for a live model.
- **Accumulating microbatches** (:func:`accumulation_bytes`): with more than one microbatch a
  stage's backwards but the last run under ``no_sync``, every sharded chunk gathered and every
  chunk's full-size gradient buffer open: added to the stage's device bytes, and the plan's rCache
  gets a block per sharded chunk.

The stage's step time is ``(forward and backward + tensor collectives + sends) * (1 + bubble) +
optimizer step``; the pipeline's is its slowest stage's. These are model-level estimates, not a
trace of the parallelised step: the checks on layouts this box runs are in docs/parallel.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from elixir.hardware.profile import HardwareProfile
from elixir.plan import MeshLayout, Prediction, SearchResult
from elixir.plan.footprint import element_bytes
from elixir.plan.mesh import SCHEDULES
from elixir.search.cost_model import unified_memory
from elixir.search.optimal import search_profile
from elixir.search.step_profile import RECOMPUTE, StepProfile
from elixir.tracer.op_costs import OpCosts

_LAYER = re.compile(r"\.(\d+)\.")
# Korthikanti et al. 2022, Table 2: activation bytes per layer are s*b*h*(34 + 5as/h) with no
# tensor parallelism; with t ranks, s*b*h*(10 + 24/t + 5as/(ht)) (the 10: layer norms, dropout
# masks and the residual, replicated); with sequence parallelism all of it / t. The attention
# scores' 5as/h term is left out: SDPA does not keep them.
_ACT_REPLICATED, _ACT_SPLIT = 10.0, 24.0
# Megatron's tensor parallelism (the same paper, section 3): each layer's attention and MLP
# blocks reduce their output once per pass (all-reduce, or with sequence parallelism a
# reduce-scatter and an all-gather): 2 per layer per forward, backward or recompute pass
_TP_REDUCTIONS_PER_LAYER = 2
# a pipeline stage sends each microbatch's activations forward and receives their gradients back
_PIPELINE_SENDS_PER_MICROBATCH = 2


@dataclass(frozen=True)
class MeshCosts:
    """Seconds one rank of a stage adds for the mesh, per training step (see the module docstring)."""

    tensor_collectives: float
    pipeline_sends: float
    bubble_fraction: float  # of the stage's forward and backward time


@dataclass(frozen=True)
class MeshPlan:
    """Plans of a hybrid run: one :class:`SearchResult` per pipeline stage (its chunks, over the
    data-parallel axis, of each rank's tensor-parallel shards), its mesh costs, and the run's
    figures: the slowest stage's step time and the most bytes any rank holds."""

    layout: MeshLayout
    stages: tuple[SearchResult, ...]
    costs: tuple[MeshCosts, ...]
    schedule: str
    microbatches: int

    @property
    def step_time_s(self) -> float:
        return max(s.prediction.step_time_s for s in self.stages)

    @property
    def peak_device_bytes(self) -> int:
        return max(s.prediction.peak_device_bytes for s in self.stages)

    @property
    def peak_host_bytes(self) -> int:
        return max(s.prediction.peak_host_bytes for s in self.stages)


def _layer_of(name: str) -> Optional[int]:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def stage_names(profile: StepProfile, pp: int) -> list[frozenset[str]]:
    """The trainable and frozen parameter names each of ``pp`` stages holds (module docstring)."""
    names = [n for n, _ in profile.params] + [n for n, _ in profile.frozen_shapes]
    layers = sorted({i for i in map(_layer_of, names) if i is not None})
    if pp > 1 and len(layers) < pp:
        raise ValueError(f"{pp} pipeline stages need at least {pp} layers; the model has {len(layers)}: "
                         f"lower pp (tensor or data parallelism split it instead)")
    stage_of_layer = {layer: k * pp // max(1, len(layers)) for k, layer in enumerate(layers)}
    order = {n: k for k, n in enumerate(profile.use_order())}
    first_layered = min((order[n] for n in names if n in order and _layer_of(n) is not None), default=0)
    out: list[set[str]] = [set() for _ in range(pp)]
    for n in names:
        layer = _layer_of(n)
        if layer is not None:
            out[stage_of_layer[layer]].add(n)
        elif n in profile.shared:  # a tied embedding: first and last stage each hold it
            out[0].add(n)
            out[-1].add(n)
        else:
            out[0 if order.get(n, math.inf) < first_layered else -1].add(n)
    return [frozenset(s) for s in out]


def _scaled(costs: Optional[OpCosts], matmul: float, memory: float) -> Optional[OpCosts]:
    """``costs`` with each matmul's FLOPs and operand bytes times ``matmul`` (its bucket moved
    with the FLOPs) and each other op's bytes times ``memory``; the op counts stay (each rank
    still runs every op)."""
    if costs is None:
        return None

    def move(hist: dict[int, list[float]], f: float) -> dict[int, list[float]]:
        shift = int(round(math.log2(f))) if f > 0 else 0
        out: dict[int, list[float]] = {}
        for k, (n, *amounts) in hist.items():
            cell = out.setdefault(max(0, k + shift), [0.0] * (1 + len(amounts)))
            cell[0] += n
            for i, v in enumerate(amounts, 1):
                cell[i] += v * f
        return out

    return OpCosts(move(costs.matmul, matmul), move(costs.memory, memory), costs.ops)


def _matmul_numel(params: Any) -> int:
    return sum(math.prod(s) for _, s in params if len(s) == 2)


def stage_profile(profile: StepProfile, names: frozenset[str], stage: int, pp: int, microbatches: int,
                  schedule: str) -> StepProfile:
    """``profile`` cut to pipeline stage ``stage`` of ``pp`` holding ``names`` (:func:`stage_names`)."""
    if pp == 1:
        return profile
    keep = [(k, tuple(n for n in s if n in names)) for k, s in enumerate(profile.steps)]
    keep = [(k, s) for k, s in keep if s]
    n_layers = len({_layer_of(n) for n, _ in profile.params} - {None}) or 1
    frac = len({_layer_of(n) for n in names} - {None}) / n_layers
    held = microbatches if schedule == "gpipe" else min(microbatches, pp - stage)
    params = tuple((n, s) for n, s in profile.params if n in names)
    mm = _matmul_numel(params) / max(1, _matmul_numel(profile.params))
    return dataclasses.replace(
        profile, params=params, shared=frozenset(),
        frozen=tuple(n for n in profile.frozen if n in names),
        frozen_shapes=tuple((n, s) for n, s in profile.frozen_shapes if n in names),
        steps=tuple(s for _, s in keep), step_kinds=tuple(profile.step_kinds[k] for k, _ in keep),
        step_activations=tuple(profile.step_activations[k] for k, _ in keep) if profile.step_activations else (),
        activation_bytes=int(profile.activation_bytes * frac * held / microbatches),
        buffer_bytes=int(profile.buffer_bytes * frac),
        matmul_param_numel=int(profile.matmul_param_numel * mm),
        op_costs=_scaled(profile.op_costs, mm, frac),
        info={**profile.info, "pipeline_stage": stage, "pp": pp, "layer_fraction": frac},
    )


def stage_profiles(profile: StepProfile, pp: int, microbatches: int, schedule: str = "1f1b") -> list[StepProfile]:
    """One profile per pipeline stage (module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    return [stage_profile(profile, names, s, pp, microbatches, schedule)
            for s, names in enumerate(stage_names(profile, pp))]


def tensor_profile(profile: StepProfile, shapes: dict[str, tuple[int, ...]], tp: int,
                   sequence_parallel: bool = False) -> StepProfile:
    """``profile`` as one of ``tp`` tensor-parallel ranks holds it: parameters at ``shapes``
    (:func:`elixir.plan.tensor_plans.local_shapes`), matmul work and activations divided
    (module docstring)."""
    if tp == 1:
        return profile
    params = tuple((n, tuple(shapes.get(n, s))) for n, s in profile.params)
    mm = _matmul_numel(params) / max(1, _matmul_numel(profile.params))
    act = 1.0 / tp if sequence_parallel else (_ACT_REPLICATED + _ACT_SPLIT / tp) / (_ACT_REPLICATED + _ACT_SPLIT)
    return dataclasses.replace(
        profile, params=params,
        frozen_shapes=tuple((n, tuple(shapes.get(n, s))) for n, s in profile.frozen_shapes),
        activation_bytes=int(profile.activation_bytes * act),
        step_activations=tuple(int(a * act) for a in profile.step_activations),
        matmul_param_numel=int(profile.matmul_param_numel * mm),
        op_costs=_scaled(profile.op_costs, mm, act),
        info={**profile.info, "tp": tp, "sequence_parallel": sequence_parallel, "activation_factor": act},
    )


def mesh_seconds(profile: StepProfile, layout: MeshLayout, hw: HardwareProfile, hidden: int, elem: int,
                 microbatches: int, schedule: str, sequence_parallel: bool = False, interleave: int = 2) -> MeshCosts:
    """:class:`MeshCosts` of one rank of a stage described by ``profile`` (already cut by
    :func:`stage_profile` and :func:`tensor_profile`). ``hidden``: the model's hidden size;
    ``elem``: bytes per activation element; ``interleave``: stages per rank of interleaved 1F1B."""
    tp, pp, m = layout.tp, layout.pp, microbatches
    layers = len({_layer_of(n) for n, _ in profile.params} - {None})
    per_mb = profile.tokens / m * hidden * elem  # one microbatch's layer output, whole
    tensor = 0.0
    if tp > 1:
        passes = 2 + (1 if RECOMPUTE in profile.step_kinds else 0)  # forward, backward, recompute
        one = (hw.reduce_scatter_time(per_mb, tp) + hw.all_gather_time(per_mb, tp) if sequence_parallel
               else hw.all_reduce_time(per_mb, tp))
        tensor = layers * passes * _TP_REDUCTIONS_PER_LAYER * m * one
    sends = 0.0
    if pp > 1:
        sent = per_mb / tp if sequence_parallel else per_mb
        # one send of ``sent`` bytes priced as a 2-rank all-gather of twice that (each rank
        # receives the other's half: ``sent`` bytes on the wire), as no point-to-point curve is measured
        sends = _PIPELINE_SENDS_PER_MICROBATCH * m * hw.all_gather_time(2 * sent, 2)
    bubble = (pp - 1) / m / (interleave if schedule == "interleaved_1f1b" else 1)
    return MeshCosts(tensor_collectives=tensor, pipeline_sends=sends, bubble_fraction=bubble)


def with_mesh_costs(result: SearchResult, costs: MeshCosts, layout: MeshLayout) -> SearchResult:
    """``result`` (a stage's data-parallel plan) with ``costs`` in its predicted step time and its
    layout the stage's (dp_shard, tp) sub-mesh."""
    pred = result.prediction
    br = dict(pred.breakdown)
    optimizer = br.get("optimizer", 0.0) + br.get("fused_step_hidden", 0.0)
    fb = pred.step_time_s - optimizer + costs.tensor_collectives + costs.pipeline_sends
    step = fb * (1 + costs.bubble_fraction) + optimizer
    br.update(tensor_collectives=costs.tensor_collectives, pipeline_sends=costs.pipeline_sends,
              pipeline_bubble=fb * costs.bubble_fraction)
    stage = MeshLayout(dp_shard=layout.dp_shard, tp=layout.tp)
    return dataclasses.replace(result, layout=stage,
                               prediction=dataclasses.replace(pred, step_time_s=step, breakdown=br))


def accumulation_bytes(result: SearchResult, elem: int) -> int:
    """Device bytes a pipeline stage holds beyond what the data-parallel search counted for its plan
    ``result``, while the step's microbatches accumulate: every backward but the last runs under
    ``no_sync`` (:class:`elixir.parallel.ElixirPipeline`), which keeps each sharded chunk gathered
    and a full-size gradient buffer of every chunk open until the last backward, where the search
    counted its rCache blocks and the buffers of the chunks whose backward is in progress. Buffers
    are priced at ``elem`` bytes (the compute dtype). 0 with no data-parallel axis (nothing gathered;
    the kept gradients are the whole ones the search counts)."""
    if result.world_size <= 1:
        return 0
    counted = result.info.get("predicted_memory", {})
    gathered = sum(c.chunk_size for c in result.chunks if c.sharded) * elem
    buffers = sum(c.chunk_size for c in result.chunks) * elem
    return max(0, gathered - counted.get("rcache", 0)) + max(0, buffers - counted.get("grad_buffers", 0))


def with_accumulation(result: SearchResult, elem: int) -> SearchResult:
    """``result`` with a block for every sharded chunk (``no_sync`` holds them all: the runtime
    would otherwise go over its rCache) and :func:`accumulation_bytes` in its predicted device
    bytes (``info["accumulation_bytes"]``)."""
    extra = accumulation_bytes(result, elem)
    pred = dataclasses.replace(result.prediction, peak_device_bytes=result.prediction.peak_device_bytes + extra)
    blocks = max(result.cache_blocks, sum(c.sharded for c in result.chunks))
    return dataclasses.replace(result, prediction=pred, cache_blocks=blocks,
                               info={**result.info, "accumulation_bytes": extra})


def _with_step_growth(search: dict, hw: HardwareProfile, profile: StepProfile) -> dict:
    """``search`` with the bytes a training step adds to a rank's process beyond every counted term
    (:meth:`~elixir.hardware.HardwareProfile.step_extra_bytes` of the stage's activations: on a
    CPU-only profile their heap slack is host RAM), as ``optimal_search`` counts them for a live
    model, unless the caller gave ``process_bytes``. Without it the TP2 x DP2 check measured 1.249x
    the prediction (docs/benchmarks.md)."""
    if "process_bytes" in search:
        return search
    extra = hw.step_extra_bytes(profile.activation_bytes, unified_memory(hw))
    return {**search, "process_bytes": extra, "heap_slack_bytes": extra - hw.step_untracked_bytes}


def search_mesh(profile: StepProfile, layout: MeshLayout, *, tp_shapes: Optional[dict[str, tuple[int, ...]]],
                hidden: int, microbatches: int, schedule: str = "1f1b", sequence_parallel: bool = False,
                **search: Any) -> MeshPlan:
    """Plan every pipeline stage of ``layout`` (pp x dp_shard x tp; dp_replicate 1) for ``profile``
    (the whole model's step at this rank's batch). ``tp_shapes``: each parameter's shape on one tp
    rank (None when tp is 1); ``search``: :func:`~elixir.search.optimal.search_profile`'s keywords
    (budgets, hardware, ...), the same for every stage."""
    if layout.dp_replicate > 1:
        raise ValueError(f"the mesh search plans pp, dp_shard and tp axes; this mesh is {layout.describe()}: "
                         "fold dp_replicate into dp_shard")
    if layout.tp > 1 and tp_shapes is None:
        raise ValueError("tp > 1 needs tp_shapes: elixir.plan.tensor_plans.local_shapes(params, style_plan(model), tp)")
    hw = search.get("hardware")
    if not isinstance(hw, HardwareProfile):
        raise ValueError("search_mesh needs hardware=HardwareProfile (the collectives of every axis are priced on it)")
    elem = element_bytes(profile.dtype)
    stages, costs = [], []
    for prof in stage_profiles(profile, layout.pp, microbatches, schedule):
        prof = tensor_profile(prof, tp_shapes or {}, layout.tp, sequence_parallel)
        c = mesh_seconds(prof, layout, hw, hidden, elem, microbatches, schedule, sequence_parallel)
        r = search_profile(prof, layout.dp_shard, **_with_step_growth(search, hw, prof))
        if layout.pp > 1 and microbatches > 1:  # the stage's microbatches accumulate under no_sync
            r = with_accumulation(r, elem)
        stages.append(with_mesh_costs(r, c, layout))
        costs.append(c)
    return MeshPlan(layout=layout, stages=tuple(stages), costs=tuple(costs), schedule=schedule,
                    microbatches=microbatches)


def predicted(plan: MeshPlan) -> Prediction:
    """The run's prediction: the slowest stage's step, the most any rank holds."""
    worst = max(plan.stages, key=lambda r: r.prediction.step_time_s)
    return dataclasses.replace(worst.prediction, peak_device_bytes=plan.peak_device_bytes,
                               peak_host_bytes=plan.peak_host_bytes)


__all__ = ["SCHEDULES", "MeshCosts", "MeshPlan", "stage_names", "stage_profile", "stage_profiles", "tensor_profile",
           "mesh_seconds", "with_mesh_costs", "accumulation_bytes", "with_accumulation", "search_mesh", "predicted"]
