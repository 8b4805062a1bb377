"""The DiskStores a plan needs: per rank, one when some chunk's optimizer placement is DISK, and
one when some compute shard's placement is DISK.

Every rank opens its own offload file; a failure on any rank (unwritable directory, no space) is
agreed on with one collective and raised on every rank, so no rank is left waiting in the
collectives that follow while another has stopped.
"""

from __future__ import annotations

from typing import Optional

from elixir import distributed as edist
from elixir.chunk import MemoryLedger
from elixir.offload.directory import OffloadDirError
from elixir.offload.store import DiskStore
from elixir.search.plan import Placement, SearchResult, disk_bytes_per_element

# bytes per element reserved up front: the fp32 master and Adam's state, as the cost model
# assumes (the optimizer is not known yet when the module is built); other optimizers' state
# grows the file as needed
RESERVE_BYTES_PER_ELEMENT = disk_bytes_per_element()


def store_for_plan(
    plan: SearchResult,
    ledger: MemoryLedger,
    rank: int,
    world_size: int,
    group=None,
    offload_dir: Optional[str] = None,
    direct: bool = False,
) -> Optional[DiskStore]:
    """The rank's DiskStore for ``plan``'s disk chunks, or None when no chunk is on disk.
    Collective when some chunk is on disk and ``world_size > 1``."""
    on_disk = [cp for cp in plan.chunks if cp.optim_placement is Placement.DISK]
    if not on_disk:
        return None
    elements = sum(cp.state_size(world_size) for cp in on_disk)
    return _open_agreed(ledger, elements * RESERVE_BYTES_PER_ELEMENT, rank, world_size, group, offload_dir, direct)


def shard_store_for_plan(
    plan: SearchResult,
    ledger: MemoryLedger,
    rank: int,
    world_size: int,
    element_size: int,
    group=None,
    offload_dir: Optional[str] = None,
    direct: bool = False,
) -> Optional[DiskStore]:
    """The rank's DiskStore for the compute shards the plan puts on disk (``shard_placement ==
    DISK``; ``element_size``: bytes per compute element), or None when there are none. A store of
    its own: a gather reads only the shard, not the master and optimizer state beside it.
    Collective when some shard is on disk and ``world_size > 1``."""
    on_disk = [cp for cp in plan.all_chunks if cp.sharded and cp.shard_placement is Placement.DISK]
    if not on_disk:
        return None
    elements = sum(cp.shard_size(world_size) for cp in on_disk)
    return _open_agreed(ledger, elements * element_size, rank, world_size, group, offload_dir, direct)


def _open_agreed(ledger, need_bytes: int, rank: int, world_size: int, group, offload_dir, direct: bool) -> DiskStore:
    """Open this rank's store; a failure on any rank is raised on every rank (one collective)."""
    store, error = None, None
    try:
        store = DiskStore(ledger, offload_dir, need_bytes=need_bytes, rank=rank, direct=direct)
    except OffloadDirError as e:
        error = str(e)
    if world_size > 1:
        errors = edist.all_gather_object(error, group)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad and error is None:
            store.close()
            error = f"rank {bad[0][0]}: {bad[0][1]}"
    if error is not None:
        raise OffloadDirError(error)
    return store
