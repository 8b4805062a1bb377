"""Byte accounting for the runtime's own tensors, with an optional device-memory budget.

Every tensor the runtime allocates or frees for chunks goes through a :class:`MemoryLedger`, by
category (``shard``, ``master``, ``gathered``, ``grad_buffer``, ``shard_grad``, and
``frozen_shard`` for the shards of frozen chunks) and location
(``device`` or ``host``). The ledger keeps the current and peak bytes of each, and of the device
total, and can refuse an allocation that would exceed a budget (used to emulate small accelerators
on a CPU box).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

CATEGORIES = ("shard", "master", "gathered", "grad_buffer", "shard_grad", "frozen_shard")
LOCATIONS = ("device", "host")


class ElixirMemoryError(MemoryError):
    """An allocation would exceed the configured device-memory budget."""


class MemoryLedger:
    """Current and peak bytes per (category, location), and the device total."""

    def __init__(self, device_limit: Optional[int] = None) -> None:
        self.device_limit = device_limit
        self.current: dict[tuple[str, str], int] = defaultdict(int)
        self.peak: dict[tuple[str, str], int] = defaultdict(int)
        self.device_total = 0
        self.device_peak = 0

    def alloc(self, category: str, location: str, nbytes: int, what: str = "") -> None:
        if category not in CATEGORIES or location not in LOCATIONS:
            raise ValueError(f"unknown ledger entry ({category!r}, {location!r})")
        if location == "device":
            if self.device_limit is not None and self.device_total + nbytes > self.device_limit:
                raise ElixirMemoryError(
                    f"elixir device-memory budget exceeded allocating {nbytes} B for {category}"
                    f"{' (' + what + ')' if what else ''}: {self.device_total} B in use of a "
                    f"{self.device_limit} B budget ({self.summary()}). Use a plan with fewer cache "
                    f"blocks, smaller chunks or host placement, or raise the budget."
                )
            self.device_total += nbytes
            self.device_peak = max(self.device_peak, self.device_total)
        key = (category, location)
        self.current[key] += nbytes
        self.peak[key] = max(self.peak[key], self.current[key])

    def free(self, category: str, location: str, nbytes: int) -> None:
        key = (category, location)
        if self.current[key] < nbytes:
            raise RuntimeError(f"ledger underflow freeing {nbytes} B of {key} (have {self.current[key]} B)")
        self.current[key] -= nbytes
        if location == "device":
            self.device_total -= nbytes

    def bytes(self, category: str, location: Optional[str] = None, peak: bool = False) -> int:
        table = self.peak if peak else self.current
        locs = LOCATIONS if location is None else (location,)
        return sum(table[(category, loc)] for loc in locs)

    def reset_peaks(self) -> None:
        for key in list(self.peak):
            self.peak[key] = self.current[key]
        self.device_peak = self.device_total

    def summary(self) -> str:
        parts = [f"{c}@{loc}={n}" for (c, loc), n in sorted(self.current.items()) if n]
        return ", ".join(parts) or "nothing allocated"
