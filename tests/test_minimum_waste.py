"""minimum_waste_search: padding waste on real-size models (built on meta), tied weights, cache
blocks, traced order, and the plan's JSON round trip."""

from __future__ import annotations

import pytest
import torch

from elixir.search import SearchResult, minimum_waste_search
from elixir.search.minimum_waste import best_chunk_size, cache_blocks_needed, pack, shared_params
from elixir.testing.zoo import ZOO, build_model


def _meta(config_name: str, **kw):
    import transformers

    cfg = getattr(transformers, config_name)(**kw)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


REAL = {
    "gpt2-small": lambda: _meta("GPT2Config"),
    "gpt2-medium": lambda: _meta("GPT2Config", n_embd=1024, n_layer=24, n_head=16),
    "opt-125m": lambda: _meta("OPTConfig"),
    "opt-1.3b": lambda: _meta("OPTConfig", hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192),
    "llama-1b": lambda: _meta(
        "LlamaConfig", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4,
    ),
}


@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize("world", [1, 8])
def test_waste_below_one_percent_on_real_sizes(name, world):
    model = REAL[name]()
    sr = minimum_waste_search(model, world)
    assert sr.waste() <= 0.01, f"{name} at world {world}: waste {100 * sr.waste():.2f}%"
    # every trainable parameter is planned exactly once; shapes agree
    planned = sr.param_names
    assert sorted(planned) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert all(c.chunk_size % world == 0 for c in sr.chunks if c.sharded)
    assert sr.info["search_time_s"] < 30


def test_tied_embedding_gets_its_own_replicated_chunk():
    model = REAL["gpt2-small"]()
    sr = minimum_waste_search(model, 4)
    assert shared_params(model) == {"transformer.wte.weight"}
    (rep,) = [c for c in sr.chunks if not c.sharded]
    assert rep.params == ("transformer.wte.weight",) and rep.chunk_size == rep.used
    assert all("transformer.wte.weight" not in c.params for c in sr.chunks if c.sharded)


def test_packing_is_in_order_and_never_overflows():
    numels = [5, 3, 7, 2, 2, 9, 1, 30, 4]
    chunks = pack(numels, 10, align=2, oversize=20)
    assert [i for c, _ in chunks for i in c] == list(range(len(numels)))
    assert all(sum(numels[i] for i in c) <= cap for c, cap in chunks)
    caps = [cap for _, cap in chunks]
    # first and last chunks trimmed to their contents, the oversized param alone and sized to fit
    assert caps == [8, 10, 10, 10, 30, 4]
    # the best size is never below the largest parameter and is a multiple of the alignment
    size = best_chunk_size(numels, align=4)
    assert size >= 9 and size % 4 == 0


def test_best_chunk_size_finds_exact_fit():
    numels = [6, 6, 6, 6, 6, 6]
    assert best_chunk_size(numels, align=2, cap=40) in (6, 12, 18, 36)  # zero padding at each
    pad = [best_chunk_size(numels, align=2, cap=40)]
    assert pad


def test_cache_blocks_cover_every_step_and_recompute():
    chunk_of = {"a": 0, "b": 0, "c": 1, "d": 2}
    assert cache_blocks_needed(chunk_of, [("a",), ("b", "c"), ("d",)]) == 2
    # a recompute step runs while the last backward step's chunks stay pinned
    steps = [("a",), ("d",), ("d",), ("a",), ("c",)]
    kinds = ["forward", "forward", "backward", "recompute", "recompute"]
    assert cache_blocks_needed(chunk_of, steps, kinds=kinds) == 2
    # a module nested in another pins both
    assert cache_blocks_needed(chunk_of, [("c",)], nested=[("d",)]) == 2


@pytest.mark.parametrize("name", ["gpt2", "bert", "routed", "frozen"])
def test_zoo_plans_are_valid_and_round_trip_json(tmp_path, name):
    model = build_model(name)
    sr = minimum_waste_search(model, 2, prefetch=True)
    assert sr.cache_blocks >= 1 and sr.prefetch_depth == 1
    # frozen parameters are packed into frozen chunks of their own, never beside trainable ones
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert {n for c in sr.frozen_chunks for n in c.params} == frozen and not sr.frozen_params
    assert not frozen & {n for c in sr.chunks for n in c.params}
    path = tmp_path / "plan.json"
    sr.save(path)
    back = SearchResult.load(path)
    assert back.chunks == sr.chunks and back.cache_blocks == sr.cache_blocks
    assert back.frozen_chunks == sr.frozen_chunks


def test_frozen_chunks_can_be_left_out():
    model = build_model("frozen")
    sr = minimum_waste_search(model, 2, frozen_chunks=False)
    assert not sr.frozen_chunks
    assert set(sr.frozen_params) == {n for n, p in model.named_parameters() if not p.requires_grad}


def test_traced_order_packs_by_first_use():
    case = ZOO["opt"]
    model = build_model("opt")
    sr = minimum_waste_search(model, 2, prefetch=True, inp=case.make_batch(4, 0), step_fn=case.step_fn)
    assert sr.info["traced"] and sr.param_order
    # OPT defines final_layer_norm before the layers but runs it last: traced packing puts it last
    sharded = [n for c in sr.chunks if c.sharded for n in c.params]
    assert sharded.index("model.decoder.final_layer_norm.weight") > sharded.index("model.decoder.layers.1.fc2.weight")
    defn = minimum_waste_search(model, 2)
    d_sharded = [n for c in defn.chunks if c.sharded for n in c.params]
    assert d_sharded.index("model.decoder.final_layer_norm.weight") < d_sharded.index("model.decoder.layers.0.fc1.weight")


def test_verbose_prints_a_table(capsys):
    minimum_waste_search(build_model("gpt2"), 2, verbose=True)
    out = capsys.readouterr().out
    for word in ("chunk size", "waste", "rCache", "search"):
        assert word in out


def test_bad_arguments():
    with pytest.raises(ValueError, match="group_size"):
        minimum_waste_search(build_model("tied"), 0)
    with pytest.raises(ValueError, match="inp and step_fn"):
        minimum_waste_search(build_model("tied"), 1, inp={"x": 1})


class _TwoBiasFree(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8, bias=False)
        self.b = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    "build",
    [lambda: torch.nn.Embedding(10, 4), lambda: torch.nn.Linear(8, 8, bias=False), _TwoBiasFree],
    ids=["embedding", "linear_no_bias", "two_identical_linears"],
)
def test_models_whose_every_param_exceeds_the_cap_are_planned(build, world):
    """Every parameter above the default cap (a quarter of the model) used to leave no parameter
    to pack and crash with "max() arg is an empty sequence"; each now gets a chunk of its own."""
    model = build()
    sr = minimum_waste_search(model, world)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n for c in sr.chunks for n in c.params) == sorted(names)
    numel = dict((n, p.numel()) for n, p in model.named_parameters())
    for c in sr.chunks:
        assert c.sharded and c.chunk_size >= sum(numel[n] for n in c.params)
        assert c.chunk_size % (16 * world) == 0
    assert sr.cache_blocks >= 1
    assert sr == SearchResult.from_json(sr.to_json())
