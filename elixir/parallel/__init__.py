"""Hybrid parallelism on torch's engines: tensor parallelism on DTensor (:mod:`elixir.parallel.tensor`)
and pipeline parallelism on ``torch.distributed.pipelining`` (:mod:`elixir.parallel.pipeline`), with
elixir's chunks as the data-parallel axis (``ElixirModule(model, plan, mesh=mesh)``).

Floor 4, beside ``wrapper/``: it imports the runtime, never the other way round.
"""

from elixir.parallel.loss import vocab_parallel_lm_loss
from elixir.parallel.pipeline import SCHEDULES, ElixirPipeline, causal_lm_loss, pipeline_mesh
from elixir.parallel.pipeline_optim import PipelineOptimizer
from elixir.parallel.stages import NoPipelineSplit, split_decoder
from elixir.parallel.tensor import (
    HF_STYLES,
    NoTensorParallelPlan,
    distribute_like,
    hf_plan,
    plan_for,
    qkv_from_tp_order,
    qkv_to_tp_order,
    tensor_parallel,
)

__all__ = ["tensor_parallel", "plan_for", "hf_plan", "NoTensorParallelPlan", "qkv_to_tp_order",
           "qkv_from_tp_order", "distribute_like", "HF_STYLES", "ElixirPipeline", "PipelineOptimizer", "pipeline_mesh",
           "split_decoder", "NoPipelineSplit", "SCHEDULES", "causal_lm_loss",
           "vocab_parallel_lm_loss"]
