"""The multi-rank harness the tests use: :func:`elixir.launch.run_distributed` (the library's own
launcher, also used by hardware measurement), re-exported here under its historical name."""

from elixir.launch import DistributedFailure, DistributedHang, free_port, run_distributed

__all__ = ["run_distributed", "DistributedFailure", "DistributedHang", "free_port"]
