"""Smoke tests of example/: each script's --help, and a tiny run of each (one process, seconds).

The tiny runs start all at once (the ``ran`` fixture, ``tests/at_once.py``), each checked by its
own test."""

from __future__ import annotations

import os
import sys

import pytest

from tests.at_once import run_at_once

pytest.importorskip("transformers")
pytestmark = pytest.mark.dist  # every example runs as its own process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ["bert_finetune.py", "opt_finetune.py", "activation/opt_profile.py", "lightning_gpt.py", "hf_trainer_gpt.py"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return env


def _tiny_runs(tmp) -> dict[str, list[str]]:
    """Per example: its tiny run's arguments (its output under ``tmp``/name)."""
    t = {name: tmp / name for name in ("bert", "opt", "activation", "lightning", "hf_trainer", "lora")}
    runs = {
        "bert": ["bert_finetune.py", "--steps", "3", "--batch", "4", "--seq", "16", "--hidden", "32", "--eval-batches", "1"],
        "opt": ["opt_finetune.py", "--pretrained", str(t["opt"] / "opt"), "--pretrain-steps", "3", "--steps", "3",
                "--batch", "2", "--seq", "16", "--hidden", "32", "--eval-batches", "1", "--plan", "optimal"],
        "activation": ["activation/opt_profile.py", "--model", "opt-125m", "--batch", "1", "--seq", "32"],
        "lightning": ["lightning_gpt.py", "--steps", "3", "--batch", "2", "--seq", "16", "--hidden", "32",
                      "--ckpt", str(t["lightning"] / "ckpt")],
        "hf_trainer": ["hf_trainer_gpt.py", "--out", str(t["hf_trainer"] / "run"), "--steps", "3", "--batch", "2",
                       "--seq", "16", "--hidden", "32"],
        "lora": ["lora_finetune.py", "--make-tiny", "--pretrained", str(t["lora"] / "tiny"), "--steps", "3", "--batch",
                 "2", "--seq", "32", "--hidden", "64", "--eval-batches", "1", "--corpus-bytes", "200000",
                 "--plan", "minimum_waste", "--save", str(t["lora"] / "adapters")],
    }
    needs = {"lightning": "lightning", "hf_trainer": "accelerate", "lora": "peft"}
    return {name: [f"{ROOT}/example/{args[0]}", *args[1:]] for name, args in runs.items()
            if name not in needs or not importlib_missing(needs[name])}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Per example: (its folder, its finished process); every tiny run, and the --help of all,
    start at once, each in its own folder."""
    tmp = tmp_path_factory.mktemp("examples")
    runs = _tiny_runs(tmp)
    runs["help"] = ["-c", _help_code()]
    for name in runs:
        (tmp / name).mkdir()
    done = run_at_once({name: [sys.executable, *args] for name, args in runs.items()}, timeout=300,
                       cwds={name: tmp / name for name in runs}, env=_env())
    return {name: (tmp / name, p) for name, p in done.items()}


def _out(ran, name: str):
    folder, proc = ran[name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return folder, proc.stdout


def _help_code() -> str:
    """One interpreter runs every example with --help."""
    code = (
        "import runpy, sys\n"
        f"for name in {EXAMPLES!r}:\n"
        "    sys.argv = [name, '--help']\n"
        "    try:\n"
        f"        runpy.run_path({ROOT!r} + '/example/' + name, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, name\n"
        "    else:\n"
        "        raise AssertionError(name + ' --help did not exit')\n"
    )
    if importlib_missing("lightning"):
        code = code.replace("'lightning_gpt.py', ", "")
    return code


def test_every_example_has_help(ran):
    _, out = _out(ran, "help")
    assert out.count("usage:") == len(EXAMPLES) - importlib_missing("lightning")


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def test_bert_finetune_tiny(ran):
    _, out = _out(ran, "bert")
    assert "validation accuracy" in out


def test_opt_finetune_tiny(ran):
    tmp_path, out = _out(ran, "opt")
    assert "wrote the pretrained checkpoint" in out and "validation perplexity" in out
    assert os.path.isfile(tmp_path / "opt" / "config.json")


def test_activation_profile_tiny(ran):
    _, out = _out(ran, "activation")
    assert "activation" in out and "opt-125m" in out


def test_lightning_gpt_tiny(ran):
    pytest.importorskip("lightning")
    tmp_path, out = _out(ran, "lightning")
    assert "validation loss" in out and os.path.isdir(tmp_path / "ckpt")


def test_hf_trainer_gpt_tiny(ran):
    pytest.importorskip("accelerate")
    tmp_path, out = _out(ran, "hf_trainer")
    assert "validation perplexity" in out and os.path.isfile(tmp_path / "run" / "final" / "config.json")


def test_lora_finetune_tiny(ran):
    pytest.importorskip("peft")
    tmp_path, out = _out(ran, "lora")
    assert "wrote a tiny checkpoint" in out and "validation perplexity" in out and "0 missing keys" in out
    assert os.path.isfile(tmp_path / "adapters" / "index.json")
