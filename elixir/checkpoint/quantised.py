"""8-bit moments in sharded checkpoints, stored as they are (issue 33, item 5).

A fragment's ``int8`` moments are written as their codes (``exp_avg``, ``exp_avg_sq``: uint8, one
per element, ``state`` entries like any other) and their block scales (``exp_avg_absmax``,
``exp_avg_sq_absmax``: fp32, one per :data:`~elixir.plan.state_format.QUANT_BLOCK` elements from
the fragment's start, ``state`` entries over the same parameter range): 2 B/element and 8/256,
not the 8 B of fp32 values they decode to.

Reading back over a parameter range ``[start, end)``:

- the range a saved piece covers exactly (the same plan and world size), with ``keep``: the codes
  and scales as saved, so a same-format resume continues bit for bit;
- any other range, or without ``keep`` (another layout, a consolidated checkpoint, another format):
  each overlapping saved piece decoded with its own scales (exactly), and the fp32 values of the
  range assembled; the loader re-encodes them into the run's format (``lowbit_state.conform_loaded``).
"""

from __future__ import annotations

import torch

from elixir.checkpoint.errors import CheckpointError
from elixir.checkpoint.format import Reader, dtype_of
from elixir.optim import lowbit

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
#: Every state key an 8-bit moments' entry is stored under (codes, then block scales).
QUANT_KEYS = frozenset((*MOMENT_KEYS, *lowbit.SCALE_KEYS))


def is_quantised(pieces: dict, pname: str) -> bool:
    """Whether ``pname``'s moments were saved as 8-bit codes."""
    found = pieces.get(("exp_avg", pname), [])
    return bool(found) and dtype_of(found[0].dtype) == torch.uint8


def _piece_at(pieces: dict, key: str, pname: str, start: int):
    for e in pieces.get((key, pname), []):
        if e.start == start:
            return e
    raise CheckpointError(f"optimizer state {key!r} of {pname} at element {start} is missing from the checkpoint")


def _read_piece(reader: Reader, pieces: dict, pname: str, start: int) -> dict:
    """The codes and scales of the saved piece of ``pname`` starting at ``start``."""
    out = {}
    for k in QUANT_KEYS:
        e = _piece_at(pieces, k, pname, start)
        out[k] = reader.read(e.file, e.key, dtype_of(e.dtype)).reshape(-1)
    return out


def read_moments(reader: Reader, pieces: dict, pname: str, start: int, end: int, keep: bool) -> dict:
    """``pname``'s 8-bit moments over ``[start, end)``: codes and scales as saved when ``keep`` and
    one saved piece spans exactly that range, else the fp32 values they decode to (see module doc)."""
    codes = pieces[("exp_avg", pname)]
    if keep:
        for e in codes:
            if e.start == start and e.end == end:
                return _read_piece(reader, pieces, pname, start)
    m = torch.empty(end - start, dtype=torch.float32)
    v = torch.empty(end - start, dtype=torch.float32)
    covered = 0
    for e in codes:
        a, b = max(start, e.start), min(end, e.end)
        if a >= b:
            continue
        pm, pv = lowbit.decode_moments(_read_piece(reader, pieces, pname, e.start), "int8")
        m[a - start : b - start] = pm[a - e.start : b - e.start]
        v[a - start : b - start] = pv[a - e.start : b - e.start]
        covered += b - a
    if covered != end - start:
        raise CheckpointError(
            f"8-bit moments of {pname}: the checkpoint covers {covered} of the {end - start} elements [{start}, {end}) "
            "(a shard is missing)"
        )
    return {"exp_avg": m, "exp_avg_sq": v}
