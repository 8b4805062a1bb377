"""Lightning with a Hugging Face model held as ``self.model`` (issue 36, item 10 and done-when 4).

One 2-rank run: pretrained GPT-NeoX weights (renamed keys: ``embed_out`` for ``lm_head``) are loaded
by ``ElixirStrategy(pretrained=...)`` and by ``load_pretrained`` in ``on_fit_start``, trained with
SGD, saved with ``save_pretrained`` from the strategy's module; a run resumed with
``fit(ckpt_path=...)`` keeps its checkpoint's weights, not the pretrained ones; ``generate`` inside
``predict_step`` gives the plain model's tokens. References: plain torch on the full batch from
the same checkpoint, and ``transformers.from_pretrained`` of elixir's save.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from elixir import checkpoint  # noqa: E402
from elixir.checkpoint import CheckpointError  # noqa: E402
from elixir.testing import run_distributed  # noqa: E402

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
           max_position_embeddings=32, tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)
LR, STEPS = 0.5, 3


def hf_model(seed: int = 0, device: str = "cpu"):
    warnings.filterwarnings("ignore")
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_neox", **CFG))


def data() -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(3))


class HFLit(L.LightningModule):
    """A LightningModule holding the HF model as ``self.model`` (built on meta in configure_model)."""

    def __init__(self, load_on_fit_start: str = "") -> None:
        super().__init__()
        self.model = None
        self.load_on_fit_start = load_on_fit_start

    def configure_model(self) -> None:
        if self.model is None:
            self.model = hf_model(seed=5)  # other values than the checkpoint's: the load must replace them

    def on_fit_start(self) -> None:
        if self.load_on_fit_start:
            checkpoint.load_pretrained(self.load_on_fit_start, self.trainer.strategy.elixir_module)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def predict_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model.generate(input_ids=ids[:, :5], attention_mask=torch.ones_like(ids[:, :5]),
                                   max_new_tokens=3 + 2 * self.global_rank, do_sample=False, synced_gpus=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data()), batch_size=2, shuffle=False)

    predict_dataloader = train_dataloader


def _trainer(strategy, max_steps=STEPS):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=max_steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     num_sanity_val_steps=0)


def _scenarios(root: str) -> dict:
    from elixir.integrations.lightning import ElixirStrategy

    hf = os.path.join(root, "hf")
    out = {}
    for how in ("strategy", "on_fit_start"):
        model = HFLit(load_on_fit_start=hf if how == "on_fit_start" else "")
        trainer = _trainer(ElixirStrategy(pretrained=hf if how == "strategy" else None))
        trainer.fit(model)
        em = trainer.strategy.elixir_module
        checkpoint.save_pretrained(os.path.join(root, how), em)
        out[how] = em.state_dict(rank0_only=True)
        trainer.save_checkpoint(os.path.join(root, f"{how}.ckpt"))
        # resumed at its last step: the restored weights must stay (the pretrained load comes first)
        model = HFLit(load_on_fit_start=hf if how == "on_fit_start" else "")
        trainer = _trainer(ElixirStrategy(pretrained=hf if how == "strategy" else None))
        trainer.fit(model, ckpt_path=os.path.join(root, f"{how}.ckpt"))
        out[f"{how}_resumed"] = trainer.strategy.elixir_module.state_dict(rank0_only=True)
    # generate inside predict_step (the wrapper's forward), ranks finishing at different steps
    trainer = _trainer(ElixirStrategy(pretrained=hf))
    out["predicted"] = trainer.predict(HFLit(), return_predictions=True)
    return out


@pytest.mark.dist
def test_lightning_hf_attribute_load_train_save_resume(tmp_path):
    """Regression: load_pretrained failed on the ``model.`` prefix; save_pretrained wrote prefixed
    keys and no config.json."""
    from transformers import AutoModelForCausalLM

    hf_model().save_pretrained(str(tmp_path / "hf"))
    results = run_distributed(_scenarios, 2, str(tmp_path), timeout=500)
    res = results[0]
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    for _ in range(STEPS):
        plain(input_ids=data(), labels=data()).loss.backward()
        opt.step()
        opt.zero_grad()
    ref = plain.state_dict()
    for how in ("strategy", "on_fit_start"):
        trained = {k.removeprefix("model."): v for k, v in res[how].items()}
        for k, v in ref.items():
            torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k, how=how: f"{how} {k}: {m}")
        saved = tmp_path / how
        assert (saved / "config.json").is_file()
        from safetensors import safe_open

        with safe_open(str(saved / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert "embed_out.weight" in keys and not any(k.startswith("model.") for k in keys), sorted(keys)[:4]
        back = AutoModelForCausalLM.from_pretrained(str(saved)).state_dict()
        for k, v in back.items():
            assert torch.equal(v, trained[k]), (how, k)
        resumed = res[f"{how}_resumed"]
        for k, v in res[how].items():
            assert torch.equal(resumed[k], v), (how, "resumed", k)
    # generate in predict_step: the plain model's tokens, on both ranks
    for rank, r in enumerate(results):
        prompts = data()[[rank, rank + 2]]  # Lightning's sampler: rank r gets samples r, r+2
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).generate(
                input_ids=prompts[:, :5], attention_mask=torch.ones_like(prompts[:, :5]), max_new_tokens=3 + 2 * rank,
                do_sample=False)
        assert torch.equal(r["predicted"][0], want), (rank, r["predicted"][0], want)


class TwoModels(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = hf_model(1), hf_model(2)


def test_submodule_is_found_named_or_asked_for(tmp_path):
    from elixir.search import minimum_waste_search
    from elixir.wrapper import ElixirModule

    hf_model().save_pretrained(str(tmp_path / "hf"))
    ref = hf_model().state_dict()
    two = TwoModels()
    em = ElixirModule(two, minimum_waste_search(two, 1))
    with pytest.raises(CheckpointError, match=r"several Hugging Face models \(student, teacher\); pass submodule="):
        checkpoint.load_pretrained(str(tmp_path / "hf"), em)
    checkpoint.load_pretrained(str(tmp_path / "hf"), em, submodule="teacher")
    sd = em.state_dict()
    assert all(torch.equal(sd[f"teacher.{k}"], v) for k, v in ref.items())
    assert not torch.equal(sd["student.lm_head.weight"], ref["lm_head.weight"])
    with pytest.raises(CheckpointError, match="submodule='techer'"):
        checkpoint.save_pretrained(str(tmp_path / "out"), em, submodule="techer")
    checkpoint.save_pretrained(str(tmp_path / "out"), em, submodule="teacher")
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).state_dict()
    assert all(torch.equal(back[k], v) for k, v in ref.items())


def test_load_before_wrapping_names_the_hook():
    """In configure_model there is no wrapped module yet (trainer.strategy.elixir_module is None)."""
    with pytest.raises(TypeError, match="on_fit_start"):
        checkpoint.load_pretrained("unused", None)
