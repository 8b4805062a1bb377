"""Run under torchrun by tests/test_hf_trainer.py: HF Trainer (DDP) vs ElixirTrainer in the same ranks.

    torchrun --nproc-per-node 2 --standalone tests/_hf_trainer_job.py OUT_DIR

Writes ``OUT_DIR/result_{rank}.pt`` with both runs' logged losses and final parameters, a resumed
run's parameters, and (rank 0) the logits of the saved directory reloaded with ``from_pretrained``.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from elixir import distributed as edist
from elixir.integrations.transformers import ElixirTrainer
from tests.hf_trainer_cases import progressions

STEPS = 10
SEQ = 16


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(cfg)


def dataset(n: int = 96) -> list[dict]:
    return progressions(n, SEQ)


def arguments(out: str, **kw) -> TrainingArguments:
    base = dict(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=3e-3, max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, optim="adamw_torch",
    )
    base.update(kw)
    return TrainingArguments(**base)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main(out: str) -> None:
    edist.init_distributed()
    rank = edist.get_rank()
    data = dataset()
    result: dict = {}

    ddp = Trainer(model=tiny_gpt2(), args=arguments(os.path.join(out, "ddp")), train_dataset=data)
    ddp.train()
    result["ddp"] = (losses(ddp), {k: v.detach().clone() for k, v in ddp.model.state_dict().items()})

    run = os.path.join(out, "elixir")
    ex = ElixirTrainer(
        model=tiny_gpt2(), args=arguments(run, save_strategy="steps", save_steps=5), train_dataset=data
    )
    ex.train()
    result["elixir"] = (losses(ex), ex.elixir_module.state_dict())

    # the saved directory is an HF model directory
    ex.save_model(os.path.join(out, "final"))
    probe = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(2))
    ex.elixir_module.eval()  # no dropout, as from_pretrained's model
    with torch.no_grad():
        result["trained_logits"] = ex.elixir_module(input_ids=probe).logits.detach().clone()
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
        with torch.no_grad():
            result["loaded_logits"] = loaded(input_ids=probe).logits
        result["final_files"] = sorted(os.listdir(os.path.join(out, "final")))
    edist.barrier()

    # resume from the step-5 checkpoint to step 10
    resumed = ElixirTrainer(model=tiny_gpt2(), args=arguments(run), train_dataset=data)
    resumed.train(resume_from_checkpoint=os.path.join(run, "checkpoint-5"))
    result["resumed"] = resumed.elixir_module.state_dict()
    result["checkpoint_files"] = sorted(os.listdir(os.path.join(run, "checkpoint-5")))

    # bf16 trains (loss finite and falling)
    bf = ElixirTrainer(model=tiny_gpt2(), args=arguments(os.path.join(out, "bf16"), bf16=True), train_dataset=data)
    bf.train()
    result["bf16"] = (losses(bf), bf.elixir_module.dtype)

    torch.save(result, os.path.join(out, f"result_{rank}.pt"))
    edist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
