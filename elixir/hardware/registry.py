"""The hardware profiles shipped with elixir (``elixir/data/hardware/*.json``), by name."""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

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


LOCAL_PROFILE_ENV = "ELIXIR_HARDWARE"  # a profile path that overrides the local default location
REFERENCE_CPU, REFERENCE_GPU = "cpu-box", "8xA100-40GB"
DEFAULT_RULE = (
    f"the local measured profile (${LOCAL_PROFILE_ENV}, else ~/.cache/elixir/hardware.json, which "
    f"`elixir hwprofile` writes) if there is one; otherwise the shipped reference profile "
    f"{REFERENCE_CPU!r} on a machine without CUDA, {REFERENCE_GPU!r} with CUDA"
)
"""The rule that picks the hardware profile when none is given, in the words every report prints."""


def local_profile_path() -> str:
    """Where this machine's measured profile lives: ``$ELIXIR_HARDWARE`` if set, else
    ``$XDG_CACHE_HOME/elixir/hardware.json`` (``~/.cache/elixir/hardware.json``)."""
    env = os.environ.get(LOCAL_PROFILE_ENV)
    if env:
        return os.path.expanduser(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "elixir", "hardware.json")


def choose_default_profile() -> tuple[HardwareProfile, str]:
    """The profile used when none is given, by one rule (:data:`DEFAULT_RULE`), and why, in words
    that every report prints."""
    local = local_profile_path()
    if os.path.exists(local):
        return HardwareProfile.load(local), f"the local measured profile {local}"
    name = REFERENCE_GPU if torch.cuda.is_available() else REFERENCE_CPU
    return load_profile(name), f"no local measured profile at {local}; `elixir hwprofile` makes one"


def closest_reference_gpu(device_memory: Optional[int], world_size: int) -> HardwareProfile:
    """The shipped GPU profile closest to a requested device memory (by ratio), among those with
    collective measurements when ``world_size > 1``; :data:`REFERENCE_GPU` when no memory is given."""
    profiles = [load_profile(n) for n in reference_profiles()]
    gpus = [p for p in profiles if p.device_type == "cuda" and (world_size == 1 or p.all_gather is not None)]
    if device_memory is None or not gpus:
        return load_profile(REFERENCE_GPU)
    return min(gpus, key=lambda p: abs(math.log(p.device_memory_bytes / device_memory)))


def default_profile() -> HardwareProfile:
    """The profile used when none is given: see :func:`choose_default_profile`."""
    return choose_default_profile()[0]
