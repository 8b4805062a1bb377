"""The static description of one chunk on one rank: what it holds, how it is split, where it lives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from elixir.chunk.state import ChunkKind
from elixir.plan import MeshLayout, Placement, ShardedBy, Sharding, placement_problem
from elixir.plan.footprint import collectives


@dataclass(frozen=True)
class ChunkSpec(ShardedBy):
    """Static description of one chunk on one rank.

    Attributes:
        index: position of the chunk in the plan.
        capacity: elements, padding included (a multiple of :attr:`shard_world` when any state is split).
        sharding: what is split across ranks (:class:`~elixir.plan.Sharding`: the payload
            for ``SHARDED``; master, gradient and optimizer state for every sharding but ``REPLICATED``);
            a bool is read as the older ``sharded`` flag.
        layout: the mesh layout of the run (:class:`~elixir.plan.mesh.MeshLayout`; an int is read as
            plain data parallelism over that many ranks). A chunk is split over its ``dp_shard``
            axis only (:attr:`shard_world`).
        rank: this rank's index on the ``dp_shard`` axis.
        dtype: compute dtype of payload and shard.
        reduce_dtype: dtype gradients are reduced in.
        grad_dtype: dtype of the reduced shard gradient kept until the optimizer step (fp32, or
            bf16/fp16 to halve its bytes: exact when it equals ``reduce_dtype`` and nothing is
            accumulated across backwards; otherwise the fp32 sum is rounded once per backward).
        device: the compute device.
        shard_placement: where a sharded chunk's compute shard lives between uses, as in the plan
            (:class:`~elixir.plan.Placement`); a chunk whose parameters are whole keeps them on
            the device (read as ``DEVICE`` whatever is given). On ``DISK`` the shard lives in an
            offload file (:attr:`Chunk.shard_store`), read into host memory only while it is
            gathered or written (the optimizer step, a load) and dropped after: the chunk then
            holds no resident bytes between uses.
        optim_placement: where the fp32 master shard (and the optimizer state) live. On ``DISK``
            they live in an offload file and are staged in host memory only while used
            (:mod:`elixir.offload`), in a resizable host tensor of its own. A frozen chunk has
            none (read as ``DEVICE``).
        pin_memory: page-lock host tensors (only matters with an accelerator).
        kind: trainable, or frozen (weights only; the master and gradient fields are unused).
        master_dtype: dtype of the master the optimizer updates: fp32, or bf16 for the lossy
            master formats (:mod:`elixir.plan.state_format`).
        frozen_format: a frozen chunk's shard stored quantised (``"nf4"`` or ``"int8"``,
            :mod:`elixir.chunk.quant`) and dequantised into the payload at each gather; such a
            chunk is always sharded (its payload is transient, even at world size 1). None: the
            shard holds compute-dtype values.
        filled: elements holding parameters, a prefix of the flat chunk; the rest is padding that
            stays zero (an offload file transfers only the filled part). None: the whole capacity.
    """

    index: int
    capacity: int
    sharding: Sharding
    layout: MeshLayout
    rank: int
    dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    shard_placement: Placement = Placement.DEVICE
    optim_placement: Placement = Placement.DEVICE
    pin_memory: bool = True
    kind: ChunkKind = ChunkKind.TRAINABLE
    master_dtype: torch.dtype = torch.float32
    frozen_format: Optional[str] = None
    filled: Optional[int] = None

    @property
    def frozen(self) -> bool:
        return self.kind is ChunkKind.FROZEN

    @property
    def shard_category(self) -> str:
        """The ledger category of this chunk's shard."""
        return "frozen_shard" if self.frozen else "shard"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding", Sharding.of(self.sharding))
        object.__setattr__(self, "layout", MeshLayout.of(self.layout))
        object.__setattr__(self, "shard_placement", Placement(self.shard_placement) if self.sharded else Placement.DEVICE)
        object.__setattr__(self, "optim_placement", Placement.DEVICE if self.frozen else Placement(self.optim_placement))
        if self.frozen_format is not None and not (self.frozen and self.sharding.params_sharded):
            raise ValueError(f"chunk {self.index}: only a sharded frozen chunk is stored quantised "
                             f"({self.frozen_format}); this one is {self.sharding.value}{' frozen' if self.frozen else ''}")
        problem = placement_problem(self.sharding, self.shard_placement, self.optim_placement, frozen=self.frozen)
        if problem:
            raise ValueError(f"chunk {self.index}: {problem}")

    @property
    def shard_on_host(self) -> bool:
        """The compute shard lives off the device between uses (in host memory, or on disk)."""
        return self.shard_placement is not Placement.DEVICE

    @property
    def shard_on_disk(self) -> bool:
        return self.shard_placement is Placement.DISK

    @property
    def master_on_host(self) -> bool:
        """The fp32 master lives off the device (in host memory, or on disk and staged there)."""
        return self.optim_placement is not Placement.DEVICE

    @property
    def master_on_disk(self) -> bool:
        return self.optim_placement is Placement.DISK

    @property
    def shard_world(self) -> int:
        """Ranks this chunk is split over (the layout's ``dp_shard`` axis)."""
        return self.layout.dp_shard

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's master and reduced gradient (and of its payload shard when sharded)."""
        return self.capacity // self.shard_world if self.state_sharded else self.capacity

    @property
    def shard_offset(self) -> int:
        """Offset of this rank's shard in the flat chunk."""
        return self.rank * self.shard_numel if self.state_sharded else 0

    @property
    def shard_filled(self) -> int:
        """Elements of this rank's shard that hold parameters (the rest is padding: zero)."""
        filled = self.capacity if self.filled is None else self.filled
        return max(0, min(self.shard_numel, filled - self.shard_offset))

    @property
    def publishes(self) -> bool:
        """Whole parameters but a split master (ZeRO-1/2): after a step every rank's updated slice
        is all-gathered into every payload (:meth:`Chunk.publish`; the footprint rule's
        :func:`~elixir.plan.footprint.collectives`, which the cost model prices)."""
        return collectives(self.sharding, self.shard_world, self.shard_placement, self.frozen).publishes
