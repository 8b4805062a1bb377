"""The search's step profile: layer-repetition extrapolation equals a full trace; `elixir plan`."""

import json

import pytest
import torch

from elixir import models
from elixir.search.step_profile import profile_by_layers, profile_from_module, profile_step


def _build(n: int):
    return models.build_model("opt-125m", num_hidden_layers=n, hidden_size=64, ffn_dim=128,
                              num_attention_heads=2, vocab_size=256, max_position_embeddings=64)


def _inp(m):
    return models.make_batch(m, 2, 16)


def test_layer_extrapolation_equals_the_full_trace():
    ext = profile_by_layers(_build, 6, _inp, models.lm_step_fn, torch.float32)
    full_model = _build(6)
    full = profile_step(full_model, _inp(full_model), models.lm_step_fn, torch.float32)
    assert ext.params == full.params
    assert ext.steps == full.steps and ext.step_kinds == full.step_kinds
    assert ext.shared == full.shared
    assert ext.matmul_param_numel == full.matmul_param_numel
    assert ext.activation_bytes == full.activation_bytes
    assert ext.info["phase_peaks"] == full.info["phase_peaks"]
    # per-op compute costs extrapolate exactly too (the same ops per layer)
    assert ext.op_costs.ops == full.op_costs.ops
    assert ext.op_costs.matmul_flops == pytest.approx(full.op_costs.matmul_flops)
    assert ext.op_costs.memory_bytes == pytest.approx(full.op_costs.memory_bytes)


def test_module_order_profile_covers_every_parameter():
    m = _build(2)
    p = profile_from_module(m)
    names = [n for n, q in m.named_parameters() if q.requires_grad]
    assert [n for n, _ in p.params] == names
    assert set(p.use_order()) == set(names)
    assert "model.decoder.embed_tokens.weight" in p.shared  # tied to lm_head
    half = len(p.steps) // 2
    assert p.steps[:half] == p.steps[half:][::-1]


def test_plan_cli_writes_a_plan_for_another_cluster(tmp_path, capsys):
    from elixir.cli import main
    from elixir.plan import SearchResult

    out = tmp_path / "plan.json"
    rc = main(["plan", "opt-1.3b", "--world-size", "8", "--hardware", "8xA100-40GB", "--device-memory", "40GiB",
               "--host-memory", "1TiB", "--batch", "1", "--seq", "512", "--dtype", "bf16", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "runner-ups" in text and "reference figures" in text
    plan = SearchResult.load(out)
    assert plan.world_size == 8 and plan.search == "optimal" and plan.prediction.peak_device_bytes > 0
    assert plan.prediction.peak_device_bytes <= 0.9 * 40 * 2**30
    meta = models.build_model("opt-1.3b")
    assert sorted(plan.param_names) == sorted(n for n, _ in meta.named_parameters())
    assert json.loads(out.read_text())["info"]["model"] == "opt-1.3b"


def test_plan_cli_says_what_would_fit(capsys):
    from elixir.cli import main

    rc = main(["plan", "opt-1.3b", "--world-size", "2", "--hardware", "8xA100-40GB", "--device-memory", "1GiB",
               "--host-memory", "4GiB", "--batch", "1", "--seq", "256", "--dtype", "bf16"])
    assert rc == 1
    text = capsys.readouterr().out
    assert "no plan fits" in text and ">=" in text


@pytest.mark.parametrize("text,expected", [("24GiB", 24 * 2**30), ("256GB", 256 * 10**9), ("1.5TiB", int(1.5 * 2**40)),
                                           ("1000", 1000)])
def test_sizes(text, expected):
    from elixir.plan_cli import parse_size

    assert parse_size(text) == expected
