"""Hugging Face checkpoints whose keys are not the module's names (issue 36, item 3 and done-when 4).

transformers 5 renames (GPT-NeoX stores ``embed_out.weight`` for ``lm_head``) and fuses (Mixtral,
Qwen3-MoE store experts one by one; the model holds 3-D ``gate_up_proj`` / ``down_proj``).
References: transformers' own ``save_pretrained`` (the keys and values elixir must write) and
``from_pretrained`` (what must load elixir's save), and a plain-torch SGD run on the full batch for
the world-2 training. Each rank's reads are counted at ``hf_conversion.read_rows`` and bounded by
the plan: the elements of its own shards, plus at most one row either side of each piece.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from elixir import checkpoint
from elixir.checkpoint import hf_conversion
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.wrapper import ElixirModule

pytest.importorskip("transformers.conversion_mapping")

KINDS = ["gpt_neox", "mixtral", "qwen3_moe"]
CFG = {
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                     max_position_embeddings=32, tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0),
    "mixtral": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                      num_experts=4, num_experts_per_tok=2, head_dim=8),
}
SHARD = "16KB"  # several files; a layer's experts straddle none (they are reverted together)
LR, STEPS = 0.5, 3


def build(kind: str, device: str = "cpu", seed: int = 0):
    warnings.filterwarnings("ignore")
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **CFG[kind]))


def tensors_of(root: str) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(root)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(root, f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _wrap(model):
    from elixir import distributed as edist

    return ElixirModule(model, minimum_waste_search(model, edist.get_world_size()), init_seed=1)


def _equal(sd: dict, ref: dict, what: str) -> None:
    assert sorted(sd) == sorted(ref), (what, sorted(set(sd) ^ set(ref))[:6])
    for k in ref:
        assert sd[k].dtype == ref[k].dtype and torch.equal(sd[k], ref[k]), (what, k)


@pytest.mark.parametrize("kind", KINDS)
def test_keys_follow_transformers_conversions(kind, tmp_path):
    """Regression: load_pretrained reported embed_out.weight / experts.N.w1.weight missing and
    unexpected; save_pretrained wrote the model's names instead of the hub's layout."""
    from transformers import AutoModelForCausalLM

    ref = build(kind)
    ref.save_pretrained(str(tmp_path / "hf"), max_shard_size=SHARD)
    hub = tensors_of(str(tmp_path / "hf"))
    assert any(k not in ref.state_dict() for k in hub)  # the checkpoint's keys really differ
    em = _wrap(build(kind, "meta"))
    report = checkpoint.load_pretrained(str(tmp_path / "hf"), em)
    assert report.missing_keys == [] and report.unexpected_keys == []
    _equal(em.state_dict(), ref.state_dict(), "load")
    checkpoint.save_pretrained(str(tmp_path / "ours"), em, max_shard_size=SHARD)
    _equal(tensors_of(str(tmp_path / "ours")), hub, "save: the hub's keys and values")
    assert len([f for f in os.listdir(tmp_path / "ours") if f.endswith(".safetensors")]) > 1
    _equal(AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).state_dict(), ref.state_dict(), "round trip")
    # and the plain (not collective) writer used for DDP / FSDP2 models
    checkpoint.save_state_dict_pretrained(str(tmp_path / "plain"), ref.state_dict(), ref, max_shard_size=SHARD)
    _equal(tensors_of(str(tmp_path / "plain")), hub, "save_state_dict_pretrained")


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_fused_experts_are_assembled_from_rows(kind, tmp_path):
    ref = build(kind)
    ref.save_pretrained(str(tmp_path))
    model = build(kind, "meta")
    stored = {}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as h:
        for k in h.keys():
            sl = h.get_slice(k)
            stored[k] = hf_conversion.Stored("model.safetensors", k, tuple(sl.get_shape()), torch.float32)
    keymap = hf_conversion.map_checkpoint(model, stored, set(model.state_dict()),
                                          hf_conversion.load_transforms(model))
    src = keymap.sources["model.layers.1.mlp.experts.gate_up_proj"]
    assert isinstance(src, hf_conversion.Fused) and len(src.stored) == 8  # gate and up of 4 experts
    # the rows of expert 2 only: one run in its gate tensor, one in its up tensor
    inter = ref.model.layers[1].mlp.experts.gate_up_proj.shape[1] // 2
    runs = src.runs(2 * 2 * inter, 3 * 2 * inter)
    assert [src.stored[i].key.split(".experts.")[1] for i, _, _ in runs] == ["2.gate_proj.weight" if kind == "qwen3_moe"
                                                                          else "2.w1.weight",
                                                                          "2.up_proj.weight" if kind == "qwen3_moe"
                                                                          else "2.w3.weight"]
    assert all((lo, hi) == (0, inter) for _, lo, hi in runs)


def test_converter_that_moves_within_rows_is_converted_whole(tmp_path):
    """A converter whose operations are not whole-row moves (a transpose) is run by transformers
    on the whole tensors, then sliced."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import Transpose, WeightConverter

    from elixir.checkpoint.format import Reader

    w = torch.arange(12.0).reshape(3, 4)
    save_file({"w_t": w}, str(tmp_path / "model.safetensors"))
    conv = WeightConverter(source_patterns="w_t", target_patterns="w", operations=[Transpose(0, 1)])
    stored = {"w_t": hf_conversion.Stored("model.safetensors", "w_t", (3, 4), torch.float32)}
    keymap = hf_conversion.map_checkpoint(torch.nn.Module(), stored, {"w"}, [conv])
    src = keymap.sources["w"]
    assert isinstance(src, hf_conversion.Converted) and src.shape == (4, 3)
    reader = Reader(str(tmp_path))
    assert torch.equal(src.read_all(reader), w.t())
    assert torch.equal(src.read(reader, 5, 9), w.t().reshape(-1)[5:9])


