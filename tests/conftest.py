"""Test tiers and the fixtures every test shares.

- ``unit``: every test not marked ``dist``, ``slow`` or ``cuda`` (added here at collection). A
  unit test starts no process: one that does fails, naming the marker to add, so
  ``pytest -m unit`` stays a quick tier that only exercises code in this process.
- ``dist``: tests that launch processes (gloo ranks, torchrun, the CLI, a fresh interpreter).
- ``slow``: long runs, out of the default suite (``-m "not slow"``).
"""

import _posixsubprocess
import multiprocessing
import os
import subprocess

import pytest
import torch

from elixir import launch

# Test models are tiny: one intra-op thread is faster than two (no fork/join per op), and it keeps
# single-process tests from competing with the ranks that multi-rank tests spawn.
torch.set_num_threads(1)

SPAWNING_MARKERS = ("dist", "slow", "cuda")

# The suite must not depend on the machine it runs on: a local measured profile
# (~/.cache/elixir/hardware.json, which `elixir hwprofile` writes) would change the default plans
# every test sees. Point the default at a file that does not exist, as on a fresh clone (a test that
# wants one sets ELIXIR_HARDWARE itself; set it before running pytest to test against a profile).
os.environ.setdefault("ELIXIR_HARDWARE", os.path.join(os.path.dirname(__file__), ".no-local-hardware-profile.json"))

# Ranks started by run_distributed fork from one server that has already imported what nearly every
# rank imports (1.5 s for torch, 1 s more for elixir, 3.5 s more for transformers' models, per rank
# and per launch, on this 2-core box), instead of each importing it afresh: about 70 launches in the
# default suite. ELIXIR_TEST_SPAWN=1 goes back to a fresh interpreter per rank.
if os.environ.get("ELIXIR_TEST_SPAWN") != "1":
    launch.START_METHOD = "forkserver"
    multiprocessing.set_forkserver_preload([
        "torch", "torch.distributed", "pytest", "elixir", "elixir.launch", "elixir.wrapper", "elixir.search",
        "elixir.checkpoint", "elixir.testing", "elixir.testing.zoo", "elixir.testing.reference", "transformers",
        "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
        "transformers.models.opt.modeling_opt", "transformers.models.bert.modeling_bert",
    ])


# The longest test files (seconds each, from `--durations` with two xdist workers, 2026-11-28) start
# first: `scripts/test.sh` hands whole files to two workers in collection order, and one of these
# started last would leave the other worker idle while it ran. Only the order changes.
LONG_FILES_FIRST = ("test_exit.py", "test_wheel.py", "test_tutorials.py", "test_gpu_check.py", "test_mesh_faults.py",
                    "test_finetune_large.py", "test_examples.py", "test_demo.py", "test_lora.py", "test_booster.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(m) for m in SPAWNING_MARKERS):
            item.add_marker(pytest.mark.unit)
    first = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: files stay whole, in order


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """Fail a unit test that starts a process (subprocess, multiprocessing spawn or fork), even
    when the test itself catches the error raised at the start."""
    if any(request.node.get_closest_marker(m) for m in SPAWNING_MARKERS):
        yield
        return
    started = []

    def refuse(*args, **kwargs):
        started.append(True)
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.dist")

    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)  # multiprocessing's spawn
    monkeypatch.setattr(subprocess, "_fork_exec", refuse)  # subprocess's own binding of it
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} starts a process: mark it @pytest.mark.dist", pytrace=False)
