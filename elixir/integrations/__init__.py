"""elixir inside the trainers people already use.

- :mod:`elixir.integrations.lightning`: ``ElixirStrategy`` for the Lightning ``Trainer``
  (importing it registers ``strategy="elixir"`` and its named variants).
- :mod:`elixir.integrations.transformers`: ``ElixirTrainer``, a Hugging Face ``Trainer`` subclass.

Both are built only on elixir's public API (``ElixirModule``, ``ElixirOptimizer``, the searches and
``elixir.checkpoint``); :mod:`elixir.search.placement_policy` turns their ``plan=`` / ``search=`` /
``placement_policy=`` arguments into a plan, the same way for both. ``docs/integrations.md`` says
what each supports and what not.
"""
