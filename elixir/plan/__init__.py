"""The plan: plain, typed data that a search produces and the runtime executes (floor 1).

Nothing here touches a device or a process group: the plan's types, its one dtype table, the
mesh layout a plan is made for (:class:`MeshLayout`), and the footprint rule
(:mod:`elixir.plan.footprint`: what a chunk holds and which collectives it issues).
"""

from elixir.plan.footprint import (
    ADAM_STATE_BYTES,
    DERIVED_SHARD_PIECE_ELEMENTS,
    MASTER_BYTES,
    disk_bytes_per_element,
)
from elixir.plan.mesh import AXES, LayoutMismatchError, MeshLayout
from elixir.plan.placement import ChunkPlacement
from elixir.plan.plan import (
    CHUNKABLE_DTYPES,
    PLAN_FORMAT_VERSION,
    ChunkPlan,
    Placement,
    Prediction,
    SearchResult,
    ShardedBy,
    Sharding,
    dtype_from_name,
    dtype_name,
    placement_problem,
)

__all__ = [
    "ChunkPlacement", "AXES", "LayoutMismatchError", "MeshLayout", "ADAM_STATE_BYTES", "CHUNKABLE_DTYPES",
    "DERIVED_SHARD_PIECE_ELEMENTS", "MASTER_BYTES", "PLAN_FORMAT_VERSION", "ChunkPlan", "Placement",
    "Prediction", "SearchResult", "ShardedBy", "Sharding", "disk_bytes_per_element", "dtype_from_name",
    "dtype_name", "placement_problem",
]
