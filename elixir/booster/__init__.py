"""ColossalAI's Booster API on elixir (floor 6, above everything it uses).

``Booster(plugin=...)`` with :class:`TorchDDPPlugin`, :class:`TorchFSDPPlugin` (FSDP2) and
:class:`GeminiPlugin` (alias :class:`ElixirPlugin`, on ElixirModule/ElixirOptimizer), or
``plugin="auto"`` (the search chooses), :class:`LowLevelZeroPlugin` (ZeRO-1/2: a plan whose
chunks keep parameters whole and split masters and optimizer state, on the same runtime) and
:class:`HybridParallelPlugin` (tensor x pipeline x data parallel on torch's engines, the chunks as
the data-parallel axis; ``Booster.execute_pipeline``).
``launch`` / ``launch_from_torch`` start the process group as ColossalAI's do, so a ColossalAI
program runs with ``import elixir.booster as colossalai``.
"""

from elixir.booster.booster import Booster
from elixir.booster.gemini import ElixirPlugin, GeminiPlugin
from elixir.booster.hybrid import HybridParallelPlugin
from elixir.booster.launcher import launch, launch_from_torch
from elixir.booster.low_level_zero import LowLevelZeroPlugin
from elixir.booster.plugin import Plugin
from elixir.booster.torch_plugins import OptimizerWrapper, TorchDDPPlugin, TorchFSDPPlugin

__all__ = [
    "Booster", "ElixirPlugin", "GeminiPlugin", "HybridParallelPlugin", "LowLevelZeroPlugin", "OptimizerWrapper", "Plugin", "TorchDDPPlugin",
    "TorchFSDPPlugin", "launch", "launch_from_torch",
]
