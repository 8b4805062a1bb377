"""Memory profile of one training step, traced on meta tensors (no weights, no accelerator).

Definitions (all bytes, counted per storage, see :mod:`elixir.tracer.accounting`):

- ``param_occ`` / ``buffer_occ``: parameters and buffers in the step's ``dtype`` (tied ones once).
- ``grad_occ``: the peak of parameters' ``.grad`` storages, counted from the moment AccumulateGrad
  produces them (normally the bytes of all trainable parameters).
- ``activation_occ``: the peak of everything else the step allocates (tensors saved for backward,
  temporaries, gradients of activations, a parameter gradient until AccumulateGrad takes it),
  excluding parameter gradients and the caller's inputs (``input_occ``).
- ``phase_peaks``: the activation peak within each phase (forward, recompute, backward).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from rich.console import Console
from rich.table import Table

from elixir.fileio import atomic_write_json

from .accounting import Temporary
from .hooks import StepKind
from .op_costs import OpCosts
from .param_tracer import ParamOrder, order_from_trace
from .run import StepFn, StepTrace, trace_step

__all__ = ["PeakInfo", "MemoryProfile", "memory_profiling", "cuda_memory_profiling", "profile_from_trace"]


@dataclass(frozen=True)
class PeakInfo:
    """Where the activation peak occurs: after op ``op_index`` (``op_name``) in ``phase``, inside
    the step of ``module`` (the parameter-owning module whose forward, recomputation or backward
    started last before that op; "" when none had)."""

    phase: str
    op_index: int
    op_name: str
    activation_bytes: int
    total_bytes: int  # params + buffers + inputs + grads + activations at that op
    module: str = ""

    def where(self) -> str:
        """In words a user knows: the phase and the module (the aten op only as a detail)."""
        at = f"{self.phase} of {self.module or 'the model'}"
        return f"{at} (op {_short_op(self.op_name)})" if self.op_name else at


@dataclass(frozen=True)
class CheckpointRegion:
    """An outermost checkpointed forward region: ops ``[start_op, end_op)``, steps ``[start_step, end_step)``."""

    start_op: int
    end_op: int
    start_step: int
    end_step: int


@dataclass(frozen=True)
class MemoryProfile:
    """The richer result behind :func:`cuda_memory_profiling` (see the module docstring)."""

    dtype: str
    target: str
    param_occ: int
    buffer_occ: int
    grad_occ: int
    activation_occ: int
    input_occ: int
    total_peak: int
    phase_peaks: dict
    peak: PeakInfo
    largest_temporary: Optional[Temporary]
    checkpoint_regions: tuple
    recompute_regions: tuple  # (start_op, end_op) of each contiguous run of recompute ops
    timeline_phase: tuple
    timeline_op: tuple
    timeline_activation: tuple
    timeline_grad: tuple
    order: ParamOrder
    op_costs: OpCosts = field(default_factory=OpCosts)

    @property
    def num_ops(self) -> int:
        return len(self.timeline_op)

    def occ_dict(self) -> dict:
        """The dict :func:`cuda_memory_profiling` returns."""
        return {
            "param_occ": self.param_occ,
            "buffer_occ": self.buffer_occ,
            "grad_occ": self.grad_occ,
            "activation_occ": self.activation_occ,
            "input_occ": self.input_occ,
            "total_peak": self.total_peak,
            "phase_peaks": dict(self.phase_peaks),
        }

    def summary(self) -> dict:
        """A JSON-ready summary (no per-op timeline)."""
        d = self.occ_dict()
        d.update(
            dtype=self.dtype,
            target=self.target,
            num_ops=self.num_ops,
            num_steps=len(self.order.steps),
            peak=asdict(self.peak),
            largest_temporary=asdict(self.largest_temporary) if self.largest_temporary else None,
            checkpoint_regions=[asdict(r) for r in self.checkpoint_regions],
            recompute_regions=[list(r) for r in self.recompute_regions],
        )
        return d

    def to_json(self, path: str, timeline: bool = False) -> None:
        """Write :meth:`summary` (plus the per-op timeline and step order when ``timeline``) to ``path``."""
        d = self.summary()
        if timeline:
            d["timeline"] = {
                "phase": list(self.timeline_phase),
                "op": list(self.timeline_op),
                "activation": list(self.timeline_activation),
                "grad": list(self.timeline_grad),
            }
            d["order"] = self.order.to_dict()
        atomic_write_json(path, d)

    def table(self, title: str = "elixir memory profile"):
        """A rich ``Table`` of the figures."""
        t = Table(title=title)
        t.add_column("quantity")
        t.add_column("bytes", justify="right")
        t.add_column("human", justify="right")
        t.add_column("note")
        rows = [
            ("param_occ", self.param_occ, f"{self.dtype}"),
            ("buffer_occ", self.buffer_occ, ""),
            ("grad_occ", self.grad_occ, "as AccumulateGrad produces them"),
            ("activation_occ", self.activation_occ,
             f"peak in the {self.peak.where()}"),
            *((f"  {ph} peak", v, "activations") for ph, v in self.phase_peaks.items()),
            ("input_occ", self.input_occ, "the batch"),
            ("total_peak", self.total_peak, "params + buffers + inputs + grads + activations"),
        ]
        if self.largest_temporary is not None:
            lt = self.largest_temporary
            rows.append(("largest temporary", lt.nbytes, f"in {lt.phase} (op {_short_op(lt.op_name)})"))
        for name, v, note in rows:
            t.add_row(name, f"{v:,}", _human(v), note)
        t.caption = (
            f"{self.num_ops:,} ops, {len(self.order.steps):,} hook steps, "
            f"{len(self.checkpoint_regions)} checkpointed regions, {len(self.recompute_regions)} recompute runs"
        )
        return t

    def print(self, console=None, title: str = "elixir memory profile") -> None:
        (console or Console()).print(self.table(title))

    def plot(self, path: str) -> None:
        """Save a PNG of the live-bytes timeline (needs matplotlib)."""
        try:
            # optional dependency: matplotlib (the plot extra)
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # (the same optional dependency)
        except ImportError as err:  # pragma: no cover
            raise ImportError("MemoryProfile.plot needs matplotlib: pip install matplotlib") from err
        x = range(self.num_ops)
        fig, ax = plt.subplots(figsize=(9, 3.5))
        gib = 2**30
        ax.plot(x, [a / gib for a in self.timeline_activation], label="activations", lw=0.8, color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(x, [g / gib for g in self.timeline_grad], label="param grads", lw=0.8, color="tab:purple")
        ax2.set_ylabel("param grads (GiB)", color="tab:purple")
        for r in self.checkpoint_regions:
            ax.axvspan(r.start_op, r.end_op, color="tab:green", alpha=0.08)
        for a, b in self.recompute_regions:
            ax.axvspan(a, b, color="tab:orange", alpha=0.15)
        ax.axvline(self.peak.op_index, color="red", lw=0.6, ls="--")
        ax.set_xlabel("op index (green: checkpointed forward, orange: recompute)")
        ax.set_ylabel("activations (GiB)", color="tab:blue")
        ax.set_title(f"activation peak {_human(self.activation_occ)} in {self.peak.phase}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)  # pragma: no cover


def _runs(phases: list, want: str) -> tuple:
    out, start = [], None
    for i, ph in enumerate(phases):
        if ph == want and start is None:
            start = i
        elif ph != want and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(phases)))
    return tuple(out)


def _module_at(tr: StepTrace, op_index: int) -> str:
    """The module whose step started last at or before op ``op_index`` ("" before any step)."""
    name = ""
    for st in tr.steps:
        if st.op_index > op_index:
            break
        name = st.module or "the root module"
    return name


def _short_op(op: object) -> str:
    """``aten.sum.dim_IntList`` -> ``sum``: the op's base name, without namespace and overload."""
    text = str(op)
    parts = text.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else text


