"""The ``elixir`` command (also ``python -m elixir``).

Each subcommand lives in its own module, which defines ``add_arguments(parser)`` and
``main(args) -> int | None``. Modules are imported only when their subcommand runs, so
``elixir --help`` is fast and a subcommand whose module is not present yet is simply absent.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Optional, Sequence

from elixir import __version__
from elixir.models import UnknownModel

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("elixir.info", "show the version, native extension, CPU features and devices"),
    "demo": ("elixir.demo", "train a small GPT on the Python standard library's source, across local ranks"),
    "profile": ("elixir.tracer.cli", "profile a training step's memory and parameter order (no GPU needed)"),
    "plan": ("elixir.plan_cli", "plan a run (chunk size, cache, placement) for any cluster"),
    "checkpoint": ("elixir.checkpoint.cli", "check a checkpoint's files against its index (verify PATH)"),
    "hwprofile": ("elixir.hardware_cli", "measure this machine's bandwidths and optimizer speed into JSON"),
}


def _available() -> dict[str, tuple[str, str]]:
    """The subcommands whose module is present, found by its file: ``find_spec`` would import
    each module's packages (torch among them) before a subcommand is even chosen."""
    root = Path(__file__).resolve().parent.parent

    def present(module: str) -> bool:
        base = root.joinpath(*module.split("."))
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()

    return {n: v for n, v in SUBCOMMANDS.items() if present(v[0])}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elixir",
        description="Train PyTorch models larger than accelerator memory: chunked ZeRO-3 with searched plans.",
    )
    parser.add_argument("--version", action="version", version=f"elixir {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _available().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        p.set_defaults(_add=None)
        # Arguments are added lazily only for the chosen subcommand (see main).
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    available = _available()
    # Find the subcommand name (first non-option word) and let its module add its arguments.
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in available:
        module = importlib.import_module(available[command][0])
        sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        module.add_arguments(sub_action.choices[command])
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 0
    module = importlib.import_module(args._module)
    try:
        rc = module.main(args)
    except (UnknownModel, FileNotFoundError) as e:  # a name or path the user gave: the message, no traceback
        print(f"elixir {command}: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
