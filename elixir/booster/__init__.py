"""ColossalAI's Booster API on elixir (floor 6, above everything it uses).

``Booster(plugin=...)`` with :class:`TorchDDPPlugin`, :class:`TorchFSDPPlugin` (FSDP2) and
:class:`GeminiPlugin` (alias :class:`ElixirPlugin`, on ElixirModule/ElixirOptimizer), or
``plugin="auto"`` (the search chooses). ``LowLevelZeroPlugin`` is not available yet: it needs a
per-chunk ZeRO-2 kind in the runtime (docs/booster.md).
"""

from elixir.booster.booster import Booster
from elixir.booster.gemini import ElixirPlugin, GeminiPlugin
from elixir.booster.plugin import Plugin
from elixir.booster.torch_plugins import TorchDDPPlugin, TorchFSDPPlugin

__all__ = ["Booster", "ElixirPlugin", "GeminiPlugin", "Plugin", "TorchDDPPlugin", "TorchFSDPPlugin"]
