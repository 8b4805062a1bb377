"""What one backward of an :class:`~elixir.wrapper.ElixirModule` has seen so far, and where the
module stands in its training step: an explicit :class:`TrainingState` with checked transitions.

Forward marks the parameters it uses as *expected* to get a gradient; backward marks them as they
*arrive*. A chunk whose expected gradients have all arrived can be reduced early; the end of
backward agrees across ranks on the rest. Gradients that arrive under ``no_sync`` are remembered
(``local_arrived``) until the next synchronising backward reduces them.
"""

from __future__ import annotations

import enum
from typing import Callable, Sequence

from elixir.chunk.state import IllegalTransition


class TrainingState(enum.Enum):
    """Where an ElixirModule stands within a training step.

    ``IDLE -> FORWARD -> IDLE`` for each forward outside backward; ``IDLE -> BACKWARD`` when the
    first backward hook or gradient of a step fires (the end-of-backward callback is queued then);
    ``BACKWARD -> FINALIZING -> IDLE`` in that callback. A forward during backward (recomputation
    under activation checkpointing) leaves the state at ``BACKWARD``; a backward started inside a
    forward (``FORWARD -> BACKWARD``) is allowed.
    """

    IDLE = "idle"  # between steps
    FORWARD = "forward"  # inside ElixirModule.forward, outside backward
    BACKWARD = "backward"  # backward is running; the end-of-backward callback is queued
    FINALIZING = "finalizing"  # the end-of-backward callback: agreeing across ranks, reducing the rest


_MOVES = {
    TrainingState.IDLE: {TrainingState.FORWARD, TrainingState.BACKWARD},
    TrainingState.FORWARD: {TrainingState.IDLE, TrainingState.BACKWARD},
    TrainingState.BACKWARD: {TrainingState.FINALIZING},
    TrainingState.FINALIZING: {TrainingState.IDLE},
}


class BackwardTracker:
    """Per-backward gradient bookkeeping of one module's trainable parameters (by slot index) and
    chunks, with the module's :class:`TrainingState`."""

    def __init__(self, chunk_of: Sequence[int], params_of: Sequence[Sequence[int]]) -> None:
        self.chunk_of = list(chunk_of)  # slot index -> chunk index
        self.params_of = [list(p) for p in params_of]  # chunk index -> slot indices
        self.state = TrainingState.IDLE
        self.local_arrived = [False] * len(self.chunk_of)  # got a gradient under no_sync, not yet reduced
        self.reset()

    def reset(self) -> None:
        """Forget this backward's arrivals (not ``local_arrived``)."""
        n, k = len(self.chunk_of), len(self.params_of)
        self.expected = [False] * n
        self.arrived = [False] * n
        self._n_expected = [0] * k
        self._n_arrived = [0] * k
        self.ready = [False] * k  # chunks announced to the grad-ready hooks this backward
        self.uniform = [True] * k  # every parameter used on every rank or on none (agree_on_uses)

    # ---- state ----

    def move(self, new: TrainingState) -> None:
        if new is not self.state and new not in _MOVES[self.state]:
            raise IllegalTransition(f"elixir module: illegal training-state transition {self.state.name} -> {new.name}")
        self.state = new

    @property
    def in_backward(self) -> bool:
        return self.state in (TrainingState.BACKWARD, TrainingState.FINALIZING)

    # ---- arrivals ----

    def expect(self, i: int) -> None:
        """Forward used parameter ``i``: its gradient is expected this backward."""
        if not self.expected[i]:
            self.expected[i] = True
            self._n_expected[self.chunk_of[i]] += 1

    def arrive(self, i: int) -> bool:
        """Parameter ``i``'s gradient arrived; whether its chunk now has every expected gradient."""
        self.expect(i)
        ci = self.chunk_of[i]
        if not self.arrived[i]:
            self.arrived[i] = True
            self._n_arrived[ci] += 1
        return self._n_arrived[ci] == self._n_expected[ci]

    def agree_on_uses(self, count_ranks: Callable[[list[int]], list[int]], world: int) -> None:
        """Start of a synchronising backward at world size > 1: ``count_ranks`` (a SUM all-reduce)
        tells, per parameter, how many ranks' forwards used it. A chunk with a parameter used on
        some ranks only completes at different times on different ranks (never, where it is
        unused), so reducing it early would issue the ranks' collectives in different orders (gloo
        aborted: "Received data size doesn't match expected size"); such a chunk waits for the end
        of backward, where every rank reduces it in plan order (a rank without its gradient
        contributing zeros). The others reduce early, as before."""
        counts = count_ranks([int(e) for e in self.expected])
        for ci, params in enumerate(self.params_of):
            self.uniform[ci] = all(counts[i] in (0, world) for i in params)

    def chunk_complete(self, ci: int) -> bool:
        """Every parameter of chunk ``ci`` got its gradient here this backward."""
        return all(self.arrived[i] for i in self.params_of[ci])

    def arrived_or_local(self) -> list[bool]:
        """Per parameter: a gradient arrived this backward or under an earlier ``no_sync``."""
        return [a or b for a, b in zip(self.arrived, self.local_arrived)]
