"""``Booster(plugin="auto")``: the search decides which plugin runs the model, and says why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.booster.gemini import GeminiPlugin
from elixir.booster.plugin import Plugin
from elixir.booster.torch_plugins import TorchDDPPlugin
from elixir.plan import dtype_name
from elixir.plan.state_format import is_lossy
from elixir.search import Placement, optimal_search


@dataclass(frozen=True)
class AutoChoice:
    """The plugin the search chose and the reason, in words."""

    plugin: Plugin
    reason: str


def choose_plugin(model: nn.Module, dtype: torch.dtype = torch.float32, verbose: bool = False,
                  formats: Optional[Mapping[str, Any]] = None) -> AutoChoice:
    """Run :func:`~elixir.search.optimal_search` for this model, world size and machine, then:

    - every chunk replicated with its state on the device: that plan is plain data parallelism,
      so :class:`TorchDDPPlugin` runs it (fp32 only; DDP has no low-precision chunks here);
    - anything else (sharded chunks, offloaded shards or state, low precision, low-precision
      optimizer state or quantised frozen weights): :class:`GeminiPlugin` with exactly that plan,
      since no torch plugin executes it.

    ``formats``: ``master``, ``moments``, ``frozen`` and ``allow_lossy_state``
    (``MixedPrecisionPolicy``'s fields): the search prices them (and with ``allow_lossy_state``
    may choose leaner state formats), the plan records them and GeminiPlugin runs them.

    FSDP2 is never the answer: a plan with every chunk sharded is what it does, and elixir's
    runtime runs that plan with the searched chunk size, cache and prefetch.
    """
    asked = {"master": "fp32", "moments": "fp32", "frozen": None, "allow_lossy_state": False, **(formats or {})}
    world = edist.get_world_size()
    # overlap=True: the search decides whether gathering ahead pays; the runtime follows the order
    # the first iteration takes (the plan is untraced) at the depth the search chose
    result = optimal_search(model, world, unified_dtype=dtype, overlap=True, verbose=verbose and edist.get_rank() == 0,
                            **asked)
    n = len(result.chunks)
    sharded = sum(c.sharded for c in result.chunks)
    off = sum(c.shard_placement is not Placement.DEVICE or c.optim_placement is not Placement.DEVICE for c in result.chunks)
    step = f"{result.prediction.step_time_s * 1e3:.1f} ms predicted" if result.prediction else "no prediction"
    # the formats the run keeps: the plan's where it records them (the search may have chosen them)
    state = (result.master_format or asked["master"], result.moments_format or asked["moments"])
    if sharded == 0 and off == 0 and dtype == torch.float32 and not is_lossy(*state) and asked["frozen"] is None:
        return AutoChoice(
            TorchDDPPlugin(),
            f"optimal_search's fastest plan that fits replicates all {n} chunks with their state on the device "
            f"({step}): that is data parallelism, so TorchDDPPlugin runs it",
        )
    kept = f", optimizer state {state[0]}/{state[1]}" if is_lossy(*state) else ""
    kept += f", frozen weights {asked['frozen']}" if asked["frozen"] else ""
    return AutoChoice(
        GeminiPlugin(plan=result, precision={torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32"),
                     max_prefetch=result.prefetch_depth, master=state[0], moments=state[1], frozen=asked["frozen"]),
        f"optimal_search's fastest plan that fits shards {sharded} of {n} chunks and offloads {off} "
        f"({dtype_name(dtype)}{kept}, {step}): only GeminiPlugin executes such a plan",
    )
