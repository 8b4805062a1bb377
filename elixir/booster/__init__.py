"""ColossalAI's Booster API on elixir (floor 6, above everything it uses).

``Booster(plugin=...)`` with :class:`TorchDDPPlugin`, :class:`TorchFSDPPlugin` (FSDP2) and
:class:`GeminiPlugin` (alias :class:`ElixirPlugin`, on ElixirModule/ElixirOptimizer), or
``plugin="auto"`` (the search chooses), and :class:`LowLevelZeroPlugin` (ZeRO-1/2: a plan whose
chunks keep parameters whole and split masters and optimizer state, on the same runtime).
"""

from elixir.booster.booster import Booster
from elixir.booster.gemini import ElixirPlugin, GeminiPlugin
from elixir.booster.low_level_zero import LowLevelZeroPlugin
from elixir.booster.plugin import Plugin
from elixir.booster.torch_plugins import TorchDDPPlugin, TorchFSDPPlugin

__all__ = ["Booster", "ElixirPlugin", "GeminiPlugin", "LowLevelZeroPlugin", "Plugin", "TorchDDPPlugin", "TorchFSDPPlugin"]
