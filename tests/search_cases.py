"""Profiles the search's tests share: random layer stacks and a tiny GPT-2 (not a test file);
and the pricing of a disk-shard placement."""

import math

import numpy as np
import torch
from hypothesis import strategies as st

from elixir.plan import Placement
from elixir.plan.placement import DD, HK, KK, RD, RH
from elixir.search.cost_model import Evaluation, Layout, Setting, price, zero_placements
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


def ramped_stack(layers: int = 6, width: int = 3000, peak: int = 400_000) -> StepProfile:
    """A stack of ``layers`` layers (a ``width`` weight and a third as wide a bias each) whose live
    activations (``step_activations``) rise through forward to ``peak`` at the turn and fall
    through backward, as a traced step's do: on one memory pool its terms peak apart."""
    params, steps = [], []
    for i in range(layers):
        names = (f"layers.{i}.w", f"layers.{i}.b")
        params += [(names[0], (width,)), (names[1], (width // 3,))]
        steps.append(names)
    ramp = list(np.linspace(0.1, 1.0, layers)) + list(np.linspace(1.0, 0.05, layers))
    return StepProfile(
        params=tuple(params), shared=frozenset(), steps=tuple(steps + steps[::-1]),
        step_kinds=(FORWARD,) * layers + (BACKWARD,) * layers, activation_bytes=peak,
        step_activations=tuple(int(peak * a) for a in ramp), matmul_param_numel=sum(math.prod(s) for _, s in params),
        tokens=4, dtype="float32", info={"source": "synthetic"},
    )


def disk_shard_evaluation(profile: StepProfile, layout: Layout, st: Setting, blocks: int, gathers: np.ndarray,
                          host_shards: int, rwhere: Placement = Placement.DEVICE) -> Evaluation:
    """:func:`~elixir.search.cost_model.price` of ``layout`` with every body chunk's optimizer
    state on disk: the ``host_shards`` most gathered (``gathers``) keep their shard on the host
    (``HK``), the rest on disk too (``KK``); sharded tied chunks ``DD``, ZeRO-1/2 chunks on the
    device, replicated chunks' state ``rwhere``."""
    n = layout.n_sharded - layout.own
    kinds = [KK] * n
    for c in np.argsort(-np.asarray(gathers[:n]), kind="stable")[:host_shards].tolist():
        kinds[c] = HK
    repl = (RD if rwhere is Placement.DEVICE else RH,) * len(layout.replicated_capacities)
    return price(profile, layout, st, tuple(kinds) + (DD,) * layout.own + zero_placements(st, layout) + repl,
                 blocks, 0, gathers)


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
