"""ElixirModule (executes a plan) and ElixirOptimizer (steps on the shards)."""

from elixir.wrapper.module import ElixirModule
from elixir.wrapper.optimizer import ElixirOptimizer, Fragment
from elixir.wrapper.param_map import ParamMap, ParamSlot, ShardPiece
from elixir.wrapper.plan_check import PlanMismatch, validate_plan
from elixir.wrapper.policies import LossScalePolicy, MixedPrecisionPolicy, OffloadPolicy
from elixir.wrapper.state_dict import StateDictMismatch

__all__ = [
    "ElixirModule", "ElixirOptimizer", "Fragment", "LossScalePolicy", "MixedPrecisionPolicy", "OffloadPolicy",
    "ParamMap", "ParamSlot", "PlanMismatch", "ShardPiece", "StateDictMismatch", "validate_plan",
]
