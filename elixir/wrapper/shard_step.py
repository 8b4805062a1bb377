"""How ElixirOptimizer updates the fp32 master shards: which kernel, and the resident and disk passes.

:class:`UpdateKernel` is chosen once, from the inner optimizer and the module's shard-gradient dtype.
:class:`ShardStepper` runs it: over every fragment at once (the separate step, with the pending
unscale/clip factor), or one chunk at a time (the fused backward-and-step's unit). Chunks the plan
puts on disk are stepped one at a time while staged (the next one is read while one steps, so at most
two are in host memory; :mod:`elixir.offload.pipeline`), under the disk-fault agreement points of
:mod:`elixir.wrapper.disk_faults`.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional

import torch

from elixir import device as dev
from elixir.offload.pipeline import run_pipelined
from elixir.offload.state_binding import bind_state
from elixir.wrapper.disk_faults import StepFaultPoints
from elixir.wrapper.fragments import ShardFragments
from elixir.wrapper.fused_step import fused_step, uses_fused_path
from elixir.wrapper.interfaces import ShardedOptimizer


class UpdateKernel(enum.Enum):
    """What updates a chunk's master and refreshes its compute shard; chosen once, from the inner
    optimizer and the module's shard-gradient dtype."""

    FUSED = "fused"  # elixir's native Adam: unscale, clip, step and write a low-precision shard in one pass
    PER_CHUNK = "per_chunk"  # the inner optimizer chunk by chunk, on fp32 copies of low-precision gradients
    INNER = "inner"  # the inner optimizer's own step, over every resident fragment at once


def choose_kernel(optimizer: torch.optim.Optimizer, grad_dtype: torch.dtype) -> UpdateKernel:
    """The kernel for ``optimizer`` on shard gradients of ``grad_dtype``."""
    if uses_fused_path(optimizer):
        return UpdateKernel.FUSED
    if grad_dtype != torch.float32:  # torch optimizers take no bf16/fp16 grads for fp32 params
        return UpdateKernel.PER_CHUNK
    return UpdateKernel.INNER


