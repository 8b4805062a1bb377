"""``Booster(plugin="auto")``: the search decides which plugin runs the model, and says why."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.booster.gemini import GeminiPlugin
from elixir.booster.plugin import Plugin
from elixir.booster.torch_plugins import TorchDDPPlugin
from elixir.plan import dtype_name
from elixir.search import Placement, optimal_search


@dataclass(frozen=True)
class AutoChoice:
    """The plugin the search chose and the reason, in words."""

    plugin: Plugin
    reason: str


def choose_plugin(model: nn.Module, dtype: torch.dtype = torch.float32, verbose: bool = False) -> AutoChoice:
    """Run :func:`~elixir.search.optimal_search` for this model, world size and machine, then:

    - every chunk replicated with its state on the device: that plan is plain data parallelism,
      so :class:`TorchDDPPlugin` runs it (fp32 only; DDP has no low-precision chunks here);
    - anything else (sharded chunks, offloaded shards or state, low precision):
      :class:`GeminiPlugin` with exactly that plan, since no torch plugin executes it.

    FSDP2 is never the answer: a plan with every chunk sharded is what it does, and elixir's
    runtime runs that plan with the searched chunk size, cache and prefetch.
    """
    world = edist.get_world_size()
    # overlap=True: the search decides whether gathering ahead pays; the runtime follows the order
    # the first iteration takes (the plan is untraced) at the depth the search chose
    result = optimal_search(model, world, unified_dtype=dtype, overlap=True, verbose=verbose and edist.get_rank() == 0)
    n = len(result.chunks)
    sharded = sum(c.sharded for c in result.chunks)
    off = sum(c.shard_placement is not Placement.DEVICE or c.optim_placement is not Placement.DEVICE for c in result.chunks)
    step = f"{result.prediction.step_time_s * 1e3:.1f} ms predicted" if result.prediction else "no prediction"
    if sharded == 0 and off == 0 and dtype == torch.float32:
        return AutoChoice(
            TorchDDPPlugin(),
            f"optimal_search's fastest plan that fits replicates all {n} chunks with their state on the device "
            f"({step}): that is data parallelism, so TorchDDPPlugin runs it",
        )
    return AutoChoice(
        GeminiPlugin(plan=result, precision={torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32"),
                     max_prefetch=result.prefetch_depth),
        f"optimal_search's fastest plan that fits shards {sharded} of {n} chunks and offloads {off} "
        f"({dtype_name(dtype)}, {step}): only GeminiPlugin executes such a plan",
    )
