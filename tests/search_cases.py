"""Profiles the search's tests share: random layer stacks and a tiny GPT-2 (not a test file)."""

import math

import torch
from hypothesis import strategies as st

from elixir.search.step_profile import BACKWARD, FORWARD, StepProfile


@st.composite
def layer_stacks(draw):
    """A random stack: optional tied embedding, layers of 1-3 params, forward then reversed backward."""
    layers = draw(st.integers(1, 4))
    per_layer = draw(st.lists(st.integers(8, 3000), min_size=1, max_size=3))
    params, steps = [], []
    tied = draw(st.booleans())
    if tied:
        params.append(("emb.weight", (draw(st.integers(8, 2000)),)))
    for i in range(layers):
        names = []
        for j, n in enumerate(per_layer):
            name = f"layers.{i}.p{j}"
            params.append((name, (n,)))
            names.append(name)
        steps.append(tuple(names))
    fwd = ([("emb.weight",)] if tied else []) + steps + ([("emb.weight",)] if tied else [])
    kinds = [FORWARD] * len(fwd) + [BACKWARD] * len(fwd)
    return StepProfile(
        params=tuple(params), shared=frozenset({"emb.weight"} if tied else ()), steps=tuple(fwd + fwd[::-1]),
        step_kinds=tuple(kinds), activation_bytes=draw(st.integers(0, 200_000)),
        matmul_param_numel=sum(math.prod(s) for _, s in params), tokens=4,
        dtype=draw(st.sampled_from(["float32", "bfloat16"])), info={"source": "synthetic"},
    )


def tiny_gpt():
    from elixir.testing.zoo import build_gpt2  # noqa: PLC0415 - the zoo imports transformers: only when used

    torch.manual_seed(0)
    return build_gpt2(n_layer=3, n_embd=32)


def tiny_gpt2_config(folder) -> str:
    """A 2-layer GPT-2 ``config.json`` written into ``folder`` (a path), for ``elixir plan``; its path."""
    import json  # noqa: PLC0415

    path = f"{folder}/config.json"
    with open(path, "w") as f:
        json.dump({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128,
                   "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0}, f)
    return path
