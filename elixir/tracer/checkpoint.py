"""Detect gradient-checkpointed regions during a traced forward.

Both flavours of ``torch.utils.checkpoint.checkpoint`` are observed by temporarily wrapping the two
entry points they go through (``CheckpointFunction.forward`` for reentrant,
``_checkpoint_without_reentrant_generator`` for non-reentrant). The wrappers only count depth and
call back on entering/leaving the outermost region, and mark a checkpoint entered during backward
(nested in a recomputed region) as recomputation; they are removed on exit. Not thread-safe:
trace one step at a time.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.utils.checkpoint as ckpt

from .hooks import recomputing

__all__ = ["watch_checkpoints"]


@contextlib.contextmanager
def watch_checkpoints(on_enter: Callable[[], None], on_exit: Callable[[], None]) -> Iterator[None]:
    """Call ``on_enter()``/``on_exit()`` around each outermost checkpointed forward region."""
    depth = [0]

    def enter() -> None:
        depth[0] += 1
        if depth[0] == 1:
            on_enter()

    def leave() -> None:
        depth[0] -= 1
        if depth[0] == 0:
            on_exit()

    orig_gen = ckpt._checkpoint_without_reentrant_generator
    orig_fwd = ckpt.CheckpointFunction.__dict__["forward"]

    def _mark():  # a checkpoint entered during backward is part of a recomputation
        return recomputing() if torch._C._current_graph_task_id() != -1 else contextlib.nullcontext()

    def gen(*args, **kwargs):
        enter()
        try:
            with _mark():
                yield from orig_gen(*args, **kwargs)
        finally:
            leave()

    def fwd(ctx, run_function, preserve_rng_state, *args):
        enter()
        try:
            with _mark():
                return orig_fwd.__func__(ctx, run_function, preserve_rng_state, *args)
        finally:
            leave()

    ckpt._checkpoint_without_reentrant_generator = gen
    ckpt.CheckpointFunction.forward = staticmethod(fwd)
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = orig_gen
        ckpt.CheckpointFunction.forward = orig_fwd
