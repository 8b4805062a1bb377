"""The mesh layout: how a run's ranks are arranged on named parallelism axes.

A run's ranks form a grid with four named axes, always in this order, outermost first:

========================= ==================================================================
axis                      what varies along it
========================= ==================================================================
``pp``                    the pipeline stage (each stage holds some of the model's layers)
``dp_replicate``          a replica of the sharded state (HSDP: gradients all-reduced across)
``dp_shard``              a shard of every chunk (elixir's ZeRO axis: chunks split over it)
``tp``                    a tensor-parallel slice of each layer's weights (DTensor)
========================= ==================================================================

Rank ``r``'s coordinates are ``r`` written in mixed radix with these sizes (row-major), so the
innermost axis, ``tp``, groups adjacent ranks: a tensor-parallel group sits on one node, where the
bandwidth is, and the pipeline axis spans nodes, which it crosses only with activations. This is
the order torchtitan applies its parallelisms in.

Chunks shard over ``dp_shard`` only; every other axis leaves a chunk's layout as it is. A plan
records the layout it was made for, and the runtime refuses a plan on another layout
(:meth:`MeshLayout.require_same`). A one-axis layout (``dp_shard`` = world size, every other axis
1) is plain data parallelism: what every plan was before layouts existed.

Pure data: nothing here creates a process group (``elixir.distributed.mesh_groups`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh axes a layout names, outermost first: pipeline, replicated and sharded data parallelism, tensor."""
# names other systems use for an axis (torchtitan flattens dp_replicate x dp_shard into "dp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""The pipeline schedules a mesh plan is priced for (``parallel/pipeline.py`` runs each)."""

_ALIASES = {"dp": "dp_shard", "data": "dp_shard", "tensor": "tp", "pipeline": "pp"}


class LayoutMismatchError(ValueError):
    """A plan (or a checkpoint) was made for one mesh layout and used on another."""


@dataclass(frozen=True)
class MeshLayout:
    """The sizes of the four parallelism axes (see the module docstring); each at least 1."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis} must be a positive int, got {size!r}")

    # ---- construction ----

    @classmethod
    def data_parallel(cls, world_size: int) -> MeshLayout:
        """Plain data parallelism over ``world_size`` ranks: every chunk sharded over all of them."""
        return cls(dp_shard=int(world_size))

    @classmethod
    def of(cls, value: Union[int, MeshLayout, dict[str, int]]) -> MeshLayout:
        """A layout from a world size (plain data parallelism), a layout, or ``{axis: size}``
        (unnamed axes are 1; ``"dp"`` is read as ``"dp_shard"``)."""
        if isinstance(value, MeshLayout):
            return value
        if isinstance(value, dict):
            return cls.from_sizes(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"a mesh layout is a MeshLayout, a world size or {{axis: size}}, got {type(value).__name__}")
        return cls.data_parallel(value)

    @classmethod
    def from_sizes(cls, sizes: dict[str, int]) -> MeshLayout:
        """A layout from ``{axis name: size}``; an unknown name raises, naming the axes."""
        out: dict[str, int] = {}
        for name, size in sizes.items():
            axis = canonical_axis(name)
            if axis in out:
                raise ValueError(f"mesh axis {axis} given twice (as {name!r})")
            out[axis] = int(size)
        return cls(**out)

    # ---- derived views ----

    @property
    def shape(self) -> tuple[int, ...]:
        """The four sizes in :data:`AXES` order."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(AXES, self.shape))

    @property
    def world_size(self) -> int:
        """Ranks in the whole mesh."""
        return math.prod(self.shape)

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def active_axes(self) -> tuple[str, ...]:
        """The axes with more than one rank, in :data:`AXES` order."""
        return tuple(a for a in AXES if getattr(self, a) > 1)

    @property
    def is_data_parallel(self) -> bool:
        """Only the shard axis has more than one rank: the one-axis layout of plain data parallelism."""
        return all(getattr(self, a) == 1 for a in AXES if a != "dp_shard")

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s index on each axis (row-major in :data:`AXES` order)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks ({self.describe()})")
        out: dict[str, int] = {}
        for axis in reversed(AXES):
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return {a: out[a] for a in AXES}

    def rank_at(self, coordinates: dict[str, int]) -> int:
        """The rank at ``coordinates`` (missing axes at index 0): the inverse of :meth:`coordinates`."""
        rank = 0
        for axis in AXES:
            rank = rank * getattr(self, axis) + int(coordinates.get(axis, 0))
        return rank

    def axis_ranks(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``axis``: those that differ from it on ``axis`` only."""
        coords = self.coordinates(rank)
        return tuple(self.rank_at({**coords, axis: i}) for i in range(getattr(self, canonical_axis(axis))))

    def axis_groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis``, each as its ranks in axis order, covering the mesh once."""
        axis = canonical_axis(axis)
        return [self.axis_ranks(axis, r) for r in range(self.world_size) if self.coordinates(r)[axis] == 0]

    def describe(self) -> str:
        """``"dp_shard 4"``, ``"pp 2 x dp_shard 2 x tp 2"``: the axes with more than one rank."""
        active = self.active_axes
        return " x ".join(f"{a} {getattr(self, a)}" for a in active) if active else "one rank"

    def require_same(self, other: MeshLayout, what: str, fix: str) -> None:
        """Raise :class:`LayoutMismatchError` naming both layouts unless ``other`` is this one.

        ``what`` says what carries this layout ("the plan"), ``fix`` what the user can do."""
        if other != self:
            raise LayoutMismatchError(f"{what} was made for {self.phrase()} but this run is {other.phrase()}; {fix}")

    def phrase(self) -> str:
        """``"a mesh of dp_shard 2 (2 ranks)"``, or ``"a single rank"``: the layout in a sentence."""
        return f"a mesh of {self.describe()} ({self.world_size} ranks)" if self.world_size > 1 else "a single rank"

    def require_data_parallel(self, who: str, fix: str) -> None:
        """Raise ``NotImplementedError`` unless only the ``dp_shard`` axis has more than one rank:
        for the parts of elixir that do not handle tensor, pipeline or replica axes yet. ``who``
        names the part, ``fix`` what the user can do instead."""
        if not self.is_data_parallel:
            raise NotImplementedError(f"{who} runs on a mesh of one dp_shard axis; this mesh is {self.describe()}. {fix}")

    # ---- JSON ----

    def to_json(self) -> dict[str, int]:
        return self.sizes

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MeshLayout:
        return cls.from_sizes({k: int(v) for k, v in d.items()})


def canonical_axis(name: str) -> str:
    """The axis ``name`` means (``"dp"`` is ``"dp_shard"``); an unknown name raises, naming the axes."""
    axis = _ALIASES.get(name, name)
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {name!r}; elixir's axes are {', '.join(AXES)}")
    return axis


def layout_argument(layout: MeshLayout) -> str:
    """How to name ``layout`` to a search, for error messages: ``"4"`` or ``"MeshLayout(dp_shard=2, tp=2)"``."""
    if layout.is_data_parallel:
        return str(layout.dp_shard)
    return "MeshLayout(" + ", ".join(f"{a}={getattr(layout, a)}" for a in layout.active_axes) + ")"
