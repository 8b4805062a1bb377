"""Disk faults while the optimizer steps disk chunks, raised on every rank at the same chunk.

A pass over the disk chunks (the optimizer step's loop, or the fused backward-and-step) stages
each chunk, steps it and writes it back, with transfers overlapped. A transfer can fail on one rank
only, and then every rank must stop at the same point: a rank that went on would wait in its next
collective for the one that raised, and a sharded chunk (one tensor cut across the ranks) must be
stepped on every rank or on none. So the ranks agree (:func:`elixir.distributed.agree_on_disk_fault`,
one one-element all-reduce) at fixed points, the same on every rank:

- before each disk chunk is stepped. A rank whose staging of that chunk failed (its read, or the
  previous chunk's write, which finishes then) agrees with its error in place of that point;
- once after the pass. A fault after a chunk's point (its own write, the last write of the pass)
  is reported at the next point.

When a point finds a fault, :class:`~elixir.distributed.DiskFault` is raised on every rank, and the
state is the same on every rank: the chunks stepped before that point hold this step's values (a
chunk whose write failed keeps them in memory, none is lost), the chunk at the point and the ones
after it hold the last step's. That partial step is what a checkpoint saved now holds; training on
from it is refused (:attr:`ElixirOptimizer.torn_step`) until a checkpoint is loaded.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from elixir import distributed as edist


def partial_step_advice(step: int, chunk: Optional[int]) -> str:
    """What a rank's message says after a fault at ``chunk``'s point (None: after the pass)."""
    at = (f"chunk {chunk} and the disk chunks after it still hold step {step - 1}'s values, the chunks stepped before "
          f"it hold step {step}'s" if chunk is not None else f"every chunk holds step {step}'s values, but a write failed")
    return (f"; step {step} is partly applied, the same on every rank: {at} (nothing is lost: a chunk whose write "
            "failed keeps its values in memory); restart from the last checkpoint saved before this step "
            "(a new process, or checkpoint.load here); "
            "a checkpoint saved now holds this partial step, and this optimizer steps again only after a "
            "checkpoint is loaded")


class StepFaultPoints:
    """The agreement points of one pass over disk chunks in step ``step`` (see the module docstring)."""

    def __init__(self, group, step: int, during: str, order: Optional[Sequence[int]] = None) -> None:
        self.group = group
        self.step = step
        self.during = during
        self.order = list(order) if order is not None else None  # the pass's chunks, when known ahead
        self.pending: Optional[OSError] = None  # a fault after the last point, for the next one
        self.passed: Optional[int] = None  # the chunk whose point was passed last

    def guard(self, work: Callable[[int], None]) -> Callable[[int], None]:
        """``work(i)`` behind chunk ``i``'s point."""

        def guarded(i: int) -> None:
            self.point(i)
            self.passed = i
            work(i)

        return guarded

    def failed(self, error: OSError, chunk: Optional[int] = None, defer: bool = False) -> None:
        """The pass raised ``error`` (on ``chunk``, the chunk it was staging or stepping, where the
        order is not known ahead). Raised now in place of the next point on every rank, or, with
        ``defer`` and ``chunk``'s point passed already (the other ranks go on to other collectives
        before the next point), left for the next point."""
        if isinstance(error, edist.DiskFault):
            raise error  # agreed already: every rank raises it
        if defer and chunk is not None and self.passed == chunk:
            self.pending = self.pending or error
            return
        if chunk is None or self.passed == chunk:
            chunk = self._after(self.passed)
        self.point(chunk, error)

    def _after(self, chunk: Optional[int]) -> Optional[int]:
        if self.order is None:
            return None
        if chunk is None:
            return self.order[0] if self.order else None
        k = self.order.index(chunk) + 1
        return self.order[k] if k < len(self.order) else None

    def point(self, chunk: Optional[int], error: Optional[OSError] = None) -> None:
        """An agreement point before ``chunk`` is stepped (None: after the pass)."""
        error, self.pending = error or self.pending, None
        where = f"step {self.step}, {self.during}" + (f", before stepping chunk {chunk}" if chunk is not None else "")
        edist.agree_on_disk_fault(error, self.group, where, partial_step_advice(self.step, chunk))
