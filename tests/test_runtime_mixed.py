"""Mixed precision in the runtime: bf16/fp16 compute chunks with fp32 master shards,
``reduce_always_fp32`` and ``output_fp32``.

The reference is hand-written plain torch: the model cast to the compute dtype, fp32 master copies
of every parameter stepped by AdamW on fp32 copies of the low-precision gradients, then copied back.
For fp16 it scales the loss by 2**16 and unscales the gradients, as ElixirOptimizer's dynamic
loss scaler does from its initial scale (no overflow occurs in these 10 steps).
"""

from __future__ import annotations

import pytest
import torch

from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.zoo import build_model
from elixir.wrapper import ElixirModule
from tests.mixed_reference import RUNS, check_mixed, mixed_worker


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_mixed_precision_tracks_reference(world):
    check_mixed(run_distributed(mixed_worker, world, RUNS, timeout=300)[0], world)


def test_bad_dtype_is_refused():
    model = build_model("tied")
    with pytest.raises(ValueError, match="dtype"):
        ElixirModule(model, minimum_waste_search(model, 1), dtype=torch.int8)