# --------------------------------------------------------------------------------------------
# world 2: load_pretrained -> train -> save_pretrained -> from_pretrained


def _batch(kind: str) -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(3))


def _needed_bytes(em) -> tuple[int, int]:
    """Bytes this rank must read (its shard pieces, fp32 checkpoint) and the slack rows allow."""
    need = slack = 0
    for chunks, pmap in ((em.chunks, em.param_map), (em.frozen_chunks, em.frozen_map)):
        for c in chunks:
            for p in pmap.shard_pieces(c.spec):
                need += (p.hi - p.lo) * 4
                shape = pmap.slots[p.param_index].shape
                slack += 2 * shape[-1] * 4 if len(shape) >= 2 else 0
    return need, slack


def _load_train_save(root: str, kinds: list) -> dict:
    from elixir import distributed as edist
    from elixir.wrapper import ElixirOptimizer

    rank, out = edist.get_rank(), {}
    original = hf_conversion.read_rows
    for kind in kinds:
        em = _wrap(build(kind, "meta"))
        read = [0]

        def counting(reader, fname, key, r0, r1, read=read):
            t = original(reader, fname, key, r0, r1)
            read[0] += t.numel() * t.element_size()
            return t

        hf_conversion.read_rows = counting
        try:
            checkpoint.load_pretrained(os.path.join(root, kind, "hf"), em)
        finally:
            hf_conversion.read_rows = original
        opt = ElixirOptimizer(em, torch.optim.SGD(em.parameters(), lr=LR))
        ids = _batch(kind)[rank * 2 : rank * 2 + 2]
        for _ in range(STEPS):
            em(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        checkpoint.save_pretrained(os.path.join(root, kind, "ours"), em, max_shard_size=SHARD)
        sharded = all(c.spec.sharded for c in em.chunks)
        out[kind] = dict(read=read[0], needed=_needed_bytes(em), sharded=sharded, state=em.state_dict(rank0_only=True))
    return out


@pytest.mark.dist
def test_world2_load_train_save_is_exact_and_each_rank_reads_its_rows(tmp_path):
    from transformers import AutoModelForCausalLM

    kinds = ["gpt_neox", "qwen3_moe", "mixtral"]
    for kind in kinds:
        build(kind).save_pretrained(str(tmp_path / kind / "hf"), max_shard_size=SHARD)
    results = run_distributed(_load_train_save, 2, str(tmp_path), kinds, timeout=400)
    for kind in kinds:
        total = sum(t.numel() * 4 for t in tensors_of(str(tmp_path / kind / "hf")).values())
        for rank, res in enumerate(results):
            r = res[kind]
            need, slack = r["needed"]
            assert r["sharded"], kind
            assert need <= r["read"] <= need + slack, (kind, rank, r["read"], need, slack)
            assert r["read"] < 0.75 * total, (kind, rank, r["read"], total)  # its rows, not the checkpoint
        # plain torch on the full batch, from the same checkpoint
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / kind / "hf"))
        opt = torch.optim.SGD(plain.parameters(), lr=LR)
        ids = _batch(kind)
        for _ in range(STEPS):
            plain(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        state = results[0][kind]["state"]
        for k, v in plain.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k, kind=kind: f"{kind} {k}: {m}")
        # the round trip through transformers is exact
        _equal(AutoModelForCausalLM.from_pretrained(str(tmp_path / kind / "ours")).state_dict(), state, kind)
        hub_keys = sorted(tensors_of(str(tmp_path / kind / "hf")))
        assert sorted(tensors_of(str(tmp_path / kind / "ours"))) == hub_keys, kind


@pytest.mark.parametrize("kind", ["gpt_neox", "mixtral"])
def test_read_pretrained_gives_the_models_names(kind, tmp_path):
    """``Booster.load_model`` reads through it: a hub-layout save under the model's own names."""
    ref = build(kind)
    ref.save_pretrained(str(tmp_path), max_shard_size=SHARD)
    _equal(checkpoint.read_pretrained(str(tmp_path), build(kind, "meta")), ref.state_dict(), "read_pretrained")


def test_adapter_directory_is_named(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    em = _wrap(build("gpt_neox", "meta"))
    with pytest.raises(checkpoint.CheckpointError, match="a PEFT adapter directory: load_pretrained reads its base"):
        checkpoint.load_pretrained(str(tmp_path), em)
