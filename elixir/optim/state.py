"""What an optimizer's per-parameter state looks like to the code that stores it elsewhere."""

from __future__ import annotations

from typing import Any

import torch


def is_elementwise(value: Any, numel: int) -> bool:
    """Whether a state entry holds one value per element of a ``numel``-element parameter (Adam's
    ``exp_avg``) rather than a scalar (``step``): only those are sharded, offloaded and sliced."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() == numel
