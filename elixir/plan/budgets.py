"""What a plan must fit in: per-rank budgets, the margins held back from them, and the refusal when
no plan can fit.

The search (``search/optimal.py``) refuses a budget with :class:`DoesNotFitError` after tracing the
step; :func:`untraced_refusal` refuses the same way before anything is traced, when the parameters
alone, counted by the footprint rule at their leanest, already exceed the budgets (issue 35: an
impossible budget took 95 s, then 6.9 s, mostly importing and tracing the model, to be refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from elixir.hardware.profile import HardwareProfile
from elixir.plan.footprint import element_bytes, optimizer_state_bytes, state_floor_bytes
from elixir.plan.state_format import FP32_STATE, is_lossy
from elixir.tables import human_count

INF = 1 << 62
"""A budget without a limit (bytes)."""


class DoesNotFitError(ValueError):
    """No configuration fits the budgets. ``suggestions`` lists changes that would fit, smallest first."""

    def __init__(self, message: str, suggestions: list[str], needs: dict[str, Any]) -> None:
        super().__init__(message)
        self.suggestions = suggestions
        self.needs = needs


@dataclass(frozen=True)
class Budgets:
    """Per-rank memory budgets in bytes (before the safety margins); ``disk`` 0 forbids disk offload."""

    device: int
    host: int
    disk: int = 0


@dataclass(frozen=True)
class MemoryPolicy:
    """Safety margins held back from each budget (fractions of the budget).

    Attributes:
        device_margin: for the caching allocator's fragmentation and kernel workspaces (cuBLAS,
            NCCL buffers) that the tracer does not see. PyTorch's caching allocator typically
            reserves 5-15% more than it allocates on transformer training; 10% is the default.
        host_margin: for the Python process, pinned staging and the page cache.
        disk_margin: for the file system's own overhead.
    """

    device_margin: float = 0.10
    host_margin: float = 0.10
    disk_margin: float = 0.05

    def __post_init__(self) -> None:
        for k in ("device_margin", "host_margin", "disk_margin"):
            if not 0.0 <= getattr(self, k) < 1.0:
                raise ValueError(f"{k} must be in [0, 1)")

    def usable(self, device: int, host: int, disk: int) -> tuple[int, int, int]:
        return (
            int(device * (1 - self.device_margin)),
            int(host * (1 - self.host_margin)),
            int(disk * (1 - self.disk_margin)),
        )


def unified_memory(hw: HardwareProfile) -> bool:
    """Whether a rank's device memory and host memory are one pool: on a CPU-only profile the
    "device" is the host's RAM, shared by every rank of the node."""
    return hw.device_type == "cpu"


def budgets_for(hw: HardwareProfile, ranks_per_node: int, device: Optional[int], host: Optional[int],
                disk: Optional[int]) -> Budgets:
    """The per-rank budgets, the profile's defaults filled in: ``host`` None is the node's host
    memory over its ranks; ``device`` None the profile's device memory (on a CPU-only profile at
    most the host share: one pool); ``disk`` None or 0 forbids disk offload."""
    if host is None:
        host = hw.host_memory_bytes // ranks_per_node
    if device is None:
        device = min(hw.device_memory_bytes, host) if unified_memory(hw) else hw.device_memory_bytes
    return Budgets(int(device), int(host), int(disk or 0))


def fmt_bytes(n: int) -> str:
    """Bytes as the refusals print them (``unlimited`` at :data:`INF`)."""
    if n >= INF // 2:
        return "unlimited"
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


def budget_head(budgets: Budgets, usable: tuple[int, int, int], unified: bool, world: int) -> str:
    """The first words of every refusal: the budgets, what the margins leave, the disk, the ranks."""
    return (
        f"no plan fits: device budget {fmt_bytes(budgets.device)} and host budget {fmt_bytes(budgets.host)} per rank"
        f" (usable after margins {fmt_bytes(usable[0])} / {fmt_bytes(usable[1])}"
        + ("; one pool: device = host RAM, the host budget holds both" if unified else "")
        + ")"
        + (f", disk {fmt_bytes(budgets.disk)}" if budgets.disk else ", no disk offload")
        + f", world size {world}"
    )


