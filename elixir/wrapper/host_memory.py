"""The host-allocator policy of one ElixirModule: keep freed host memory, or give it back.

One owner for the three decisions that follow from the plan and the device, which the facade used
to interleave with everything else it built:

- **keep or return.** A plan that streams from disk (optimizer state on disk, or frozen shards read
  at each gather) gives freed blocks back at once: its staging buffers churn through malloc's heap,
  and the holes they left made the peak RSS exceed every count of the bytes in use (issue 21).
  Every other plan keeps freed host memory (no page faults per gathered chunk and gradient buffer).
- **pool gradient buffers** (``chunk.GradBufferPool``) on a CPU device, not for plans that stream
  from disk (they give memory back at once).
- **trim after backward** when streaming from disk, or when sharded chunks are gathered into host
  memory (a CPU device): the gathered payloads churn through the heap every step.

Invariant: the search counts live bytes, so whatever the heap holds free beyond them is either
reused at once (kept) or handed back by the end of the backward that freed it (trimmed).
"""

from __future__ import annotations

from typing import Any

import torch

from elixir import device as dev
from elixir.plan import Placement


class HostMemoryPolicy:
    """What this module does with freed host memory, decided once from ``plan`` (a SearchResult)."""

    def __init__(self, plan: Any, device: torch.device, world_size: int) -> None:
        # Streaming from disk: optimizer state, or frozen shards read at each gather (a LoRA plan
        # whose base is on disk has no trainable disk chunk, and was kept out of this until
        # issue 19 found its heap slack 2x the activations at hidden 6144: peak RSS above the
        # prediction, growing step after step).
        self.streams_from_disk = (any(cp.optim_placement is Placement.DISK for cp in plan.chunks)
                                  or any(cp.shard_placement is Placement.DISK for cp in plan.frozen_chunks))
        # recycled gradient buffers on a CPU device (not for plans that stream from disk, which
        # give memory back at once): elixir/chunk/buffers.py
        self.pool_grad_buffers = device.type == "cpu" and not self.streams_from_disk
        # sharded chunks gathered into host memory (a CPU device): their payloads churn through
        # malloc's heap every step, so backward's end trims it (see after_backward)
        self.gathers_on_host = device.type == "cpu" and world_size > 1 and any(
            cp.sharded for cp in list(plan.chunks) + list(plan.frozen_chunks))

    def apply(self) -> None:
        """Set the process's host allocator for this plan (before the runtime allocates)."""
        if not self.streams_from_disk:
            # reuse freed host memory: no page faults per gathered chunk and gradient buffer. Not
            # with disk chunks: their staging buffers churn through malloc's heap, and the holes
            # they leave made the peak RSS exceed every count of the bytes in use (issue 21).
            dev.keep_host_memory()
        else:  # give freed blocks back at once (the search counts live bytes), and trim after backward
            dev.return_host_memory()

    def after_backward(self) -> None:
        """End of backward: trim the heap where this plan churns through it."""
        if self.streams_from_disk or self.gathers_on_host:
            # backward freed the activations (and, with sharded chunks, the gathered payloads,
            # which malloc's heap did not reuse: GPT-2 medium in 18 MB chunks grew 0.25-0.75
            # GiB a step, to 6.1 GiB for a 4.6 GiB plan, 4.8 trimmed): hand the heap's free
            # pages back now, so the holes they leave are not resident beside the next step's
            # (the search counts live bytes)
            dev.release_free_host_memory()
