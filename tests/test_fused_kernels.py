"""use_fused_kernels: eager HF attention becomes torch's fused SDPA, with the same results on padded
batches as the eager model, less traced activation memory, and refusals where it cannot be exact."""

import copy
import warnings

import pytest
import torch

from elixir.search import minimum_waste_search
from elixir.search.step_profile import profile_step
from elixir.testing.zoo import build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer
from elixir.wrapper.fused_kernels import apply_fused_kernels

VOCAB = 128  # the zoo's HF vocabulary


def eager(name: str):
    model = build_model(name)
    model.set_attn_implementation("eager")
    return model


def padded_batch(seed: int = 0):
    """Four sequences of 16 tokens: full, right-padded, left-padded, mostly padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, 11:] = 0
    mask[2, :5] = 0
    mask[3, 3:] = 0
    # a label is scored from the previous position's logits: score only labels whose previous
    # position is a real token (a padded query's output is undefined in both implementations)
    prev_real = torch.cat([torch.zeros(4, 1, dtype=torch.long), mask[:, :-1]], dim=1)
    labels = ids.masked_fill((mask == 0) | (prev_real == 0), -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt"])
def test_fused_attention_matches_eager_on_padded_batches(name):
    ref = eager(name)
    fused = copy.deepcopy(ref)
    changed = apply_fused_kernels(fused)
    assert changed and fused.config._attn_implementation == "sdpa" and ref.config._attn_implementation == "eager"
    batch = padded_batch()
    out_r, out_f = ref(**batch), fused(**batch)
    keep = batch["attention_mask"].bool()
    assert torch.allclose(out_f.logits[keep], out_r.logits[keep], rtol=1e-5, atol=1e-5)
    assert torch.allclose(out_f.loss, out_r.loss, rtol=1e-6, atol=1e-6)
    out_r.loss.backward()
    out_f.loss.backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            assert torch.allclose(b.grad, a.grad, rtol=1e-4, atol=1e-6), n


def test_fused_attention_keeps_less_for_backward():
    """What the flag buys, as the tracer measures it: eager attention keeps the attention
    probabilities (batch x heads x seq x seq) for backward; the fused kernel does not."""
    def step(model, batch):
        model(**batch).loss.backward()

    seq = 64
    ids = torch.zeros(2, seq, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    ref = eager("gpt2")
    fused = copy.deepcopy(ref)
    apply_fused_kernels(fused)
    a, b = profile_step(ref, batch, step), profile_step(fused, batch, step)
    assert b.activation_bytes < a.activation_bytes, (a.activation_bytes, b.activation_bytes)


def test_elixir_module_applies_it_and_trains_like_the_eager_model():
    ref, model = eager("gpt2"), eager("gpt2")
    em = ElixirModule(model, minimum_waste_search(model, 1), use_fused_kernels=True)
    assert em.fused_kernels and model.config._attn_implementation == "sdpa"
    opt = ElixirOptimizer(em, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        batch = padded_batch(step)
        loss = em(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), step


def test_refuses_where_it_cannot_be_exact_and_warns_when_idle():
    model = eager("gpt2")
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions"):
        apply_fused_kernels(model)
    with pytest.raises(ValueError, match="output_attentions"):
        ElixirModule(model, minimum_waste_search(model, 1), use_fused_kernels=True)
    already = build_model("gpt2")  # the zoo builds sdpa models
    # the note names what each model already runs and which models the flag helps (before: only
    # "changed nothing", though current transformers picks sdpa for every model that has it)
    with pytest.warns(UserWarning, match=r"changed nothing: the Hugging Face models here already run GPT2LMHeadModel \(sdpa\) "
                                         r"attention\. It helps only models running eager attention.*attn_implementation='eager'"):
        assert apply_fused_kernels(already) == []
    with pytest.warns(UserWarning, match="changed nothing: there is no Hugging Face transformers model here"):
        apply_fused_kernels(build_model("convnet"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ElixirModule(already, minimum_waste_search(already, 1))  # the default does not touch it