def profile_from_trace(tr: StepTrace) -> MemoryProfile:
    """Summarise a raw :class:`~elixir.tracer.run.StepTrace`."""
    acc = tr.acc
    act, grad, phases = acc.t_act, acc.t_grad, acc.t_phase
    static = tr.param_occ + tr.buffer_occ + tr.input_occ
    if act:
        i = max(range(len(act)), key=act.__getitem__)
        total = max(a + g for a, g in zip(act, grad)) + static
        peak = PeakInfo(phases[i], i, str(acc.t_name[i]), act[i], act[i] + grad[i] + static, _module_at(tr, i))
    else:  # pragma: no cover - a step always runs ops
        total, peak = static, PeakInfo("forward", 0, "", 0, static)
    phase_peaks: dict = {}
    for ph, a in zip(phases, act):
        if a > phase_peaks.get(ph, -1):
            phase_peaks[ph] = a
    ordered = {k.value: phase_peaks[k.value] for k in StepKind if k.value in phase_peaks}
    regions = tuple(CheckpointRegion(o[0], o[1], s[0], s[1]) for o, s in zip(tr.checkpoint_ops, tr.checkpoint_steps))
    return MemoryProfile(
        dtype=str(tr.dtype).replace("torch.", ""),
        target=tr.target,
        param_occ=tr.param_occ,
        buffer_occ=tr.buffer_occ,
        grad_occ=max(grad, default=0),
        activation_occ=peak.activation_bytes,
        input_occ=tr.input_occ,
        total_peak=total,
        phase_peaks=ordered,
        peak=peak,
        largest_temporary=acc.largest_temporary,
        checkpoint_regions=regions,
        recompute_regions=_runs(phases, StepKind.RECOMPUTE.value),
        timeline_phase=tuple(phases),
        timeline_op=tuple(str(n) for n in acc.t_name),
        timeline_activation=tuple(act),
        timeline_grad=tuple(grad),
        order=order_from_trace(tr),
        op_costs=acc.costs.costs,
    )


def memory_profiling(model: nn.Module, inp: dict, step_fn: StepFn, dtype: torch.dtype = torch.float,
                     target: str = "meta") -> MemoryProfile:
    """Profile one training step ``step_fn(model, inp)`` (forward + backward) on meta tensors.

    ``model`` may be built on meta or be a real model on any single device; it is copied onto
    meta internally (no weight bytes) and neither it nor ``inp`` is modified. ``dtype`` is the
    floating dtype the step trains in (params, buffers and floating inputs are cast to it).
    ``target="real"`` runs the same accounting on real CPU copies instead (for measurement).
    """
    return profile_from_trace(trace_step(model, inp, step_fn, dtype, target))  # type: ignore[arg-type]


def cuda_memory_profiling(model: nn.Module, inp: dict, step_fn: StepFn, dtype: torch.dtype = torch.float) -> dict:
    """``param_occ``, ``buffer_occ``, ``grad_occ``, ``activation_occ`` (bytes) and a few more keys.

    The name is the reference's; it needs no CUDA (it traces on meta, see :func:`memory_profiling`).
    """
    return memory_profiling(model, inp, step_fn, dtype).occ_dict()

