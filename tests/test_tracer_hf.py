"""The tracer on ordinary Hugging Face batches (issue 36, items 1 and 6).

A tokenizer's batch carries an ``attention_mask``, and transformers branches on its values
(``padding_mask.all()``); MoE models route tokens with weight-dependent ``nonzero`` or a grouped
matmul whose meta kernel is bf16-only. Every family below is a tiny config built locally (no hub).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers as T

from elixir.hardware import load_profile
from elixir.search.optimal import optimal_search, search_profile
from elixir.search.step_profile import profile_step
from elixir.tracer import TracerError, memory_profiling

HW = load_profile("cpu-box")
V, B, S = 64, 2, 8
_DEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=V, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=V,
            max_position_embeddings=40, pad_token_id=0)


def _lm_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0  # the second sequence is padded, as a tokenizer pads it
    ids[1, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def _whisper_batch() -> dict:
    lm = _lm_batch()
    return {"input_features": torch.randn(B, 8, 32), "decoder_input_ids": lm["input_ids"],
            "decoder_attention_mask": lm["attention_mask"], "labels": lm["labels"]}


def _vit_batch() -> dict:
    return {"pixel_values": torch.randn(B, 3, 16, 16), "labels": torch.tensor([0, 2])}


# family -> (build, batch); kept tiny so the whole matrix runs in seconds
FAMILIES = {
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**_DEC)), _lm_batch),
    "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**_DEC)), _lm_batch),
    "gemma3": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**_DEC, sliding_window=4)), _lm_batch),
    "olmo2": (lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**{k: v for k, v in _DEC.items() if k != "head_dim"})),
              _lm_batch),
    "gpt_bigcode": (lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
        n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=32, bos_token_id=1, eos_token_id=2)), _lm_batch),
    "bert": (lambda: T.BertForMaskedLM(T.BertConfig(**_ENC)), _lm_batch),
    "roberta": (lambda: T.RobertaForMaskedLM(T.RobertaConfig(**_ENC)), _lm_batch),
    "deberta_v2": (lambda: T.DebertaV2ForMaskedLM(T.DebertaV2Config(**_ENC)), _lm_batch),
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=V, decoder_start_token_id=0,
        pad_token_id=0)), _lm_batch),
    "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
        vocab_size=V, pad_token_id=0, decoder_start_token_id=1, eos_token_id=2, bos_token_id=1)), _whisper_batch),
    "qwen3_moe": (lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        **_DEC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)), _lm_batch),
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(**_DEC, num_local_experts=4, num_experts_per_tok=2)),
                _lm_batch),
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=4, num_labels=3)), _vit_batch),
}


def _step(model, batch):
    model(**batch).loss.backward()


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[name][0]()


def _plans_both_dtypes(name: str, **kwargs) -> None:
    model, batch = _build(name), FAMILIES[name][1]()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for dtype in (torch.float32, torch.bfloat16):
        r = optimal_search(model, 2, dtype, inp=batch, step_fn=_step, hardware=HW, process_bytes=0, **kwargs)
        assert set(r.param_names) == trainable, (name, dtype)
        assert r.param_order is not None and r.info["activation_bytes"] > 0, (name, dtype)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_optimal_search_plans_hf_families_with_attention_mask(name):
    """Before the fix every family whose batch has an attention_mask raised TracerError
    (``_local_scalar_dense``, from transformers' own mask code); the MoE ones also failed in fp32.
    The trace is the same for every search; the pure ZeRO-3 search keeps this matrix cheap."""
    _plans_both_dtypes(name, body_sharding="sharded")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_optimal_search_plans_hf_families_mixed(name):
    """The same matrix through the default (mixed ZeRO-3 / ZeRO-1/2) search: 1-6 s a family."""
    _plans_both_dtypes(name)


@pytest.mark.parametrize("name", ["llama", "bert", "deberta_v2", "t5"])
def test_padded_batch_traces_the_branch_a_real_run_takes(name):
    """The meta trace answers the mask checks from the batch's real values, so it follows the real
    run's control flow: its memory matches the same step on real tensors, padded or not."""
    model = _build(name)
    padded = FAMILIES[name][1]()
    full = dict(padded, attention_mask=torch.ones_like(padded["attention_mask"]))
    preds = {}
    for label, batch in (("padded", padded), ("unpadded", full)):
        pm = memory_profiling(model, batch, _step)
        pr = memory_profiling(model, batch, _step, target="real")
        assert abs(pm.activation_occ - pr.activation_occ) <= 0.02 * pr.activation_occ, (label, pm.activation_occ,
                                                                                        pr.activation_occ)
        assert pm.order.params_per_step == pr.order.params_per_step
        preds[label] = pm.activation_occ
    if name == "llama":  # padding makes sdpa take an explicit mask where the unpadded batch is causal
        assert preds["padded"] != preds["unpadded"]


def test_deberta_without_attention_mask_traces():
    """DeBERTa's ``warn_if_padding_and_no_attention_mask`` indexes the ids with a Python list
    (``pad_token_id in input_ids[:, [-1, 0]]``); before the fix it raised TracerError."""
    model, batch = _build("deberta_v2"), _lm_batch()
    del batch["attention_mask"]
    for dtype in (torch.float32, torch.bfloat16):
        optimal_search(model, 2, dtype, inp=batch, step_fn=_step, hardware=HW, process_bytes=0)


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_moe_traces_in_every_dtype(impl):
    """Before the fix: fp32 raised a raw RuntimeError from torch's meta ``_grouped_mm`` ("Expected
    inputs of BF16 type"); eager experts raised NotImplementedError for ``nonzero``. The grouped
    matmul's memory and FLOPs do not depend on the routing (tokens x top_k rows in all)."""
    model = _build("qwen3_moe")
    model.set_experts_implementation(impl)
    batch = _lm_batch()
    profs = {}
    for dtype in (torch.float32, torch.bfloat16):
        profs[dtype] = profile_step(model, batch, _step, dtype)
        optimal_search(model, 2, dtype, inp=batch, step_fn=_step, hardware=HW, process_bytes=0)
    assert profs[torch.bfloat16].activation_bytes < profs[torch.float32].activation_bytes
    assert profs[torch.float32].op_costs.matmul_flops == profs[torch.bfloat16].op_costs.matmul_flops
    assert model.config._experts_implementation == impl  # the caller's model is untouched


class _Grouped(nn.Module):
    def __init__(self, groups=3, k=8, n=16):
        super().__init__()
        self.w = nn.Parameter(torch.randn(groups, k, n))

    def forward(self, x, offs):
        return torch.nn.functional.grouped_mm(x, self.w, offs=offs).pow(2).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_is_shaped_and_priced_in_every_dtype(dtype):
    """Meta ``_grouped_mm`` in any float dtype, priced 2 M K N whatever the split (forward, and
    the weight gradient in backward)."""
    m, k, n = 12, 8, 16
    batch = {"x": torch.randn(m, k), "offs": torch.tensor([4, 8, 12], dtype=torch.int32)}
    step = lambda mod, b: mod(b["x"], b["offs"]).backward()  # noqa: E731
    pm = memory_profiling(_Grouped(k=k, n=n), batch, step, dtype)
    assert pm.op_costs.matmul_flops == 2 * (2 * m * k * n)
    assert pm.grad_occ == 3 * k * n * dtype.itemsize


def test_moe_meta_matches_real_with_grouped_experts():
    """The grouped path on meta allocates what a real CPU run of the same path allocates."""
    model = _build("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    batch = _lm_batch()
    pm = memory_profiling(model, batch, _step)
    pr = memory_profiling(model, batch, _step, target="real")
    assert abs(pm.activation_occ - pr.activation_occ) <= 0.02 * pr.activation_occ, (pm.activation_occ,
                                                                                    pr.activation_occ)


# ------------------------------------------------------------------------------------------------
# what is known and what is not


class _Gate(nn.Module):
    """Branches on an activation: truly data-dependent (the weights decide)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if (h > 0).any():  # the line the error must name
            h = h * 2
        return h.sum()


def test_truly_data_dependent_step_names_the_frame_and_the_fix():
    batch = {"x": torch.randn(3, 4)}
    with pytest.raises(TracerError) as info:
        memory_profiling(_Gate(), batch, lambda m, b: m(b["x"]).backward())
    msg = str(info.value)
    assert "test_tracer_hf.py:" in msg and "if (h > 0).any()" in msg and "your code" in msg
    assert "target='real'" in msg and "search_profile" in msg
    # the fix the message names works
    prof = profile_step(_Gate(), batch, lambda m, b: m(b["x"]).backward(), target="real")
    assert search_profile(prof, 1, hardware=HW, process_bytes=0).chunks


def test_values_from_the_batch_are_known_and_follow_writes():
    seen = []

    def step(m, b):
        ids, mask = b["ids"], b["mask"]
        seen.append((int(mask[0].sum()), int(mask[1].sum()), bool(mask.all()), int((ids == 0).nonzero().shape[0])))
        pos = torch.arange(ids.shape[1], device=ids.device)
        seen.append(int((pos * mask).max()))
        buf = torch.empty_like(mask)
        buf.fill_(1)  # overwritten whole: known
        seen.append(bool(buf.all()))
        v = mask[0]
        h = m(b["x"])
        mask.add_(h.detach().long())  # written with activation values: mask and its views are unknown
        try:
            bool(v.any())
            seen.append("known")
        except TracerError:
            seen.append("unknown")
        h.sum().backward()

    ids = torch.tensor([[5, 0, 7, 0], [0, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    batch = {"ids": ids, "mask": mask, "x": torch.randn(2, 4)}
    memory_profiling(nn.Linear(4, 4), batch, step)
    assert seen == [(3, 2, False, 3), 2, True, "unknown"]
    assert torch.equal(batch["mask"], mask) and batch["mask"].data_ptr() == mask.data_ptr()  # untouched
