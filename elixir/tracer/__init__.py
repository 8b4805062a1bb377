"""Profile a training step's memory and parameter order on meta tensors (no GPU, no weights).

Public entry points: :func:`elixir.tracer.memory_tracer.cuda_memory_profiling`,
:func:`elixir.tracer.memory_tracer.memory_profiling` and
:func:`elixir.tracer.param_tracer.generate_tf_order`; the runtime's hook helper is
:func:`elixir.tracer.hooks.install_step_hooks`.
"""

from .accounting import TracerError
from .hooks import StepKind, install_step_hooks
from .memory_tracer import MemoryProfile, cuda_memory_profiling, memory_profiling
from .param_tracer import ParamOrder, generate_tf_order

__all__ = [
    "TracerError",
    "StepKind",
    "install_step_hooks",
    "MemoryProfile",
    "cuda_memory_profiling",
    "memory_profiling",
    "ParamOrder",
    "generate_tf_order",
]
