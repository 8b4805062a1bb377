"""Smoke tests of example/: each script's --help, and a tiny run of each (one process, seconds)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.dist  # every example runs as its own process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ["bert_finetune.py", "opt_finetune.py", "activation/opt_profile.py", "lightning_gpt.py", "hf_trainer_gpt.py"]


def run(args: list[str], cwd: str, timeout: float = 300) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_every_example_has_help(tmp_path):
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
    out = run(["-c", code], str(tmp_path))
    assert out.count("usage:") == len(EXAMPLES) - importlib_missing("lightning")


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def test_bert_finetune_tiny(tmp_path):
    out = run([f"{ROOT}/example/bert_finetune.py", "--steps", "3", "--batch", "4", "--seq", "16", "--hidden", "32",
               "--eval-batches", "1"], str(tmp_path))
    assert "validation accuracy" in out


def test_opt_finetune_tiny(tmp_path):
    out = run([f"{ROOT}/example/opt_finetune.py", "--pretrained", str(tmp_path / "opt"), "--pretrain-steps", "3",
               "--steps", "3", "--batch", "2", "--seq", "16", "--hidden", "32", "--eval-batches", "1",
               "--plan", "optimal"], str(tmp_path))
    assert "wrote the pretrained checkpoint" in out and "validation perplexity" in out
    assert os.path.isfile(tmp_path / "opt" / "config.json")


def test_activation_profile_tiny(tmp_path):
    out = run([f"{ROOT}/example/activation/opt_profile.py", "--model", "opt-125m", "--batch", "1", "--seq", "32"],
              str(tmp_path))
    assert "activation" in out and "opt-125m" in out


def test_lightning_gpt_tiny(tmp_path):
    pytest.importorskip("lightning")
    out = run([f"{ROOT}/example/lightning_gpt.py", "--steps", "3", "--batch", "2", "--seq", "16", "--hidden", "32",
               "--ckpt", str(tmp_path / "ckpt")], str(tmp_path))
    assert "validation loss" in out and os.path.isdir(tmp_path / "ckpt")


def test_hf_trainer_gpt_tiny(tmp_path):
    pytest.importorskip("accelerate")
    out = run([f"{ROOT}/example/hf_trainer_gpt.py", "--out", str(tmp_path / "run"), "--steps", "3", "--batch", "2",
               "--seq", "16", "--hidden", "32"], str(tmp_path))
    assert "validation perplexity" in out and os.path.isfile(tmp_path / "run" / "final" / "config.json")


def test_lora_finetune_tiny(tmp_path):
    pytest.importorskip("peft")
    out = run([f"{ROOT}/example/lora_finetune.py", "--make-tiny", "--pretrained", str(tmp_path / "tiny"), "--steps", "3",
               "--batch", "2", "--seq", "32", "--hidden", "64", "--eval-batches", "1", "--corpus-bytes", "200000",
               "--plan", "minimum_waste", "--save", str(tmp_path / "adapters")], str(tmp_path))
    assert "wrote a tiny checkpoint" in out and "validation perplexity" in out and "0 missing keys" in out
    assert os.path.isfile(tmp_path / "adapters" / "index.json")
