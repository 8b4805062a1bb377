"""elixir.checkpoint.save_pretrained / load_pretrained: Hugging Face directories in and out.

References: the original plain model's state dict (bit for bit), transformers' own
``from_pretrained`` and ``save_pretrained``, and a plain-torch training step on the same weights.
Covers LLaMA, a tied model (GPT-2) and an encoder-decoder (T5); world sizes 1, 2 and 4; chunks
whose master is on disk; a bf16 file into fp32 masters; HF's missing/unexpected key rules; and the
wrapped model's own ``save_pretrained`` (issue 20, item 5)."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import torch

from elixir import checkpoint
from elixir.checkpoint import CheckpointError
from elixir.plan import Placement
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.wrapper import ElixirModule, ElixirOptimizer
from elixir.wrapper.hf_guard import WrappedSaveError

KINDS = ["llama", "gpt2", "t5"]
CFG = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
    "t5": dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=128, decoder_start_token_id=0,
               pad_token_id=0, dropout_rate=0.0),
}
SHARD = "40KB"  # several files for every kind


def build(kind: str, device: str = "cpu", seed: int = 0):
    warnings.filterwarnings("ignore")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if kind == "t5" else AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        return auto.from_config(AutoConfig.for_model(kind, **CFG[kind])).eval()


def batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 128, (4, 10), generator=g)
    if kind == "t5":
        return {"input_ids": ids, "labels": torch.randint(3, 128, (4, 6), generator=g)}
    return {"input_ids": ids, "labels": ids}


def _disk(plan):
    chunks = [dataclasses.replace(c, optim_placement=Placement.DISK) if c.sharded else c for c in plan.chunks]
    return dataclasses.replace(plan, chunks=chunks)


def _wrap(model, disk: bool = False, seed: int = 1):
    from elixir import distributed as edist

    plan = minimum_waste_search(model, edist.get_world_size())
    return ElixirModule(model, _disk(plan) if disk else plan, init_seed=seed)


def _save_all(root: str) -> None:
    for kind in KINDS:
        checkpoint.save_pretrained(os.path.join(root, kind), _wrap(build(kind)), max_shard_size=SHARD)


def _load_all(root: str, disk: bool) -> dict:
    out = {}
    for kind in KINDS:
        em = _wrap(build(kind, "meta"), disk=disk)  # meta-built: every value comes from the files
        report = checkpoint.load_pretrained(os.path.join(root, kind), em)
        assert report.missing_keys == [] and report.unexpected_keys == []
        out[kind] = em.state_dict()
    return out


def _assert_equal(sd: dict, ref: dict, what: str) -> None:
    assert sd.keys() == ref.keys(), what
    for k in ref:
        assert sd[k].dtype == ref[k].dtype and torch.equal(sd[k], ref[k]), (what, k)


@pytest.mark.dist
def test_round_trip_world_1_2_4_and_disk(tmp_path):
    root = str(tmp_path)
    run_distributed(_save_all, 2, root, timeout=240)
    refs = {kind: build(kind).state_dict() for kind in KINDS}
    for kind in KINDS:
        files = sorted(f for f in os.listdir(os.path.join(root, kind)) if f.endswith(".safetensors"))
        assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    for world, disk in ((1, False), (2, True), (4, False)):
        for sds in run_distributed(_load_all, world, root, disk, timeout=300):
            for kind in KINDS:
                _assert_equal(sds[kind], refs[kind], f"{kind} world {world} disk {disk}")


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_loads_our_save_and_we_load_theirs(kind, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if kind == "t5" else AutoModelForCausalLM
    ref = build(kind)
    checkpoint.save_pretrained(str(tmp_path / "ours"), _wrap(build(kind)), max_shard_size=SHARD)
    assert os.path.isfile(tmp_path / "ours" / "config.json")
    with open(tmp_path / "ours" / "model.safetensors.index.json") as f:
        index = json.load(f)
    if kind == "gpt2":  # tied: saved once, under the tie's source
        assert "transformer.wte.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
    theirs = auto.from_pretrained(str(tmp_path / "ours"))
    _assert_equal(theirs.state_dict(), ref.state_dict(), "from_pretrained")
    # and transformers' own sharded save loads into a wrapped model
    ref.save_pretrained(str(tmp_path / "hf"), max_shard_size="50KB")
    em = _wrap(build(kind, "meta"))
    checkpoint.load_pretrained(str(tmp_path / "hf"), em)
    _assert_equal(em.state_dict(), ref.state_dict(), "load of transformers' save")


@pytest.mark.parametrize("kind", KINDS)
def test_training_step_after_load_equals_plain_torch(kind, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if kind == "t5" else AutoModelForCausalLM
    build(kind).save_pretrained(str(tmp_path))
    em = _wrap(build(kind, "meta").train())
    checkpoint.load_pretrained(str(tmp_path), em)
    plain = auto.from_pretrained(str(tmp_path)).train()
    eo = ElixirOptimizer(em, torch.optim.AdamW(em.parameters(), lr=1e-2))
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for _ in range(2):
        loss, ref = em(**batch(kind)).loss, plain(**batch(kind)).loss
        loss.backward()
        ref.backward()
        eo.step()
        popt.step()
        eo.zero_grad()
        popt.zero_grad()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    sd = em.state_dict()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_bf16_file_into_fp32_masters(tmp_path):
    ref = build("llama")
    checkpoint.save_pretrained(str(tmp_path), _wrap(build("llama")), max_shard_size=SHARD, dtype=torch.bfloat16)
    from safetensors import safe_open

    first = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[0]
    with safe_open(str(tmp_path / first), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    em = _wrap(build("llama", "meta"))
    checkpoint.load_pretrained(str(tmp_path), em)
    assert all(c.master.dtype == torch.float32 for c in em.chunks)
    _assert_equal(em.state_dict(), {k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()}, "bf16")


def test_key_rules_strict_and_not(tmp_path):
    # a base model's checkpoint (no head, no "model." prefix) into a model with a head
    base = build("llama").model
    base.save_pretrained(str(tmp_path / "base"))
    em = _wrap(build("llama", "meta"))
    with pytest.raises(CheckpointError, match=r"missing keys \['lm_head.weight'\].*strict=False"):
        checkpoint.load_pretrained(str(tmp_path / "base"), em)
    report = checkpoint.load_pretrained(str(tmp_path / "base"), em, strict=False)
    assert report.missing_keys == ["lm_head.weight"] and report.unexpected_keys == []
    assert torch.equal(em.state_dict()["model.embed_tokens.weight"], base.state_dict()["embed_tokens.weight"])
    # another model's checkpoint: named, nothing modified
    build("gpt2").save_pretrained(str(tmp_path / "gpt2"))
    before = em.state_dict()
    with pytest.raises(CheckpointError, match="unexpected keys"):
        checkpoint.load_pretrained(str(tmp_path / "gpt2"), em)
    _assert_equal(em.state_dict(), before, "unchanged after a refused load")
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        checkpoint.load_pretrained(str(tmp_path), em)


def _wrapped_save_pretrained(root: str) -> str:
    em = _wrap(build("gpt2"))
    try:
        em.module.save_pretrained(os.path.join(root, "plain"))
    except WrappedSaveError as e:
        msg = str(e)
    else:
        msg = ""
    # with a gathered state dict (what a trainer passes) it works, as before
    sd = em.state_dict(rank0_only=True)
    if em.rank == 0:
        em.module.save_pretrained(os.path.join(root, "gathered"), state_dict=sd)
    return msg


@pytest.mark.dist
def test_wrapped_models_own_save_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    ref = build("gpt2").state_dict()
    msgs = run_distributed(_wrapped_save_pretrained, 2, str(tmp_path), timeout=120)
    assert all("elixir.checkpoint.save_pretrained" in m for m in msgs), msgs
    assert not os.path.exists(tmp_path / "plain")  # refused before writing anything
    _assert_equal(AutoModelForCausalLM.from_pretrained(str(tmp_path / "gathered")).state_dict(), ref, "gathered")
    # at world size 1 it simply works
    em = _wrap(build("gpt2"))
    em.module.save_pretrained(str(tmp_path / "solo"))
    _assert_equal(AutoModelForCausalLM.from_pretrained(str(tmp_path / "solo")).state_dict(), ref, "solo")
