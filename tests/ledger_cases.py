"""What the runtime holds at once during training, for tests that hold a plan's predicted peak to it
(not a test file): :func:`live_peak`."""

from __future__ import annotations

from typing import Callable

from elixir.tracer.hooks import install_step_hooks


def live_peak(em, step: Callable[[int], None], step_activations, steps: int = 2,
              resident_state: bool = False) -> int:
    """The most bytes live at once over ``steps`` calls of ``step(i)`` (one training step each):
    at every allocation the runtime books, what its own counts hold (the ledger: shards, masters,
    rCache, gradient buffers, shard gradients; the staged optimizer state, which the disk store
    counts with the masters the ledger books; the derived shards' read buffers), plus the traced
    activations of the step the model is in (counted by the step hooks the tracer and runtime
    share: the runtime cannot count them). ``resident_state``: add the optimizer state held in
    memory (``memory_report()["optimizer_state_bytes"]``, which the ledger does not book), for
    plans whose state is not on disk."""
    peak, t = 0, -1
    ledger, alloc = em.ledger, em.ledger.alloc

    def on_step(*_):
        nonlocal t
        t = min(t + 1, len(step_activations) - 1)

    def watch(*a, **k):
        nonlocal peak
        alloc(*a, **k)
        state = (em.disk_store.staged_bytes - ledger.bytes("master", "host")) if em.disk_store is not None else 0
        pieces = em.derived_shards.read_buffer_bytes if em.derived_shards is not None else 0
        held = em.memory_report()["optimizer_state_bytes"] if resident_state else 0
        peak = max(peak, sum(ledger.current.values()) + max(0, state) + pieces + held + step_activations[max(t, 0)])

    hooks = install_step_hooks(em.module, on_forward=on_step, on_backward=on_step)
    ledger.alloc = watch
    try:
        for i in range(steps):
            t = -1
            step(i)
    finally:
        ledger.alloc = alloc
        hooks.remove()
    return peak
