"""Dynamic loss scaling for fp16, with the overflow decision agreed across ranks.

Every rank reports whether its gradients hold inf/NaN; the flags are all-reduced (MAX) before
anyone decides, so all ranks skip the same steps and keep the same scale. (A per-rank decision,
as in some reference systems, lets ranks diverge silently.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from elixir import distributed as edist


@dataclass(frozen=True)
class LossScalePolicy:
    """How the fp16 loss scale moves.

    Attributes:
        initial_scale: the scale at the first step.
        min_scale / max_scale: bounds on the scale.
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps in a row.
        backoff_factor: multiply the scale by this on overflow, once ``hysteresis`` overflows
            have been seen since the last growth or backoff.
        growth_interval: clean steps between growths.
        hysteresis: overflows tolerated before backing off (every overflowed step is still skipped).
        max_skipped_steps: raise :class:`FloatingPointError` once this many steps in a row were
            skipped for inf/NaN gradients (the model is not training; 0: never raise).
    """

    initial_scale: float = 2.0**16
    min_scale: float = 1.0
    max_scale: float = 2.0**32
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_skipped_steps: int = 100

    def __post_init__(self):
        if not (self.min_scale <= self.initial_scale <= self.max_scale):
            raise ValueError(
                f"initial_scale {self.initial_scale} must lie in [min_scale {self.min_scale}, max_scale {self.max_scale}]"
            )
        if self.growth_factor <= 1 or not (0 < self.backoff_factor < 1):
            raise ValueError("need growth_factor > 1 and 0 < backoff_factor < 1")
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError("growth_interval and hysteresis must be >= 1")
        if self.max_skipped_steps < 0:
            raise ValueError("max_skipped_steps must be >= 0 (0: never raise)")


class DynamicLossScaler:
    """Tracks the fp16 loss scale; ``update(found_inf)`` after each step's agreed overflow check."""

    def __init__(self, policy: LossScalePolicy = LossScalePolicy()):
        self.policy = policy
        self.scale = float(policy.initial_scale)
        self._clean_steps = 0
        self._hysteresis_left = policy.hysteresis
        self.skipped_in_a_row = 0

    def update(self, found_inf: bool) -> None:
        """Move the scale after a step's agreed overflow check (the same on every rank, so a raise
        here happens on every rank alike)."""
        p = self.policy
        if found_inf:
            self.skipped_in_a_row += 1
            if p.max_skipped_steps and self.skipped_in_a_row >= p.max_skipped_steps:
                raise FloatingPointError(
                    f"elixir: {self.skipped_in_a_row} optimizer steps in a row were skipped because the fp16 "
                    f"gradients held inf/NaN (loss scale now {self.scale:g}, min_scale {p.min_scale:g}): the model "
                    "is not training. Look for a NaN in the loss or the inputs, lower the learning rate, or "
                    "compute in bf16 (dtype=torch.bfloat16); raise LossScalePolicy(max_skipped_steps=...) if "
                    "the scale only needs longer to settle"
                )
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * p.backoff_factor, p.min_scale)
                self._hysteresis_left = p.hysteresis
        else:
            self.skipped_in_a_row = 0
            self._clean_steps += 1
            if self._clean_steps >= p.growth_interval:
                self.scale = min(self.scale * p.growth_factor, p.max_scale)
                self._clean_steps = 0
                self._hysteresis_left = p.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left,
                "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))  # absent in older checkpoints


def found_inf_across_ranks(tensors: Iterable[torch.Tensor], group=None, device: Optional[torch.device] = None) -> bool:
    """True when any of ``tensors`` on any rank of ``group`` holds an inf or NaN.

    One all-reduce (MAX) of a single flag: every rank returns the same answer.
    """
    per_device: dict = {}  # the flags stay on their tensors' devices: one transfer per device
    for t in tensors:
        if t.numel() == 0:
            continue
        bad = ~torch.isfinite(t).all()
        per_device[t.device] = bad if t.device not in per_device else per_device[t.device] | bad
    flags = [f.to(device or torch.device("cpu"), torch.float32).reshape(1) for f in per_device.values()]
    if flags:
        flag = torch.stack(flags).amax(0)
    else:
        flag = torch.zeros(1, dtype=torch.float32, device=device)
    edist.all_reduce(flag, group=group, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)
