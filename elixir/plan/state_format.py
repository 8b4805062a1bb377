"""The formats the optimizer may keep its state in, and what each costs per element.

A chunk's optimizer state is its master copy (what the update adds to) and Adam's two moments.
``fp32`` for both is exact (the default). The lossy formats (issue 33) trade precision for bytes:

==============  =========================================================  ==============
format          what is kept                                               bytes/element
==============  =========================================================  ==============
master fp32     the fp32 master                                            4
master bf16-sr  a bf16 master, rounded stochastically at each update       2
master bf16-kahan  a bf16 master and a bf16 Kahan compensation buffer      4
moments fp32    ``exp_avg`` and ``exp_avg_sq`` in fp32                     8
moments bf16    both in bf16 (round to nearest even)                       4
moments int8    both as 8-bit codes, one fp32 scale per block of
                :data:`QUANT_BLOCK` elements each                          2 + 8/256
==============  =========================================================  ==============

A disk-placed chunk's offload file holds the master and the moments' per-element codes; int8's
block scales stay in host memory (:func:`disk_state_bytes`: bf16-sr with int8 moments 4 B/element).

This is the one table of those names and sizes: the policy (:mod:`elixir.wrapper.policies`),
the plan, the kernels (:mod:`elixir.optim.lowbit`) and the search's cost model read it.
"""

from __future__ import annotations

import torch

#: Formats of the master copy.
MASTER_FORMATS = ("fp32", "bf16-sr", "bf16-kahan")
#: Formats of Adam's moments.
MOMENT_FORMATS = ("fp32", "bf16", "int8")
#: Elements per quantisation block of ``int8`` moments (one fp32 absmax scale each).
QUANT_BLOCK = 256

_MASTER_BYTES = {"fp32": 4.0, "bf16-sr": 2.0, "bf16-kahan": 4.0}
_MOMENT_BYTES = {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 8.0 / QUANT_BLOCK}


def master_torch_dtype(master: str) -> torch.dtype:
    """The torch dtype of a master kept in format ``master`` (fp32, or bf16)."""
    check_state_formats(master, "fp32")
    return torch.float32 if master == "fp32" else torch.bfloat16


def check_state_formats(master: object, moments: object, where: str = "MixedPrecisionPolicy") -> None:
    """Refuse an unknown master or moments format, naming the allowed values."""
    if master not in MASTER_FORMATS:
        raise ValueError(f"{where}.master must be one of {', '.join(map(repr, MASTER_FORMATS))}, got {master!r}")
    if moments not in MOMENT_FORMATS:
        raise ValueError(f"{where}.moments must be one of {', '.join(map(repr, MOMENT_FORMATS))}, got {moments!r}")


def master_bytes(master: str) -> float:
    """Bytes per element of the master copy (Kahan's compensation buffer included)."""
    check_state_formats(master, "fp32")
    return _MASTER_BYTES[master]


def moment_bytes(moments: str) -> float:
    """Bytes per element of Adam's two moments together (block scales included)."""
    check_state_formats("fp32", moments)
    return _MOMENT_BYTES[moments]


def moment_scale_bytes(moments: str) -> float:
    """Bytes per element of the moments' block scales (``int8``: two fp32 absmax per block of
    :data:`QUANT_BLOCK`; 0 otherwise). A disk chunk keeps them in host memory: they are not one
    value per element, so the offload file binds only the codes
    (:func:`elixir.offload.state_binding.is_elementwise`)."""
    check_state_formats("fp32", moments)
    return 8.0 / QUANT_BLOCK if moments == "int8" else 0.0


def disk_state_bytes(master: str, moments: str) -> int:
    """Bytes per element a disk-placed chunk keeps in its offload file: its master (Kahan's buffer
    included) and its moments' per-element codes, each at its own width (fp32/fp32 12, bf16-sr/int8
    4); the int8 block scales stay in host memory (:func:`moment_scale_bytes`). Exact: the file is
    reserved at this size (``offload/for_plan.py``) and the bytes a disk step writes back are it."""
    return int(master_bytes(master) + moment_bytes(moments) - moment_scale_bytes(moments))


def is_lossy(master: str, moments: str) -> bool:
    """Whether either format is below fp32."""
    return (master, moments) != ("fp32", "fp32")
