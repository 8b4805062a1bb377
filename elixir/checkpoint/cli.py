"""``elixir checkpoint verify PATH``: check a checkpoint's files against its index, without loading it."""

from __future__ import annotations

import argparse
import sys

from elixir.checkpoint.errors import CheckpointError
from elixir.checkpoint.verify import verify


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
    print(result.summary())
    return 0
