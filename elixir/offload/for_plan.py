"""The DiskStores a plan needs: per rank, one when some chunk's optimizer placement is DISK, and
one when some compute shard's placement is DISK.

Every rank opens its own offload file; a failure on any rank (unwritable directory, no space) is
agreed on with one collective and raised on every rank, so no rank is left waiting in the
collectives that follow while another has stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from elixir import distributed as edist
from elixir.chunk import MemoryLedger
from elixir.offload.directory import OffloadDirError
from elixir.offload.store import DiskStore
from elixir.plan import Placement, SearchResult, disk_bytes_per_element
from elixir.plan.state_format import frozen_shard_bytes

# bytes per element reserved up front: the fp32 master and Adam's state, as the cost model
# assumes (the optimizer is not known yet when the module is built); other optimizers' state
# grows the file as needed
RESERVE_BYTES_PER_ELEMENT = disk_bytes_per_element()


@dataclass(frozen=True)
class StoreSite:
    """Where this rank's offload stores open: its ledger, rank and group, and the directory and
    ``O_DIRECT`` choice of the module's :class:`~elixir.wrapper.OffloadPolicy`."""

    ledger: MemoryLedger
    rank: int
    world_size: int
    group: Any = None
    offload_dir: Optional[str] = None
    direct: bool = False

    def open(self, elements: list[int], bytes_per_element: int) -> Optional[DiskStore]:
        """This rank's store for disk chunks of ``elements`` elements each (None when there are
        none), reserving ``bytes_per_element`` per element (1 where ``elements`` are byte sizes). A failure to open it on any rank is
        raised on every rank: collective when there is a store to open and ``world_size > 1``."""
        if not elements:
            return None
        store, error = None, None
        try:
            store = DiskStore(self.ledger, self.offload_dir, need_bytes=sum(elements) * bytes_per_element,
                              rank=self.rank, direct=self.direct)
        except OffloadDirError as e:
            error = str(e)
        if self.world_size > 1:
            errors = edist.all_gather_object(error, self.group)
            bad = [(r, e) for r, e in enumerate(errors) if e]
            if bad and error is None:
                store.close()
                error = f"rank {bad[0][0]}: {bad[0][1]}"
        if error is not None:
            raise OffloadDirError(error)
        return store


def store_for_plan(plan: SearchResult, site: StoreSite, bytes_per_element: int = RESERVE_BYTES_PER_ELEMENT) -> Optional[DiskStore]:
    """The rank's DiskStore for ``plan``'s disk chunks (``optim_placement == DISK``: masters and
    optimizer state), or None when no chunk is on disk; ``bytes_per_element`` is reserved per
    element (less with low-precision state, :func:`elixir.plan.state_format.disk_state_bytes`)."""
    world = site.world_size
    return site.open([cp.state_size(world) for cp in plan.chunks if cp.optim_placement is Placement.DISK],
                     bytes_per_element)


def shard_store_for_plan(plan: SearchResult, site: StoreSite, element_size: int,
                         frozen_format: Optional[str] = None) -> Optional[DiskStore]:
    """The rank's DiskStore for the frozen compute shards the plan puts on disk (``shard_placement
    == DISK``; ``element_size``: bytes per compute element; ``frozen_format``: the shards are
    stored quantised, ``"nf4"`` or ``"int8"``, at that format's bytes), or None when there are
    none. A store of its own: a gather reads only the shard. (A trainable chunk's disk shard is not
    stored: it is its master cast down, :mod:`elixir.offload.derived`.)"""
    world = site.world_size
    sizes = [cp.shard_size(world) for cp in plan.frozen_chunks if cp.sharded and cp.shard_placement is Placement.DISK]
    if frozen_format is None:
        return site.open(sizes, element_size)
    return site.open([frozen_shard_bytes(frozen_format, n, element_size) for n in sizes], 1)
