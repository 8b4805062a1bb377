"""``ElixirModule.generate``: the wrapped Hugging Face model's ``generate``, run on the chunks.

Every forward call ``generate`` makes goes through the wrapper (``ElixirModule.forward``): the
chunks are gathered by their hooks and released after each step, inputs cast to the compute dtype,
the outputs to ``output_dtype``. The wrapped module's own ``forward`` is routed there for the
call's duration (for a PEFT model, its base model's, which ``generate`` calls), and restored after.

Gathering is collective, so every rank must make the same number of forward calls: at world size
> 1 ``synced_gpus=True`` is the default (transformers keeps a rank that has finished stepping until
every rank has, as it does for DeepSpeed ZeRO-3 and FSDP). Call ``generate`` on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def _called_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``module.generate`` calls for each step: a PEFT model's base model, else itself."""
    base = getattr(module, "get_base_model", None)
    if hasattr(module, "peft_config") and callable(base):
        return base()
    return module


@contextlib.contextmanager
def forward_through(em: torch.nn.Module, module: torch.nn.Module) -> Iterator[None]:
    """Inside the block, a call of ``module`` (a module inside ``em``) runs ``em``'s forward, which
    reaches ``module``'s own forward through the wrapped module."""
    own = module.__dict__.get("forward")  # an instance attribute already there (restored after)
    original = module.forward
    inside = [False]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if inside[0]:  # the wrapper's forward came back down to this module: its real forward
            return original(*args, **kwargs)
        inside[0] = True
        try:
            return em(*args, **kwargs)
        finally:
            inside[0] = False

    module.forward = forward
    try:
        yield
    finally:
        if own is not None:
            module.forward = own
        else:
            del module.forward


def generate(em: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``em`` is the ElixirModule (typed as a module: this file must not import the facade that calls it). ``em.module.generate(*args, **kwargs)`` with each step through ``em`` (see the module docstring)."""
    gen = getattr(em.module, "generate", None)
    if not callable(gen):
        raise AttributeError(
            f"{type(em.module).__name__} has no generate(): ElixirModule.generate delegates to the wrapped Hugging Face "
            "model's. For a model held inside another module (a LightningModule's self.model), call "
            "self.model.generate(..., synced_gpus=True) inside a step, which runs in the wrapper's forward"
        )
    if em.world_size > 1:
        kwargs.setdefault("synced_gpus", True)
    with forward_through(em, _called_module(em.module)):
        return gen(*args, **kwargs)
