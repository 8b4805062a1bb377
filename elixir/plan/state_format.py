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

Frozen chunks (the weights an adapter fine-tune does not train, e.g. a LoRA base) may be stored
quantised (``frozen``) and dequantised to the compute dtype at each gather (:mod:`elixir.chunk.quant`):

==============  =========================================================  ==============
format          what is kept                                               bytes/element
==============  =========================================================  ==============
frozen None     the compute-dtype values (the default)                     2 (bf16), 4
frozen nf4      QLoRA's NF4 (torchao's layout): 4-bit codes, blocks of     0.5 + 1/64
                :data:`NF4_BLOCK`; the block absmax double-quantised to    + e/16384
                int8 in groups of :data:`NF4_SCALER_BLOCK` blocks
frozen int8     8-bit linear codes, one fp32 absmax per block of           1 + 4/64
                :data:`INT8_BLOCK` elements
==============  =========================================================  ==============

A disk-placed chunk's offload file holds the master and the moments' per-element codes; int8's
block scales stay in host memory (:func:`disk_state_bytes`: bf16-sr with int8 moments 4 B/element).

This is the one table of those names and sizes: the policy (:mod:`elixir.wrapper.policies`),
the plan, the kernels (:mod:`elixir.optim.lowbit`, :mod:`elixir.chunk.quant`) and the search's cost
model read it.
"""

from __future__ import annotations

from typing import Optional

import torch

#: The exact formats (fp32 master, fp32 moments): the default, and what a plan that records none keeps.
FP32_STATE = ("fp32", "fp32")
#: Formats of the master copy.
MASTER_FORMATS = ("fp32", "bf16-sr", "bf16-kahan")
#: Formats of Adam's moments.
MOMENT_FORMATS = ("fp32", "bf16", "int8")
#: Elements per quantisation block of ``int8`` moments (one fp32 absmax scale each).
QUANT_BLOCK = 256

#: Formats a frozen chunk may be stored in (None: the compute dtype itself).
FROZEN_FORMATS = (None, "nf4", "int8")
#: Elements per NF4 block (one absmax each), as QLoRA and torchao's ``NF4Tensor``.
NF4_BLOCK = 64
#: NF4 blocks per group of the absmax's double quantisation (one scale factor each).
NF4_SCALER_BLOCK = 256
#: Elements per int8 block (one fp32 absmax each).
INT8_BLOCK = 64

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


def moment_nbytes(moments: str, n: int) -> int:
    """Bytes of Adam's two moments for ``n`` elements in format ``moments``, int8's block scales
    counted by whole blocks (two fp32 absmax per started block of :data:`QUANT_BLOCK`)."""
    check_state_formats("fp32", moments)
    if moments == "int8":
        return 2 * n + 8 * -(-n // QUANT_BLOCK)
    return int(_MOMENT_BYTES[moments]) * n


def master_dtype_name(master: str) -> str:
    """The plan's name of the master's dtype in format ``master``: ``"float32"`` or ``"bfloat16"``."""
    return "float32" if master_torch_dtype(master) == torch.float32 else "bfloat16"


def compensation_bytes(master: str) -> int:
    """Bytes per element of the master's Kahan compensation buffer (``bf16-kahan``: 2; else 0),
    kept with the optimizer state (the master itself is the master dtype's bytes)."""
    return int(master_bytes(master)) - (4 if master == "fp32" else 2)


def leaner_formats(master: str, moments: str) -> list[tuple[str, str]]:
    """The formats a search allowed lossy state (``MixedPrecisionPolicy.allow_lossy_state``) may
    turn to from ``(master, moments)``, least lossy first, each fewer bytes than the one before:
    the moments to ``int8`` (8 -> 2.03 B, the master kept), then the master to ``bf16-sr`` too
    (4 -> 2 B). The search never turns to ``bf16`` moments (twice ``int8``'s bytes) nor to
    ``bf16-kahan`` (as many bytes as an fp32 master); a user may ask for either."""
    check_state_formats(master, moments)
    out = []
    if moments != "int8":
        out.append((master, "int8"))
    if master != "bf16-sr":
        out.append(("bf16-sr", "int8"))
    return out


def disk_state_bytes(master: str, moments: str) -> int:
    """Bytes per element a disk-placed chunk keeps in its offload file: its master (Kahan's buffer
    included) and its moments' per-element codes, each at its own width (fp32/fp32 12, bf16-sr/int8
    4); the int8 block scales stay in host memory (:func:`moment_scale_bytes`). Exact: the file is
    reserved at this size (``offload/for_plan.py``) and the bytes a disk step writes back are it."""
    return int(master_bytes(master) + moment_bytes(moments) - moment_scale_bytes(moments))


def is_lossy(master: str, moments: str) -> bool:
    """Whether either format is below fp32."""
    return (master, moments) != ("fp32", "fp32")


def check_frozen_format(frozen: object, where: str = "MixedPrecisionPolicy") -> None:
    """Refuse an unknown frozen-weight format, naming the allowed values."""
    if frozen not in FROZEN_FORMATS:
        raise ValueError(f"{where}.frozen must be one of {', '.join(map(repr, FROZEN_FORMATS))}, got {frozen!r}")


def frozen_shard_bytes(frozen: Optional[str], numel: int, elem: int) -> int:
    """Bytes a frozen shard of ``numel`` elements takes in format ``frozen`` for a compute dtype
    of ``elem`` bytes: the packed buffer :mod:`elixir.chunk.quant` writes (codes, scales and their
    padding to whole blocks), or ``numel * elem`` unquantised. The one rule the runtime books by
    and the search prices by."""
    check_frozen_format(frozen, "frozen_shard_bytes")
    if frozen is None:
        return numel * elem
    blocks = -(-numel // (NF4_BLOCK if frozen == "nf4" else INT8_BLOCK))
    if frozen == "int8":
        return blocks * (INT8_BLOCK + 4)
    groups = -(-blocks // NF4_SCALER_BLOCK)
    # the group factors and the mean (compute dtype), then 32 code bytes and one scaler byte per block
    return (groups + 1) * elem + blocks * (NF4_BLOCK // 2 + 1)


def frozen_element_bytes(frozen: Optional[str], elem: int) -> float:
    """Bytes per element of a large frozen shard in format ``frozen`` (the table above): 0.5157
    for NF4 with bf16 compute, 1.0625 for int8, ``elem`` unquantised."""
    n = NF4_BLOCK * NF4_SCALER_BLOCK * 64
    return frozen_shard_bytes(frozen, n, elem) / n
