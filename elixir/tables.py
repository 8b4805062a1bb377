"""Tables that fit a terminal: the one home for how elixir's printed tables shorten what they show.

Every table elixir prints (``elixir plan``, ``elixir profile``, the demo, the memory reports,
``elixir checkpoint verify``) is meant to read well at 80 columns. Two rules make that so:

- parameter names are shown as ranges shortened by prefix (:func:`param_ranges`:
  ``transformer.h.0–5.*``), never cut mid-name;
- columns that hold names or prose wrap at spaces (and fold only a word wider than the whole
  column), while numbers never wrap (:func:`text_column`, :func:`number_column`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from rich.table import Table

__all__ = ["param_ranges", "text_column", "number_column", "longest_word", "human_count", "human_bytes"]

def _segments(names: Sequence[str]) -> list[list]:
    """Consecutive names merged: ``["range", prefix, lo, hi]`` for names under ``prefix.<i>.``
    with consecutive ``i``, ``["names", parent, [leaf, ...]]`` for plain names sharing a parent."""
    out: list[list] = []
    for name in names:
        parts = name.split(".")
        idx = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
        last = out[-1] if out else None
        if idx is not None and idx > 0:
            prefix, num = ".".join(parts[:idx]), int(parts[idx])
            if last and last[0] == "range" and last[1] == prefix and num in (last[3], last[3] + 1):
                last[3] = num
            else:
                out.append(["range", prefix, num, num])
            continue
        parent, leaf = ".".join(parts[:-1]), parts[-1]
        if last and last[0] == "names" and last[1] == parent:
            last[2].append(leaf)
        else:
            out.append(["names", parent, [leaf]])
    return out


def _render(seg: list) -> str:
    if seg[0] == "range":
        _, prefix, lo, hi = seg
        return f"{prefix}.{lo}.*" if lo == hi else f"{prefix}.{lo}–{hi}.*"
    _, parent, leaves = seg
    head = f"{parent}." if parent else ""
    return head + (leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}")


def param_ranges(names: Sequence[str], max_parts: int = 3) -> str:
    """A short description of a list of parameter names, in order: runs of numbered layers become
    ranges (``transformer.h.0–5.*``), siblings share their parent (``transformer.ln_f.{weight,bias}``),
    and more than ``max_parts`` pieces end in ``and N more``. The count follows when there are
    several names: ``transformer.wte.weight, transformer.h.0–2.* (38)``."""
    names = list(names)
    if not names:
        return "-"
    parts = [_render(s) for s in _segments(names)]
    if len(parts) > max_parts:
        text = ", ".join(parts[: max_parts - 1]) + f" and {len(parts) - max_parts + 1} more"
    else:
        text = ", ".join(parts)
    return text if len(names) == 1 else f"{text} ({len(names)})"


def text_column(table: Table, header: str, min_width: Optional[int] = None, **kwargs) -> None:
    """A column of names or prose: wraps at spaces, folds a word wider than the column (no ellipsis)."""
    table.add_column(header, overflow="fold", min_width=min_width, **kwargs)


def longest_word(texts: Sequence[str], cap: int = 40) -> int:
    """The width a names column needs so that no name in ``texts`` is broken (at most ``cap``)."""
    return min(cap, max((len(w) for t in texts for w in t.split()), default=1))


def number_column(table: Table, header: str, **kwargs) -> None:
    """A right-aligned column of figures (a header wraps at spaces; a figure is never cut)."""
    table.add_column(header, justify="right", overflow="fold", **kwargs)


def human_count(n: int) -> str:
    """A count, short, in the unit that fits: 531.5M, 12.3k, 6.7B, 840."""
    for unit, k in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= k:
            return f"{n / k:.1f}{unit}"
    return str(n)


def human_bytes(n: float) -> str:
    """Bytes in the binary unit that fits, three significant figures: 300 KiB, 1.51 GiB, 40 GiB."""
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{int(n)} B"
