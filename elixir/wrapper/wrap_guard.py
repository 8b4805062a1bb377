"""What ElixirModule refuses about the model it wraps, before and after wrapping.

- **A second wrap** (an ``ElixirModule``, a model holding one, or a model whose parameters a live
  ``ElixirModule`` already holds): its parameters are views of the first wrapper's chunks, so a
  second set of chunks built from them read released payloads (SIGSEGV). :class:`TypeError`.
- **A trainable set changed after wrapping** (``requires_grad`` flipped on a wrapped parameter):
  trainable and frozen parameters live in different chunks (a frozen chunk has no gradient buffer,
  master or optimizer state), so an un-frozen parameter was silently never trained, or, with an
  optimizer over every parameter, stepped through a released view (SIGSEGV). DDP refuses such a
  change too. Checked at every forward (a walk over the flags, as for added parameters), so every
  rank raises at the same point.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.nn as nn


def refuse_rewrap(module: nn.Module) -> None:
    """Raise :class:`TypeError` when ``module`` is, holds, or was wrapped by a live ElixirModule."""
    for name, m in module.named_modules():
        if getattr(m, "_is_elixir_module", False):
            where = "is an ElixirModule" if not name else f"holds an ElixirModule at {name!r}"
            raise TypeError(
                f"elixir: the model {where}: an ElixirModule cannot be wrapped again (its parameters are "
                "views of its own chunks). Wrap the original model once, and train the wrapper"
            )
    for name, p in module.named_parameters():
        ref = getattr(p, "_elixir_owner", None)
        if ref is not None and ref() is not None:
            raise TypeError(
                f"elixir: parameter {name!r} is already held by another ElixirModule (the model was wrapped "
                "before): wrap each model once, and train that wrapper (build a fresh model for a new wrapper)"
            )


def mark_owned(em: Any, params: list[nn.Parameter]) -> None:
    for p in params:
        p._elixir_owner = weakref.ref(em)


def trainable_flags(module: nn.Module) -> list[bool]:
    return [p.requires_grad for p in module.parameters()]


def check_trainable_unchanged(module: nn.Module, wrapped: list[bool]) -> None:
    """Raise naming the parameters whose ``requires_grad`` changed since wrapping, and the fix."""
    now = trainable_flags(module)
    if now == wrapped:
        return
    changed = [(n, p.requires_grad) for (n, p), was in zip(module.named_parameters(), wrapped) if p.requires_grad != was]
    thawed = [n for n, r in changed if r]
    frozen = [n for n, r in changed if not r]
    parts = []
    if thawed:
        parts.append(f"un-frozen: {', '.join(thawed[:5])}{' ...' if len(thawed) > 5 else ''}")
    if frozen:
        parts.append(f"frozen: {', '.join(frozen[:5])}{' ...' if len(frozen) > 5 else ''}")
    raise RuntimeError(
        f"elixir: requires_grad changed on {len(changed)} parameter(s) after the model was wrapped ({'; '.join(parts)}). "
        "The plan packed trainable and frozen parameters into different chunks (a frozen chunk keeps no gradient, "
        "master or optimizer state), so the change cannot take effect in this wrapper. Set requires_grad before "
        "wrapping: re-run the search on the model with its new trainable set (minimum_waste_search / optimal_search), "
        "wrap a fresh model with that plan and build the optimizer over the new wrapper (load a checkpoint to keep the "
        "values: elixir.checkpoint)"
    )


class WrappedParams:
    """The model's parameters as they were when wrapped, to refuse a change made since."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.ids = [id(p) for p in module.parameters()]
        self.trainable = trainable_flags(module)

    def check(self) -> None:
        """Raise if a parameter was added, removed or replaced since wrapping: chunks were built
        from the parameters then, so a new one would never be gathered, reduced or stepped (it
        would train silently wrong). A walk over the parameters per forward (tens of microseconds)."""
        now = [id(p) for p in self.module.parameters()]
        if now == self.ids:
            check_trainable_unchanged(self.module, self.trainable)
            return
        was = set(self.ids)
        new = [n for n, p in self.module.named_parameters() if id(p) not in was]
        kept = {id(p) for p in self.module.parameters()}
        gone = len(was - kept)
        raise RuntimeError(
            f"elixir: the model's parameters changed after it was wrapped: {len(new)} new or replaced "
            f"({', '.join(new[:5])}{' ...' if len(new) > 5 else ''}), {gone} gone. ElixirModule packed the "
            "parameters into chunks when it was built, so a parameter added or replaced since is never "
            "gathered, reduced or stepped. Make every change to the model before wrapping it (and re-run "
            "the search for the changed model); to load new values, copy them in (checkpoint.load, "
            "load_state_dict)"
        )
