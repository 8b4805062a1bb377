"""ElixirTrainer fine-tuning flows at world size 2 against the plain Trainer (issue 36, item 10).

The job (``tests/_hf_trainer_finetune_job.py``) trains LoRA on a small GPT-2 with the plain Trainer
(DDP) and ElixirTrainer and saves both; then trains with ``load_best_model_at_end`` (LoRA, full
model, full model with ``save_only_model``) where the best checkpoint is the first one.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.hf_trainer_cases import run_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf_finetune"))
    return out, run_job("_hf_trainer_finetune_job.py", out)


def _adapters(state: dict) -> dict:
    """The adapter weights of a LoRA model's full state dict, under PEFT's file keys."""
    from _hf_trainer_finetune_job import lora, tiny_gpt2
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(lora(tiny_gpt2()), state_dict=state)


def _file(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.dist
def test_peft_save_model_writes_adapters_as_the_plain_trainer(job):
    """Regression: save_model wrote a whole-model model.safetensors under PEFT key names."""
    from _hf_trainer_finetune_job import lora, tiny_gpt2
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    out, results = job
    res = results[0]
    assert "adapter_config.json" in res["ours_files"] and "adapter_model.safetensors" in res["ours_files"]
    assert res["ours_files"] == res["plain_files"], (res["ours_files"], res["plain_files"])
    for name in ("ours", "plain"):  # the checkpoint-N folders too
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(res[f"{name}_ckpt_files"])
        assert "model.safetensors" not in res[f"{name}_ckpt_files"]
    ours = _file(os.path.join(out, "ours", "final", "adapter_model.safetensors"))
    plain = _file(os.path.join(out, "plain", "final", "adapter_model.safetensors"))
    assert sorted(ours) == sorted(plain)
    trained = _adapters(res["ours_state"])
    for k in ours:
        assert torch.equal(ours[k], trained[k]), k
        torch.testing.assert_close(ours[k], plain[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    # and PEFT loads it onto a fresh base
    back = PeftModel.from_pretrained(tiny_gpt2(), os.path.join(out, "ours", "final"))
    loaded = get_peft_model_state_dict(back)
    for k in ours:
        assert torch.equal(loaded[k], trained[k]), k
    assert lora is not None


@pytest.mark.dist
def test_load_best_model_at_end_restores_the_best_checkpoint(job):
    """Regression: the last model stayed (and the full model's rank 0 died with SIGSEGV)."""
    out, results = job
    for res in results:
        for name in ("best_lora", "best_full", "best_full_only_model"):
            r = res[name]
            assert r["best"] == os.path.join(out, name, "checkpoint-3"), (name, r["best"])
            if name == "best_lora":
                best = _file(os.path.join(r["best"], "adapter_model.safetensors"))
                last = _file(os.path.join(out, name, "checkpoint-6", "adapter_model.safetensors"))
                now = _adapters(r["state"])
            else:
                best = _file(os.path.join(r["best"], "model.safetensors"))
                last = _file(os.path.join(out, name, "checkpoint-6", "model.safetensors"))
                now = r["state"]
            assert any(not torch.equal(best[k], last[k]) for k in best), name  # the two differ
            for k in best:
                assert torch.equal(now[k], best[k]), (name, k)


def test_peft_best_model_with_save_only_model_is_refused_at_construction(tmp_path):
    from _hf_trainer_finetune_job import best_args, dataset, lora, tiny_gpt2

    from elixir.integrations.transformers import ElixirTrainer

    with pytest.raises(ValueError, match="save_only_model=False"):
        ElixirTrainer(model=lora(tiny_gpt2()), args=best_args(str(tmp_path), save_only_model=True),
                      train_dataset=dataset(), eval_dataset=dataset(8))
