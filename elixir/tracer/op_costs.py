"""Per-op compute costs of a traced step: matmul FLOPs, bytes moved and the number of ops.

The tracer sees every aten op of a training step (on meta tensors, with shapes but no data). That
is enough for a roofline-style estimate of compute time on any machine, given what the machine
can do (:class:`~elixir.hardware.HardwareProfile`): matmul-like ops cost their FLOPs at the
matmul throughput for their size, plus the bytes of their operands at the rate a matmul moves
them (what a skinny product, a few rows against a whole weight, is bound by); every other op
costs the bytes it reads and writes at the elementwise memory bandwidth for its size; and every
op, views included, costs one dispatch (framework overhead and kernel launch).

Sizes matter (a 256-wide matmul runs far below peak), so FLOPs and bytes are kept as histograms
over power-of-two size buckets: bucket ``k`` holds ops of size in ``[2^k, 2^(k+1))``. The
histograms add, scale and extrapolate by layer repetition like plain numbers. A matmul bucket
also sums its ops' operand bytes (read plus written); the bucket's ops are priced at their mean
bytes, as at their mean FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import flop_counter

__all__ = ["OpCosts", "OpCostCounter"]


def _bucket(x: float) -> int:
    return max(0, int(math.log2(x))) if x >= 1 else 0


@dataclass
class OpCosts:
    """Histograms of one step's ops (see the module docstring).

    Attributes:
        matmul: bucket (of FLOPs) -> [ops, FLOPs, bytes] of matmul-like ops (mm, bmm, addmm,
            convolution, attention); bytes are the operands read plus the output written.
        memory: bucket -> [ops, bytes] of other ops that move data (bytes read plus written).
        ops: every dispatched op, views included.
    """

    matmul: dict[int, list[float]] = field(default_factory=dict)
    memory: dict[int, list[float]] = field(default_factory=dict)
    ops: int = 0

    @property
    def matmul_flops(self) -> float:
        return sum(v[1] for v in self.matmul.values())

    @property
    def matmul_bytes(self) -> float:
        return sum(v[2] for v in self.matmul.values())

    @property
    def memory_bytes(self) -> float:
        return sum(v[1] for v in self.memory.values())

    def combine(self, other: OpCosts, a: float = 1.0, b: float = 1.0) -> OpCosts:
        """``a * self + b * other``, bucket by bucket (counts may become fractional)."""

        def mix(x: dict, y: dict, width: int) -> dict:
            out = {}
            zero = [0.0] * width
            for k in set(x) | set(y):
                u, v = x.get(k, zero), y.get(k, zero)
                w = [a * p + b * q for p, q in zip(u, v)]
                if w[0] > 0 and w[1] > 0:
                    out[k] = [w[0], w[1]] + [max(0.0, e) for e in w[2:]]
            return out

        return OpCosts(mix(self.matmul, other.matmul, 3), mix(self.memory, other.memory, 2),
                       max(0, int(round(a * self.ops + b * other.ops))))

    def to_json(self) -> dict:
        return {"matmul": {str(k): v for k, v in sorted(self.matmul.items())},
                "memory": {str(k): v for k, v in sorted(self.memory.items())}, "ops": self.ops}

    @classmethod
    def from_json(cls, d: dict) -> OpCosts:
        """Profiles written before the matmul bytes were traced hold [ops, FLOPs]: 0 bytes."""
        return cls({int(k): ([float(x) for x in v] + [0.0])[:3] for k, v in d.get("matmul", {}).items()},
                   {int(k): [float(x) for x in v] for k, v in d.get("memory", {}).items()}, int(d.get("ops", 0)))


def _shape(t: Any) -> Any:
    return t.shape if isinstance(t, torch.Tensor) else t


def _cpu_sdpa_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _cpu_sdpa_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(_shape(grad_out), _shape(query), _shape(key), _shape(value))


def _grouped_mm_flops(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
    """Every row of a grouped (mixture-of-experts) matmul is multiplied once, however the groups
    split them: 2 M K N in all, as one matmul of the same total size."""
    a, b = _shape(mat_a), _shape(mat_b)
    if len(a) == 2:
        return 2 * a[0] * a[1] * (b[-1] if len(b) == 3 else b[1])
    return 2 * a[1] * a[2] * b[1] if len(b) == 2 else 2 * a[0] * a[1] * a[2] * b[-1]


def _formulas() -> dict:
    reg = dict(flop_counter.flop_registry)
    aten = torch.ops.aten
    for name, fn in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_flops),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward_flops),
                     ("_grouped_mm", _grouped_mm_flops)):
        packet = getattr(aten, name, None)
        if packet is not None and packet not in reg:
            reg[packet] = fn
    return reg


def _tensor_bytes(x: Any) -> int:
    total = 0
    for t in torch.utils._pytree.tree_leaves(x):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            total += t.numel() * t.element_size()
    return total


class OpCostCounter:
    """Accumulates :class:`OpCosts` op by op (called from the tracer's dispatch mode)."""

    def __init__(self) -> None:
        self.costs = OpCosts()
        self._formulas = _formulas()

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        c = self.costs
        c.ops += 1
        if getattr(func, "is_view", False):
            return
        nbytes = _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)
        fn = self._formulas.get(getattr(func, "overloadpacket", None))
        if fn is not None:
            try:
                flops = float(fn(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not accept this overload's arguments
                flops = 0.0
            if flops > 0:
                slot = c.matmul.setdefault(_bucket(flops), [0.0, 0.0, 0.0])
                slot[0] += 1
                slot[1] += flops
                slot[2] += nbytes
                return
        if nbytes > 0:
            slot = c.memory.setdefault(_bucket(nbytes), [0.0, 0.0])
            slot[0] += 1
            slot[1] += nbytes
