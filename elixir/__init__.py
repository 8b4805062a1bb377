"""elixir: train PyTorch models larger than accelerator memory.

Pipeline, one direction: ``tracer`` profiles a training step on fake tensors, ``search`` turns the
profile and a hardware profile into a plan (plain data), and ``wrapper`` executes the plan with
parameters in flat chunks sharded across ranks.
"""

__version__ = "0.1.0"
"""The installed version of elixir (the distribution is `elixir-train`)."""

from elixir._native import native_available  # noqa: E402

__all__ = ["__version__", "native_available"]
