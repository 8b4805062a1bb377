"""``elixir checkpoint verify PATH``: check a checkpoint's files against its index, without loading it."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from elixir.checkpoint.errors import CheckpointError
from elixir.checkpoint.verify import Verified, verify
from elixir.tables import human_bytes, text_column


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    v = sub.add_parser("verify", help="check every file's presence, size and checksum",
                       description="Check every file of a checkpoint against its index (presence, size, checksum).")
    v.add_argument("path", help="the checkpoint directory")


def main(args: argparse.Namespace) -> int:
    try:
        result = verify(args.path)
    except CheckpointError as e:
        print(f"elixir checkpoint verify: {e}", file=sys.stderr)
        return 1
    render(result, Console(highlight=False))
    return 0


def render(result: Verified, console: Console) -> None:
    """What was checked, as a two-column table that fits 80 columns (a path longer than its column
    folds onto the next line rather than being cut)."""
    t = Table(title="checkpoint verified", title_justify="left", show_header=False)
    text_column(t, "what")
    text_column(t, "value")
    t.add_row("path", result.path)
    t.add_row("kind", f"{result.kind}, saved at world size {result.world_size}")
    t.add_row("files", f"{len(result.files)}, {human_bytes(sum(result.files.values()))}")
    t.add_row("contents", "checksums match" if result.checked else
              "sizes only: cannot check contents, as this checkpoint predates checksums")
    t.add_row("time", f"{result.seconds:.2f} s")
    console.print(t)