class ShardStepper:
    """Steps ``eo``'s fragments (``shards``) with ``kernel``; ``disk_chunks`` are staged in turn."""

    def __init__(self, eo: ShardedOptimizer, shards: ShardFragments, kernel: UpdateKernel, disk_chunks: list[int]) -> None:
        self.eo, self.shards, self.kernel, self.disk_chunks = eo, shards, kernel, disk_chunks

    def apply(self, factor: torch.Tensor) -> set[int]:
        """Step the inner optimizer with ``factor`` applied to the gradients; return the chunks whose
        compute shard is fresh."""
        disk = set(self.disk_chunks)
        if self.kernel is UpdateKernel.FUSED:
            div = 1.0 / float(factor)
            fresh = fused_step(self.eo, div, skip=disk)
            if disk:
                self.step_disk(lambda i: fused_step(self.eo, div, only=i))
            return fresh | disk
        if self.kernel is UpdateKernel.PER_CHUNK:
            self.plain_step(factor)  # scaled in the fp32 copies, not in place in low precision
            return set()
        if float(factor) != 1.0:
            for c in self.eo.module.chunks:
                if c.grad_valid and c.shard_grad is not None:
                    c.shard_grad.mul_(factor.to(c.shard_grad.device))
        self.plain_step()
        return set()

    def plain_step(self, factor: Optional[torch.Tensor] = None) -> None:
        """``optimizer.step()`` over every fragment with a gradient: one call for the resident
        chunks, then one per disk chunk while it is staged. With low-precision shard gradients
        (which torch optimizers do not take for fp32 params), one call per chunk on an fp32 copy
        of that chunk's gradients, times ``factor``."""
        optim, shards = self.eo.optim, self.shards
        if self.eo.module.grad_dtype != torch.float32:
            disk = set(self.disk_chunks)
            for c in self.eo.module.chunks:
                if c.index not in disk:
                    self.plain_chunk(c.index, factor)
            self.step_disk(lambda i: self.plain_chunk(i, factor))
            return
        if not self.disk_chunks:
            optim.step()
            return
        on_disk = {id(f.tensor) for i in self.disk_chunks for f in shards.chunk_fragments(i)}
        with shards.only(lambda p: id(p) not in on_disk):
            optim.step()

        def one(i: int) -> None:
            mine = {id(f.tensor) for f in shards.chunk_fragments(i)}
            with shards.only(lambda p: id(p) in mine):
                optim.step()

        self.step_disk(one)

    def plain_chunk(self, i: int, factor: Optional[torch.Tensor] = None) -> None:
        """Step chunk ``i``'s fragments that have a gradient with the inner optimizer, on fp32
        copies of their gradients (times ``factor``)."""
        shards = self.shards
        frags = [f for f in shards.chunk_fragments(i) if shards.grad_of(f) is not None]
        if not frags:
            return
        for f in frags:
            g = shards.grad_of(f)
            if g.dtype != f.tensor.dtype:
                g = g.to(f.tensor.dtype)
                if factor is not None and float(factor) != 1.0:
                    g.mul_(factor.to(g.device))
            f.tensor.grad = g
        mine = {id(f.tensor) for f in frags}
        try:
            with shards.only(lambda p: id(p) in mine):
                self.eo.optim.step()
        finally:
            shards.detach_grads(frags)

    def step_chunk(self, i: int) -> None:
        """Step chunk ``i`` alone with its reduced gradient (no scale, no clip) and refresh its
        compute shard: the fused backward-and-step's unit (the chunk is staged if on disk)."""
        c = self.eo.module.chunks[i]
        frags = self.shards.chunk_fragments(i)
        self.shards.attach_grads(i)
        derived = c.storage.shard_is_derived()  # KK: no shard to refresh (the next gather derives it)
        try:
            with c.storage.refreshing_shard():  # a disk shard: read in, rewritten, written back
                if self.kernel is UpdateKernel.FUSED:
                    fresh = fused_step(self.eo, 1.0, only=i)
                    written = derived or i in fresh
                else:
                    self.plain_chunk(i)
                    written = derived
                if not written and c.shard is not c.master:
                    if c.spec.master_on_disk:  # the staged master goes when this block ends
                        with torch.no_grad():
                            c.shard.copy_(c.master)
                    else:  # on the copy stream, non-blocking: step() waits for it (host and device)
                        c.refresh_from_master()
        finally:
            self.shards.detach_grads(frags)
        # ZeRO-1/2: the other ranks' updated slices, left running while backward goes on (its
        # end waits for them)
        self.eo.module.publish_updates([i], wait=False)

    def for_each_disk_chunk(self, work: Callable[[int], None], chunks: Optional[list[int]] = None) -> None:
        """Run ``work(i)`` on each disk chunk while it is staged (read-ahead pipeline), then bind
        any new optimizer state to the disk and write the chunk back."""
        def staged_work(i: int) -> None:
            work(i)
            bind_state(self.eo.disk_store, i, self.shards.fragment_states(i))

        run_pipelined(self.eo.disk_store, self.disk_chunks if chunks is None else chunks, staged_work)

    def step_disk(self, step_chunk: Callable[[int], Optional[set[int]]]) -> None:
        """Step the disk chunks that hold a gradient with ``step_chunk`` (the fused kernel's returns
        the chunks whose compute shard it wrote, others None), refreshing each compute shard while
        staged."""
        todo = [i for i in self.disk_chunks if any(self.shards.grad_of(f) is not None for f in self.shards.chunk_fragments(i))]
        # what backward freed (activations, gradient buffers) stays in malloc's heap under
        # device.keep_host_memory; staging buffers rarely fit its holes, so hand it back first
        # rather than hold both at once
        dev.release_free_host_memory()

        def work(i: int) -> None:
            c = self.eo.module.chunks[i]
            with c.storage.refreshing_shard():  # a disk shard: read in, rewritten, written back
                written = step_chunk(i)  # None but for the fused kernel
                if c.storage.shard_is_derived():
                    return  # KK: the next gather derives the shard from the stepped master
                if written is None or i not in written:  # else the kernel wrote the shard already
                    with torch.no_grad():
                        c.shard.copy_(c.master)

        module = self.eo.module
        points = StepFaultPoints(module.group, module.iteration, "optimizer step", todo)
        with self.eo.marking_torn_step():
            try:
                self.for_each_disk_chunk(points.guard(work), todo)
            except OSError as e:  # a disk fault: the store kept every value (in memory or on disk)
                points.failed(e)
            points.point(None)
