"""The run's mesh: a :class:`~elixir.plan.mesh.MeshLayout` with this rank's process group on each axis.

The plan carries a layout (pure data); the runtime needs groups. :func:`resolve_mesh` turns what
the user passed to ``ElixirModule`` into a :class:`RunMesh`:

- a process group, or nothing (the world): plain data parallelism, every chunk sharded over that
  group, which is the ``dp_shard`` axis of a one-axis layout. No group is created, so a one-axis
  run issues exactly the collectives it did before layouts existed;
- a ``torch.distributed.device_mesh.DeviceMesh`` whose dimensions are named after elixir's axes
  (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``; ``dp`` is read as ``dp_shard``): each axis's
  group is the mesh's own, and an axis the mesh lacks has one rank.

Every layer below takes its group from here: chunks and the gradient norm use :attr:`RunMesh.shard_group`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from elixir import distributed as edist
from elixir.plan import AXES, MeshLayout
from elixir.plan.mesh import LayoutMismatchError, canonical_axis


@dataclass(frozen=True)
class RunMesh:
    """This rank's place on the mesh: the layout, its coordinate and its group on each axis."""

    layout: MeshLayout
    coordinates: dict[str, int]
    groups: dict[str, Any] = field(default_factory=dict)  # axis -> ProcessGroup (None: the default world)
    device_mesh: Optional[Any] = None  # the DeviceMesh it came from, if any

    @property
    def shard_group(self) -> edist.ProcessGroup:
        """The group every chunk is sharded over (the ``dp_shard`` axis)."""
        return self.groups.get("dp_shard")

    @property
    def shard_rank(self) -> int:
        return self.coordinates["dp_shard"]

    @property
    def shard_world(self) -> int:
        return self.layout.dp_shard

    def group(self, axis: str) -> edist.ProcessGroup:
        """The group of ``axis`` (an axis of one rank has no group: None, never used for a collective)."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; elixir's axes are {', '.join(AXES)}")
        return self.groups.get(axis)


def require_runnable(layout: MeshLayout) -> None:
    """Refuse a mesh with a pipeline or replica axis: the chunk runtime shards over ``dp_shard``
    and runs tensor-parallel (DTensor) parameters on ``tp`` (:mod:`elixir.wrapper.dtensor_params`);
    a pipeline stage is wrapped over its own sub-mesh (the ``pp`` axis is not ElixirModule's)."""
    if layout.pp > 1 or layout.dp_replicate > 1:
        raise NotImplementedError(
            f"ElixirModule runs on a mesh of dp_shard and tp axes; this mesh is {layout.describe()}. Pass the "
            "sub-mesh of one pipeline stage and replica (mesh['dp_shard', 'tp'], or mesh['dp_shard']), or its "
            "process group"
        )


def tp_mesh(run: RunMesh):
    """The 1-D ``tp`` sub-mesh of the run's DeviceMesh (None without one)."""
    dm = run.device_mesh
    names = [n for n in (dm.mesh_dim_names or ()) if canonical_axis(n) == "tp"] if dm is not None else []
    if not names:
        return None
    return dm[names[0]] if dm.ndim > 1 else dm


def resolve_mesh(process_group: edist.ProcessGroup = None, device_mesh: Optional[Any] = None) -> RunMesh:
    """The :class:`RunMesh` of a process group (or the world) or of a named ``DeviceMesh``."""
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group or mesh to ElixirModule, not both")
        return _from_device_mesh(device_mesh)
    world = edist.get_world_size(process_group)
    layout = MeshLayout.data_parallel(world)
    coords = {a: 0 for a in AXES}
    coords["dp_shard"] = edist.get_rank(process_group)
    return RunMesh(layout, coords, {"dp_shard": process_group})


def _from_device_mesh(mesh: Any) -> RunMesh:
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise ValueError(
            "ElixirModule needs a DeviceMesh whose dimensions are named after elixir's axes "
            f"({', '.join(AXES)}): init_device_mesh(..., mesh_dim_names=(...))"
        )
    try:
        layout = MeshLayout.from_sizes(dict(zip(names, mesh.shape)))
    except ValueError as e:
        raise LayoutMismatchError(f"DeviceMesh dimensions {names}: {e}") from None
    order = [canonical_axis(n) for n in names]
    if order != [a for a in AXES if a in order]:
        raise LayoutMismatchError(
            f"DeviceMesh dimensions {names} are not in elixir's axis order ({', '.join(AXES)}, outermost first)"
        )
    coords = {a: 0 for a in AXES}
    groups: dict[str, Any] = {}
    for name, axis in zip(names, order):
        coords[axis] = mesh.get_local_rank(name)
        groups[axis] = mesh.get_group(name)
    return RunMesh(layout, coords, groups, device_mesh=mesh)

