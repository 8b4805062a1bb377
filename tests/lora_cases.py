"""The adapter fine-tuning cases (PEFT LoRA models, a frozen-backbone classifier) that
tests/test_lora.py and tests/test_frozen_quant.py train."""

from __future__ import annotations

import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model

from elixir.testing.zoo import ZooCase, _gen, _lm_loss, _token_batch, build_model

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}


def build_lora(base: str, checkpointing: bool = False) -> nn.Module:
    model = build_model(base)
    if checkpointing:  # frozen chunks are gathered again for the recomputation
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[base], lora_dropout=0.0, init_lora_weights="gaussian",
                     fan_in_fan_out=base == "gpt2")
    torch.manual_seed(1)
    return get_peft_model(model, cfg)


def build_classifier() -> nn.Module:
    """A LLaMA backbone, frozen, under a trainable classification head."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, num_labels=3, pad_token_id=0)
    model = LlamaForSequenceClassification(cfg)
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("score"))
    return model


def _class_batch(batch_size: int, step: int) -> dict:
    b = _token_batch(batch_size, step)
    b["labels"] = torch.randint(0, 3, (batch_size,), generator=_gen(step, 7))
    return b


def _class_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


CASES = {
    "llama-lora": ZooCase("llama-lora", lambda: build_lora("llama"), _token_batch, _lm_loss),
    "gpt2-lora": ZooCase("gpt2-lora", lambda: build_lora("gpt2"), _token_batch, _lm_loss),
    "llama-lora-ckpt": ZooCase("llama-lora-ckpt", lambda: build_lora("llama", checkpointing=True), _token_batch, _lm_loss),
    "classifier": ZooCase("classifier", build_classifier, _class_batch, _class_loss),
}
