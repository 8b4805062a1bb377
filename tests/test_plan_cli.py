"""`elixir plan` from what a user has (issues 34 and 36): a local HF model folder or config.json,
configs whose per-layer lists must shrink with the traced layer count, case-insensitive built-in
names with the common families, nearest-name suggestions, and a cluster request that this machine
cannot be, planned against a shipped GPU profile with a warning (header and footer agree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from elixir import cli, models

# Published parameter counts (the model cards), to check the registry's configs against.
PUBLISHED = {"llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "mistral-7b": 7.24e9, "qwen2.5-7b": 7.62e9,
             "qwen3-8b": 8.19e9, "qwen3-0.6b": 0.596e9}


def _write(tmp_path, d: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path)


def _qwen3(tmp_path) -> str:
    n = 6
    return _write(tmp_path, {
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": n,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128,
        "max_position_embeddings": 64, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 3,
        "layer_types": ["full_attention"] * 3 + ["sliding_attention"] * 3,
    })


def _gemma3(tmp_path) -> str:
    return _write(tmp_path, {
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128,
        "max_position_embeddings": 64, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"],
    })


@pytest.mark.parametrize("make", [_qwen3, _gemma3], ids=["qwen3", "gemma3"])
def test_plan_a_config_with_layer_types(make, tmp_path, capsys):
    """The planner traces 2 and 3 layers; `layer_types` used to stay at full length (a traceback)."""
    folder = make(tmp_path)
    for target in (folder, os.path.join(folder, "config.json")):
        rc = cli.main(["plan", target, "--world-size", "2", "--seq", "32", "--hardware", "8xA100-40GB"])
        out = capsys.readouterr().out
        assert rc == 0, out
        assert "trainable parameters" in out
    cfg = models.load_config(folder, num_hidden_layers=2)
    assert len(cfg.layer_types) == 2


def test_registry_names_are_case_insensitive_and_cover_the_common_families():
    for name in ("LLaMA-7B", "Llama-3-8B", "MISTRAL-7b", "Qwen3-8B"):
        assert models.registry_name(name) is not None, name
        models.load_config(name)
    for name, n in PUBLISHED.items():
        m = models.build_model(name)
        got = sum(p.numel() for p in m.parameters())
        assert abs(got - n) / n < 0.01, (name, got, n)


def test_unknown_name_suggests_the_nearest_in_a_short_message(capsys):
    rc = cli.main(["plan", "lama2-7b", "--world-size", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Did you mean llama-2-7b" in err and "--list-models" in err
    assert max(len(line) for line in err.splitlines()) <= 100, err
    assert "qwen3-32b" not in err  # the registry is not dumped into the message


def test_list_models(capsys):
    assert cli.main(["plan", "--list-models"]) == 0
    out = capsys.readouterr().out
    for name in models.model_names():
        assert name in out


@pytest.fixture
def cpu_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("ELIXIR_HARDWARE", str(tmp_path / "absent.json"))  # no local profile
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("args,expect", [
    (["--world-size", "8", "--device-memory", "40GiB"], "8xA100-40GB"),
    (["--world-size", "8", "--device-memory", "80GiB"], "8xH100-80GB"),
    (["--world-size", "1", "--device-memory", "24GiB"], "1x24GB-workstation"),
    (["--world-size", str((os.cpu_count() or 1) + 1)], "8xA100-40GB"),
])
def test_a_cluster_request_is_not_planned_against_this_box(args, expect, tmp_path, cpu_machine, capsys):
    """`elixir plan llama-7b --world-size 8 --device-memory 40GiB` used to plan against this CPU box
    (366 s/step), and its footer said "cpu-box (measured)" while its header said no profile existed."""
    cfg = _write(tmp_path, {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128,
                            "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0})
    rc = cli.main(["plan", cfg, "--seq", "16", *args])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0, out
    assert f"hardware profile: {expect} (the closest shipped GPU profile" in out, out
    assert "--hardware" in out and "cpu-box" in out and "not for this machine" in out
    assert f"Hardware profile {expect} (" in out and "cpu-box (measured)" not in out


def test_a_request_this_machine_can_be_keeps_its_profile(tmp_path, cpu_machine, capsys):
    cfg = _write(tmp_path, {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128,
                            "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0})
    assert cli.main(["plan", cfg, "--seq", "16", "--world-size", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "hardware profile: cpu-box (no local measured profile" in out and "warning" not in out
    assert "Hardware profile cpu-box (a shipped reference profile" in out


@pytest.mark.dist  # a fresh interpreter: transformers prints the line once per process
def test_no_unrecognized_loss_type_line(tmp_path):
    """transformers printed "`loss_type=None` was set in the config but it is unrecognized" on every
    `elixir plan` and `elixir profile` of a GPT-2 config (a fresh process: the line prints once)."""
    cfg = _write(tmp_path, {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128,
                            "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0})
    r = subprocess.run([sys.executable, "-m", "elixir", "profile", cfg, "--seq", "16"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "was set in the config but it is unrecognized" not in r.stdout + r.stderr, r.stderr
    assert models.build_model(cfg).loss_type == "ForCausalLM"
