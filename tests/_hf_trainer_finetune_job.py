"""Run under torchrun by tests/test_hf_trainer_finetune.py: fine-tuning flows of ElixirTrainer
against the plain HF Trainer (DDP) in the same ranks (issue 36, item 10).

    torchrun --nproc-per-node 2 --standalone tests/_hf_trainer_finetune_job.py OUT_DIR

1. LoRA (PEFT) with the plain Trainer and with ElixirTrainer, ``save_model`` and ``checkpoint-N/``.
2. ``load_best_model_at_end`` for a LoRA model and a full model (and the full model with
   ``save_only_model``): the best checkpoint is the first evaluation's (the metric rises at every
   evaluation and lower is better), so the restored weights must be checkpoint-3's, not the last.

Writes ``OUT_DIR/result_{rank}.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from elixir import distributed as edist
from elixir.integrations.transformers import ElixirTrainer
from tests.hf_trainer_cases import progressions

SEQ = 16


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def lora(model):
    torch.manual_seed(1)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                     init_lora_weights="gaussian", fan_in_fan_out=True)
    return get_peft_model(model, cfg)


def dataset(n: int = 48) -> list[dict]:
    return progressions(n, SEQ)


def arguments(out: str, **kw) -> TrainingArguments:
    base = dict(
        output_dir=out, per_device_train_batch_size=2, max_steps=6, learning_rate=1e-2, logging_steps=1,
        save_strategy="steps", save_steps=3, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        optim="adamw_torch",
    )
    base.update(kw)
    return TrainingArguments(**base)


class RisingMetric:
    """compute_metrics whose value rises at every evaluation: with greater_is_better=False the
    first evaluation (step 3) is the best."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, _pred) -> dict:
        self.calls += 1
        return {"score": float(self.calls)}


def best_args(out: str, **kw) -> TrainingArguments:
    return arguments(out, eval_strategy="steps", eval_steps=3, load_best_model_at_end=True,
                     metric_for_best_model="score", greater_is_better=False, per_device_eval_batch_size=4, **kw)


def files(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def main(out: str) -> None:
    edist.init_distributed()
    rank = edist.get_rank()
    data = dataset()
    result: dict = {}

    # 1. LoRA: the plain Trainer's save and ours
    plain = Trainer(model=lora(tiny_gpt2()), args=arguments(os.path.join(out, "plain")), train_dataset=data)
    plain.train()
    plain.save_model(os.path.join(out, "plain", "final"))
    result["plain_adapters"] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(plain.model).items()}
    ex = ElixirTrainer(model=lora(tiny_gpt2()), args=arguments(os.path.join(out, "ours")), train_dataset=data)
    ex.train()
    ex.save_model(os.path.join(out, "ours", "final"))
    result["ours_state"] = ex.elixir_module.state_dict()
    for name in ("plain", "ours"):
        result[f"{name}_files"] = files(os.path.join(out, name, "final"))
        result[f"{name}_ckpt_files"] = files(os.path.join(out, name, "checkpoint-3"))

    # 2. load_best_model_at_end
    evals = data[:8]
    for name, build, extra in (("best_lora", lambda: lora(tiny_gpt2()), {}),
                               ("best_full", tiny_gpt2, {}),
                               ("best_full_only_model", tiny_gpt2, {"save_only_model": True})):
        t = ElixirTrainer(model=build(), args=best_args(os.path.join(out, name), **extra), train_dataset=data,
                          eval_dataset=evals, compute_metrics=RisingMetric())
        t.train()
        result[name] = dict(best=t.state.best_model_checkpoint, state=t.elixir_module.state_dict(),
                            eval_loss=t.evaluate()["eval_loss"])
    torch.save(result, os.path.join(out, f"result_{rank}.pt"))
    edist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
