"""Disk placement of fp32 masters and optimizer state (plans with ``optim_placement == DISK``).

- :mod:`elixir.offload.aio`: async file reads/writes of tensor memory (native engine or threads);
- :mod:`elixir.offload.directory`: the offload directory, checked up front; the file is unlinked
  once open, so nothing is left behind;
- :mod:`elixir.offload.store`: :class:`DiskStore`, the per-rank file and each chunk's flats;
- :mod:`elixir.offload.pipeline`: the double-buffered read-ahead used by the optimizer step;
- :mod:`elixir.offload.state_binding`: ties the optimizer's state tensors to the flats;
- :mod:`elixir.offload.for_plan`: the store a plan needs, opened on every rank (errors agreed).
"""

from elixir.offload.aio import AsyncFileIO, NativeFileIO, OffloadFile, ThreadFileIO, make_io
from elixir.offload.directory import OffloadDirError
from elixir.offload.store import DiskState, DiskStore

__all__ = [
    "AsyncFileIO", "DiskState", "DiskStore", "NativeFileIO", "OffloadDirError", "OffloadFile", "ThreadFileIO", "make_io",
]
