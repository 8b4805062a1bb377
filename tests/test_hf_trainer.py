"""ElixirTrainer under torchrun at world size 2 against the HF Trainer with DDP, in the same ranks.

The job (``tests/_hf_trainer_job.py``) trains a small GPT-2 for 10 steps (2 micro-batches per step,
clipping at 0.5) with each, saves and reloads the elixir model with ``from_pretrained``, resumes from
the step-5 checkpoint, and runs bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.hf_trainer_cases import run_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf_trainer"))
    return run_job("_hf_trainer_job.py", out)


@pytest.mark.dist
def test_losses_and_weights_equal_ddp(results):
    for res in results:
        ddp_losses, ddp_params = res["ddp"]
        losses, params = res["elixir"]
        assert len(losses) == 10
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=1e-5, atol=0)
        assert params.keys() == ddp_params.keys()
        # Adam divides by sqrt(v): near-zero gradients turn 1e-7 reduction-order noise into ~1e-6
        # parameter noise, small against the 3e-3 learning rate
        for k in params:
            torch.testing.assert_close(params[k], ddp_params[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.dist
def test_saved_directory_loads_with_from_pretrained(results):
    res = results[0]
    assert "config.json" in res["final_files"] and "model.safetensors" in res["final_files"]
    assert "training_args.bin" in res["final_files"]
    assert not [f for f in res["final_files"] if f.startswith(".")], res["final_files"]  # no staging left
    torch.testing.assert_close(res["loaded_logits"], res["trained_logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.dist
def test_resume_from_checkpoint(results):
    for res in results:
        assert "elixir" in res["checkpoint_files"] and "scheduler.pt" in res["checkpoint_files"]
        _, params = res["elixir"]
        for k in params:
            assert torch.equal(res["resumed"][k], params[k]), k


@pytest.mark.dist
def test_bf16_trains(results):
    losses, dtype = results[0]["bf16"]
    assert dtype == torch.bfloat16
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
