"""The runtime's parts: chunks, states, the rCache, the traced schedule and byte accounting.

Nothing here knows about models; :mod:`elixir.wrapper` maps modules and parameters onto chunks.
"""

from elixir.chunk.accounting import ElixirMemoryError, MemoryLedger
from elixir.chunk.buffers import GradBufferPool
from elixir.chunk.cache import BlockCache
from elixir.chunk.chunk import Chunk
from elixir.chunk.comm import ChunkComm
from elixir.chunk.grads import ChunkGrads
from elixir.chunk.schedule import Schedule, collapse, learned_schedule
from elixir.chunk.spec import ChunkSpec
from elixir.chunk.state import ChunkKind, ChunkState, GradState, IllegalTransition
from elixir.chunk.storage import ChunkStorage

__all__ = [
    "BlockCache", "Chunk", "ChunkComm", "ChunkGrads", "ChunkKind", "ChunkSpec", "ChunkStorage", "ChunkState", "ElixirMemoryError", "GradBufferPool",
    "GradState", "IllegalTransition", "MemoryLedger", "Schedule", "collapse", "learned_schedule",
]
