"""One rule for the default hardware profile, stated in `elixir plan --help` and named in every
report (issue 20, item 4): the local measured profile if there is one, otherwise a shipped
reference, and the reports say which and why."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn as nn

from elixir import cli
from elixir.hardware import choose_default_profile, load_profile, local_profile_path

REFERENCE = "8xA100-40GB" if torch.cuda.is_available() else "cpu-box"


@pytest.fixture
def no_local_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("ELIXIR_HARDWARE", str(tmp_path / "absent.json"))


@pytest.fixture
def local_profile(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    mine = dataclasses.replace(load_profile("cpu-box"), name="my-measured-box", measured=True, host="my-host")
    mine.save(path)
    monkeypatch.setenv("ELIXIR_HARDWARE", str(path))
    return str(path)


def _config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 64}))
    return str(path)


def test_without_a_local_profile_the_reference_is_named(no_local_profile):
    hw, why = choose_default_profile()
    assert hw.name == REFERENCE
    assert "no local measured profile" in why and local_profile_path() in why and "elixir hwprofile" in why


def test_a_local_measured_profile_is_the_default(local_profile):
    hw, why = choose_default_profile()
    assert hw.name == "my-measured-box" and local_profile in why


def test_optimal_search_reports_the_profile_it_used(local_profile, capsys):
    from elixir.search import optimal_search

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    sr = optimal_search(model, 1, verbose=True)
    assert sr.info["hardware"] == "my-measured-box" and local_profile in sr.info["hardware_choice"]
    out = capsys.readouterr().out
    assert "hardware profile" in out and "my-measured-box" in out


def test_plan_help_states_the_rule(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Default: the local measured profile" in text and "cpu-box" in text and "names the profile used" in text


@pytest.mark.parametrize("which", ["local", "reference", "given"])
def test_plan_uses_the_rule_and_names_the_profile(which, tmp_path, monkeypatch, capsys):
    """`elixir plan` used to default to 8xA100-40GB even for a one-GPU plan, silently."""
    if which == "local":
        path = tmp_path / "mine.json"
        dataclasses.replace(load_profile("cpu-box"), name="my-measured-box", measured=True).save(path)
        monkeypatch.setenv("ELIXIR_HARDWARE", str(path))
        expect = "hardware profile: my-measured-box (the local measured profile"
    else:
        monkeypatch.setenv("ELIXIR_HARDWARE", str(tmp_path / "absent.json"))
        expect = f"hardware profile: {REFERENCE} (no local measured profile"
    args = ["plan", _config(tmp_path), "--world-size", "1", "--batch", "1", "--seq", "16"]
    if which == "given":
        args += ["--hardware", "1x24GB-workstation"]
        expect = "hardware profile: 1x24GB-workstation (--hardware 1x24GB-workstation)"
    rc = cli.main(args)
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0, out
    assert expect in out, out
