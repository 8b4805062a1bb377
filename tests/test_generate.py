"""``ElixirModule.generate`` (issue 36, item 10): the wrapped Hugging Face model's ``generate`` on the
chunks, on every rank, giving the tokens the plain model gives.

At world size 2 each rank generates from its own prompts and for its own number of new tokens, so
one rank finishes first and keeps stepping with the other (``synced_gpus``, elixir's default there);
the reference is the plain model with the same weights, in the same process. Covers a dense model
(GPT-NeoX), a fused-expert MoE (Qwen3-MoE) and a LoRA (PEFT) model, whose steps go through its base.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.wrapper import ElixirModule

pytest.importorskip("transformers")

CFG = {
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                     max_position_embeddings=64, tie_word_embeddings=False),
    "qwen3_moe": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
                      num_experts=4, num_experts_per_tok=2, head_dim=8),
}


def build(kind: str):
    warnings.filterwarnings("ignore")
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    base = kind.removesuffix("-lora")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(base, **CFG[base], eos_token_id=None,
                                                                  pad_token_id=0)).eval()
    if kind.endswith("-lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["query_key_value"], lora_dropout=0.0,
                                                 init_lora_weights="gaussian"))
    return model


def _generate(kinds: list) -> dict:
    from elixir import distributed as edist

    rank, world = edist.get_rank(), edist.get_world_size()
    out = {}
    for kind in kinds:
        model = build(kind)
        plain = copy.deepcopy(model)
        em = ElixirModule(model, minimum_waste_search(model, world))
        prompts = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(10 + rank))
        new = 3 + 4 * rank  # the ranks finish at different steps
        ours = em.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                           do_sample=False)
        with torch.no_grad():
            ref = plain.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                                 do_sample=False)
        # and the wrapper still trains afterwards (the routing is undone)
        ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(3))
        em.train()
        loss = em(input_ids=ids, labels=ids).loss
        loss.backward()
        out[kind] = dict(ours=ours, ref=ref, new=new, sharded=all(c.spec.sharded for c in em.chunks),
                         forward_restored="forward" not in em.module.__dict__, loss=float(loss))
    return out


@pytest.mark.dist
def test_generate_on_every_rank_gives_the_plain_models_tokens():
    pytest.importorskip("peft")
    kinds = ["gpt_neox", "qwen3_moe", "gpt_neox-lora"]
    results = run_distributed(_generate, 2, kinds, timeout=300)
    for rank, res in enumerate(results):
        for kind in kinds:
            r = res[kind]
            assert r["sharded"] and r["forward_restored"] and r["loss"] == r["loss"], kind
            assert r["ours"].shape[1] == 5 + r["new"], (kind, rank)
            assert torch.equal(r["ours"], r["ref"]), (kind, rank, r["ours"], r["ref"])


def test_generate_needs_a_generating_model():
    lin = torch.nn.Linear(4, 4)
    em = ElixirModule(lin, minimum_waste_search(lin, 1))
    with pytest.raises(AttributeError, match="synced_gpus=True"):
        em.generate(torch.zeros(1, 4))
