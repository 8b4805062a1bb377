"""elixir as a Lightning strategy (needs ``pip install 'elixir[lightning]'``, lightning >= 2.4).

Importing this module registers ``strategy="elixir"`` and its named variants (``elixir_spawn``,
``elixir_fork``, ``elixir_cpu_offload``, ``elixir_auto``) with Lightning's ``StrategyRegistry``::

    import elixir.integrations.lightning  # noqa: F401  (registers "elixir")
    trainer = L.Trainer(strategy="elixir", accelerator="cpu", devices=2, precision="bf16-mixed")

or pass an instance: ``L.Trainer(strategy=ElixirStrategy(placement_policy="auto"))``.

One adaptation of Lightning internals happens at import, because Lightning offers no hook for it:
its accelerator connector chooses the precision plugin by strategy type (it knows only its own
DeepSpeed, FSDP and XLA by name) and, on CPU, rewrites ``precision="16-mixed"`` to
``"bf16-mixed"`` before any strategy sees the flag. elixir runs fp16 on CPU with its own loss
scaling, so the connector's ``_check_and_init_precision`` is wrapped to hand an
:class:`ElixirStrategy` an :class:`ElixirPrecision` of the flag as given; for every other strategy
it behaves exactly as before.
"""

from __future__ import annotations

import functools

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.connectors import accelerator_connector as _connector

from elixir.integrations.lightning.precision import ElixirPrecision
from elixir.integrations.lightning.strategy import ElixirStrategy


def _route_precision_to_elixir() -> None:
    cls = _connector._AcceleratorConnector
    original = cls._check_and_init_precision
    if getattr(original, "_elixir_routed", False):
        return

    @functools.wraps(original)
    def check_and_init_precision(self):
        if isinstance(self.strategy, ElixirStrategy) and not isinstance(self._precision_plugin_flag, Precision):
            self._validate_precision_choice()
            return ElixirPrecision(self._precision_flag)
        return original(self)

    check_and_init_precision._elixir_routed = True
    cls._check_and_init_precision = check_and_init_precision


ElixirStrategy.register_strategies(StrategyRegistry)
_route_precision_to_elixir()

__all__ = ["ElixirPrecision", "ElixirStrategy"]