def untraced_refusal(numel: int, dtype: Union[torch.dtype, str], world: int, hw: HardwareProfile, budgets: Budgets,
                     optimizer_type: str = "Adam", policy: Optional[MemoryPolicy] = None,
                     process_bytes: int = 0, formats: tuple[str, str] = FP32_STATE) -> Optional[DoesNotFitError]:
    """The refusal the search would give, decided before tracing; None when it cannot be decided so.

    ``numel`` is at most the step's trainable parameters (e.g. :func:`elixir.models.parameter_floor`
    of its config). Every plan the search keeps holds at least ``process_bytes`` and
    :func:`~elixir.plan.footprint.state_floor_bytes` of them at their leanest (gradients not kept,
    as with the fused step; activations and buffers 0) in the device and host budgets together
    (the host's alone on a CPU profile's one pool), so refusing here never refuses a budget the
    search would accept. The error is the search's :class:`DoesNotFitError`; its suggestions
    are what each budget needs at the least (each is needed; none is checked to be enough, which
    would take the trace)."""
    policy = policy or MemoryPolicy()
    dev, host, disk = usable = policy.usable(budgets.device, budgets.host, budgets.disk)
    opt = optimizer_state_bytes(optimizer_type)
    unified = unified_memory(hw)
    pool = host if unified else dev + host

    def need(w: int, d: int) -> int:
        return int(process_bytes) + state_floor_bytes(numel, 0, dtype, w, 0, opt, d, formats=formats)

    total = need(world, disk)
    if total <= pool and process_bytes <= host:
        return None
    options: list[tuple[float, str]] = []
    needs: dict[str, Any] = {}
    margin = policy.host_margin if unified else min(policy.device_margin, policy.host_margin)
    mem = math.ceil(total / (1 - margin)) + 1
    have = budgets.host if unified else budgets.device + budgets.host
    needs["memory"] = mem
    where = "memory (one pool of host RAM on this CPU profile)" if unified else "device + host memory together"
    options.append((mem / max(1, have) - 1, f"{where} >= {fmt_bytes(mem)} per rank (now {fmt_bytes(have)})"))
    if budgets.disk == 0 and process_bytes <= host:
        d = _least(lambda v: need(world, v) <= pool)
        if d is not None:
            needs["disk"] = math.ceil(d / (1 - policy.disk_margin)) + 1
            options.append((0.5, f"allow disk offload of optimizer state (disk >= {fmt_bytes(needs['disk'])} per rank)"))
    w = world
    for _ in range(16 if hw.all_gather is not None and process_bytes <= host else 0):
        w *= 2
        if need(w, disk) <= pool:
            needs["world_size"] = w
            options.append((w / world - 1, f"world size >= {w} (from {world})"))
            break
    options.sort()
    elem = element_bytes(dtype)
    master = state_floor_bytes(1, 0, dtype, 1, 0, opt) - elem - opt
    state = (f"{master} B of fp32 master and {opt} B of optimizer state" if not is_lossy(*formats) else
             f"the optimizer state in {formats[0]}/{formats[1]} (plan/state_format.py's bytes)")
    head = (budget_head(budgets, usable, unified, world)
            + f"; the parameters alone need at least {fmt_bytes(total)} per rank ({human_count(numel)} trainable"
            f" parameters over {world} rank(s) at {elem} B of value, {state} each, before any activation: refused"
            " before tracing)")
    suggestions = [t for _, t in options]
    head += ". Any plan needs one of these changes, at the least (only the trace can say what is enough):\n  - " + "\n  - ".join(suggestions)
    return DoesNotFitError(head, suggestions, needs)


def _least(ok: Callable[[int], bool]) -> Optional[int]:
    """The least ``v >= 0`` (to 0.4%) with ``ok(v)`` (monotone); None if not even at :data:`INF`."""
    if not ok(INF):
        return None
    lo, hi = 0, 1 << 20
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, hi // 256):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


__all__ = ["INF", "Budgets", "DoesNotFitError", "MemoryPolicy", "budget_head", "budgets_for", "fmt_bytes",
           "unified_memory", "untraced_refusal"]
