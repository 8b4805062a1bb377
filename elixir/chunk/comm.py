"""The collectives of chunks on one device and one backend: gather payloads, reduce gradients, publish.

:class:`ChunkComm` holds no tensor and no chunk state: given a chunk's tensors it issues the
collective over the chunk's group (the mesh's ``dp_shard`` axis) through :mod:`elixir.distributed`,
on the right side stream. What differs by device and backend is decided here, once:

- **on an accelerator** (NCCL) collectives run on the gather and reduce side streams, so they are
  already asynchronous to compute: a reduction is never *deferred*;
- **on a CPU device** (gloo) collectives run on the backend's own thread: a reduction may be issued
  with ``async_op`` and left running while backward goes on (:attr:`defers_reductions`), and a
  ZeRO-1/2 publish likewise.

A coalesced path (one NCCL group call for several chunks, as FSDP2's ``foreach_all_gather``) is a
method here, not a branch in the chunk.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import torch

from elixir import device as dev
from elixir import distributed as edist


class ChunkComm:
    """The collectives of the chunks of one process group on one device (see the module docstring)."""

    def __init__(self, group: edist.ProcessGroup, world: int, device: torch.device) -> None:
        self.group = group
        self.world = world
        self.device = torch.device(device)
        # collectives issued, by kind ("all_gather" for use, "publish", "reduce_scatter",
        # "all_reduce"): what the cost model's footprint.collectives counts (tests compare them)
        self.issued: Counter[str] = Counter()

    @property
    def defers_reductions(self) -> bool:
        """Whether a reduction or a publish may be left running on the backend's thread: on a CPU
        device at world size > 1. On an accelerator it is already asynchronous on its stream."""
        return self.world > 1 and not dev.is_accelerator(self.device)

    def all_gather(self, payload: torch.Tensor, mine: torch.Tensor, async_op: bool = False) -> Any:
        """Every rank's ``mine`` into ``payload``, in rank order; a work handle with ``async_op``."""
        self.issued["all_gather"] += 1
        return edist.all_gather_into(payload, mine, self.group, async_op=async_op)

    def publish(self, payload: torch.Tensor, mine: torch.Tensor, async_op: bool = False) -> Any:
        """A ZeRO-1/2 chunk's updated slice ``mine`` from every rank into its whole ``payload``
        (an all-gather after the optimizer step)."""
        self.issued["publish"] += 1
        return edist.all_gather_into(payload, mine, self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, buf: torch.Tensor, async_op: bool = False) -> Any:
        """The sum over ranks of ``buf``'s ``world`` equal parts, this rank's part into ``out``."""
        self.issued["reduce_scatter"] += 1
        return edist.reduce_scatter_into(out, buf, self.group, async_op=async_op)

    def all_reduce(self, buf: torch.Tensor, async_op: bool = False) -> Any:
        """The sum over ranks of ``buf``, in place."""
        self.issued["all_reduce"] += 1
        return edist.all_reduce(buf, self.group, async_op=async_op)

    def agree_on_disk_fault(self, error: Optional[OSError], during: str, then: str) -> None:
        """Raise :class:`~elixir.distributed.DiskFault` on every rank if any rank's disk read failed."""
        edist.agree_on_disk_fault(error, self.group, during, then)

    @staticmethod
    def wait(work: Any) -> None:
        edist.wait_work(work)
