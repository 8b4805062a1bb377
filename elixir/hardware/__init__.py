"""What a machine can do, as versioned JSON the search reads.

- :mod:`~elixir.hardware.profile`: the schema (:class:`HardwareProfile`, :class:`BandwidthCurve`)
  and the costs derived from it;
- :mod:`~elixir.hardware.registry`: the profiles shipped with elixir, by name;
- :mod:`~elixir.hardware.measurement`: times this machine's resources one by one (``elixir hwprofile``);
- :mod:`~elixir.hardware.calibrate`: times them together under the runtime.

Only the last two spawn processes. The search imports the first two directly; this package re-exports
all four's public names, the measurement ones on first use (they run elixir's optimizer, a higher floor).
"""

from typing import Any

from elixir.hardware.profile import HARDWARE_SCHEMA_VERSION, BandwidthCurve, GiB, HardwareProfile, MiB
from elixir.hardware.registry import (
    DEFAULT_RULE,
    choose_default_profile,
    default_profile,
    load_profile,
    local_profile_path,
    reference_profiles,
)

_MEASUREMENT = (
    "MeasureOptions", "measure", "measure_collectives", "measure_copy_curve", "measure_disk",
    "measure_elementwise_curve", "measure_first_touch", "measure_matmul", "measure_matmul_curve", "measure_op_overhead",
    "measure_optimizer", "measure_train_flops",
)

__all__ = [
    "HARDWARE_SCHEMA_VERSION", "BandwidthCurve", "GiB", "HardwareProfile", "MiB",
    "DEFAULT_RULE", "choose_default_profile", "default_profile", "load_profile", "local_profile_path",
    "reference_profiles", *_MEASUREMENT,
]


def __getattr__(name: str) -> Any:
    if name in _MEASUREMENT:
        # lazy: measurement imports the optimizers (floor 3); the profile schema must load without them
        from elixir.hardware import measurement

        return getattr(measurement, name)
    raise AttributeError(f"module 'elixir.hardware' has no attribute {name!r}")
