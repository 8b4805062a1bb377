"""The runtime fires exactly the steps the tracer's hooks see.

A plan's ``param_order`` is only valid while the tracer (``tracer/hooks.install_step_hooks``) and
the runtime (``ElixirModule``) agree on what a step is: which module calls are steps, in which
order, forward and backward. On every zoo model, one training step runs with both sets of hooks on
the same modules; the sharded chunk sets the tracer's steps touch must equal the runtime's own
record of the chunks it gathered, step for step (``ElixirModule.observed_order``).
"""

from __future__ import annotations

import pytest

from elixir.search import minimum_waste_search
from elixir.testing.zoo import ZOO, build_model
from elixir.tracer.hooks import borrowed_children, install_step_hooks, step_params
from elixir.wrapper import ElixirModule


@pytest.mark.parametrize("name", sorted(ZOO))
def test_runtime_fires_the_traced_steps(name):
    zc = ZOO[name]
    model = build_model(name)
    # host shards: every chunk but the replicated ones stays sharded at world size 1
    em = ElixirModule(model, minimum_waste_search(model, 1, cpu_offload=True))
    borrowed = borrowed_children(em.module)

    def chunk_set(module) -> frozenset:  # trainable and frozen chunks (global indices), as the runtime records them
        slots = [em.param_map.slot_of(p) or em.frozen_map.slot_of(p) for p in step_params(module, borrowed)]
        return frozenset(s.chunk for s in slots if s is not None and em.all_chunks[s.chunk].spec.sharded)

    traced = []
    hooks = install_step_hooks(
        em.module,
        on_forward=lambda kind, _name, m: traced.append((kind, chunk_set(m))),
        on_backward=lambda kind, _name, m: traced.append((kind, chunk_set(m))),
    )
    try:
        zc.loss(em, zc.make_batch(2, 0)).backward()
    finally:
        hooks.remove()
    expected = [s for _, s in traced if s]
    assert any(em.chunks[c].spec.sharded for c in range(len(em.chunks))), "the plan shards nothing: the test sees no step"
    assert [kind for kind, s in traced if s].count("backward") > 0
    assert em.observed_order == expected
