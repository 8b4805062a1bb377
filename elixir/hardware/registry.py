"""The hardware profiles shipped with elixir (``elixir/data/hardware/*.json``), by name."""

from __future__ import annotations

import os

from elixir.hardware.profile import HardwareProfile

_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "hardware")


def reference_profiles() -> list[str]:
    """Names of the shipped reference profiles (``elixir/data/hardware/*.json``)."""
    if not os.path.isdir(_DATA_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(_DATA_DIR) if f.endswith(".json"))


def load_profile(name_or_path: str | os.PathLike) -> HardwareProfile:
    """A profile from a JSON path, or a shipped reference profile by name."""
    p = os.fspath(name_or_path)
    if os.path.exists(p):
        return HardwareProfile.load(p)
    ref = os.path.join(_DATA_DIR, p if p.endswith(".json") else p + ".json")
    if os.path.exists(ref):
        return HardwareProfile.load(ref)
    raise FileNotFoundError(
        f"no hardware profile {p!r}: give a JSON path (from `elixir hwprofile --out`) or one of "
        f"{reference_profiles()}"
    )


def default_profile() -> HardwareProfile:
    """The shipped profile of this project's CPU box (measured there); used when none is given."""
    return load_profile("cpu-box")
