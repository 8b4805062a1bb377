"""Hybrid parallelism on torch's engines: tensor parallelism on DTensor (:mod:`elixir.parallel.tensor`),
with elixir's chunks as the data-parallel axis (``ElixirModule(model, plan, mesh=mesh)``).

Floor 4, beside ``wrapper/``: it imports the runtime, never the other way round.
"""

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
           "qkv_from_tp_order", "distribute_like", "HF_STYLES"]
