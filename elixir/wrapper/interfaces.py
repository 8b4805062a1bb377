"""The narrow views of the two facades that the wrapper's helpers are typed against.

``ElixirModule`` and ``ElixirOptimizer`` compose the helpers of this package (state dicts, the HF
save guard, clipping, the fused and backward steps, the full optimizer state). A helper that
imported the facade to name its argument's type made an import circle: the facade imports the
helper, the helper the facade. Each helper instead names one of these protocols: exactly what it
reads of the facade, no more, so what it depends on is written down and checked by a type checker.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Protocol

import torch
import torch.nn as nn

from elixir.chunk import BlockCache, Chunk
from elixir.device import SideStreams
from elixir.offload import DiskStore
from elixir.wrapper.param_map import ParamMap


class ChunkedModel(Protocol):
    """What the helpers read of an ``ElixirModule``: its chunks, where parameters live in them, its
    group and device."""

    module: nn.Module  # the wrapped model
    chunks: list[Chunk]  # trainable chunks, plan order
    frozen_chunks: list[Chunk]
    param_map: ParamMap  # trainable parameters <-> chunk slots
    frozen_map: ParamMap
    params: list[nn.Parameter]  # trainable parameters in param_map order
    rank: int  # on the dp_shard axis
    world_size: int  # ranks of the dp_shard axis
    group: Any  # the dp_shard process group (None: the default world)
    device: torch.device
    cache: BlockCache
    streams: SideStreams
    disk_store: Optional[DiskStore]
    iteration: int
    has_grad: list[bool]  # per trainable parameter: got a gradient (agreed across ranks) since zero_grad
    tensor_parallel: Optional[Any]  # dtensor_params.TensorParallelParams, or None without a tp axis

    @property
    def all_chunks(self) -> list[Chunk]: ...

    def is_chunked(self, p: nn.Parameter) -> bool: ...

    def publish_updates(self, chunks: Optional[list[int]] = None, wait: bool = True) -> None: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...


class ShardedOptimizer(Protocol):
    """What the step helpers read of an ``ElixirOptimizer``: the inner optimizer, its fragments of
    chunk shards, and the torn-step bookkeeping of disk faults."""

    module: Any  # the ElixirModule (a ChunkedModel)
    optim: torch.optim.Optimizer
    fragments: list[Any]  # Fragment: one parameter's piece of one shard
    layout: Any  # optim_state.GroupLayout: the param groups as the user built them
    disk_store: Optional[DiskStore]
    torn_step: Optional[int]

    def chunk_fragments(self, index: int) -> list[Any]: ...

    def fragment_states(self, index: int) -> list[Any]: ...

    def grad_of(self, fragment: Any) -> Optional[torch.Tensor]: ...

    def step_chunk(self, index: int) -> None: ...

    def plain_step(self, factor: Optional[torch.Tensor] = None) -> None: ...

    def refuse_torn_step(self) -> None: ...

    def marking_torn_step(self) -> contextlib.AbstractContextManager[None]: ...


__all__ = ["ChunkedModel", "ShardedOptimizer"]
