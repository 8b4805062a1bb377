"""Measuring this machine, above the runtime (``elixir hwprofile``).

- :mod:`~elixir.profiling.measurement`: times each resource alone (matmul curves, copies, first
  touch, collectives, the optimizer, the disk) into a :class:`~elixir.hardware.HardwareProfile`;
- :mod:`~elixir.profiling.calibrate`: times elixir's runtime on a small reference model and fits
  the profile's overlap and efficiency figures to what it measured.

Both spawn processes and run the runtime, so they sit above it; the search only ever reads the
profile they write (:mod:`elixir.hardware`).
"""

from elixir.profiling.calibrate import Calibration, calibrate, calibrate_profile
from elixir.profiling.measurement import (
    MeasureOptions,
    local_backend,
    measure,
    measure_collectives,
    measure_copy_curve,
    measure_disk,
    measure_elementwise_curve,
    measure_first_touch,
    measure_matmul,
    measure_matmul_bytes_curve,
    measure_matmul_curve,
    measure_op_overhead,
    measure_optimizer,
    measure_train_flops,
)

__all__ = [
    "Calibration", "calibrate", "calibrate_profile", "MeasureOptions", "local_backend", "measure",
    "measure_collectives", "measure_copy_curve", "measure_disk", "measure_elementwise_curve", "measure_first_touch",
    "measure_matmul", "measure_matmul_bytes_curve", "measure_matmul_curve", "measure_op_overhead", "measure_optimizer", "measure_train_flops",
]
