"""Test support shipped with elixir: a multi-rank harness, a model zoo and a plain-torch reference
trainer. Benchmarks and downstream users' tests can use them too."""

from elixir.testing.dist import DistributedFailure, DistributedHang, run_distributed

__all__ = ["run_distributed", "DistributedFailure", "DistributedHang"]
