"""HybridAdam: CPU parameters on the native kernel, accelerator parameters on torch's fused AdamW."""

from __future__ import annotations

from elixir.optim.cpu_adam import CPUAdam

__all__ = ["HybridAdam"]


class HybridAdam(CPUAdam):
    """:class:`CPUAdam` that also takes parameters on an accelerator, in one optimizer.

    Each step splits the parameters by where they live: CPU-resident ones (offloaded shards) go
    through the native fused kernel, the others through torch's fused multi-tensor Adam/AdamW on
    their device, with the same hyperparameters, state layout and state_dict. Arguments are
    CPUAdam's.
    """

    _accepts_accelerator = True
