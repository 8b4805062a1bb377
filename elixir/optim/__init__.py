"""Optimizers that step on shards wherever they live: CPUAdam / HybridAdam on the native kernel.

``elixir.optim.functional.adam_step`` is the fused mixed-precision entry point (one pass: low-
precision gradient in, unscale and clip, Adam/AdamW update, low-precision parameter copy out).
"""

from elixir.optim.cpu_adam import CPUAdam
from elixir.optim.functional import adam_step, adam_step_multi
from elixir.optim.hybrid_adam import HybridAdam

__all__ = ["CPUAdam", "HybridAdam", "adam_step", "adam_step_multi"]
