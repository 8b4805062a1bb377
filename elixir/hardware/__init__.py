"""What a machine can do, as versioned JSON the search reads (floor 1: pure data, no measurement).

- :mod:`~elixir.hardware.profile`: the schema (:class:`HardwareProfile`, :class:`BandwidthCurve`)
  and the costs derived from it;
- :mod:`~elixir.hardware.registry`: the profiles shipped with elixir, by name, and the one rule that
  picks a profile when none is given.

Measuring a machine and calibrating the cost model against the runtime live above the runtime, in
:mod:`elixir.profiling` (``elixir hwprofile``).
"""

from elixir.hardware.profile import HARDWARE_SCHEMA_VERSION, BandwidthCurve, GiB, HardwareProfile, MiB
from elixir.hardware.registry import (
    DEFAULT_RULE,
    choose_default_profile,
    closest_reference_gpu,
    default_profile,
    load_profile,
    local_profile_path,
    reference_profiles,
)

__all__ = [
    "HARDWARE_SCHEMA_VERSION", "BandwidthCurve", "GiB", "HardwareProfile", "MiB",
    "DEFAULT_RULE", "choose_default_profile", "closest_reference_gpu", "default_profile", "load_profile",
    "local_profile_path", "reference_profiles",
]
