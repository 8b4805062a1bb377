"""What a new user reads: the search report, `elixir plan` and `elixir profile` output, the docs'
pointers (issue 20, item 10)."""

from __future__ import annotations

import json
import pathlib
import warnings

import torch
import torch.nn as nn

from elixir import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tiny_gpt2_config(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 64}))
    return str(path)


def test_plan_cli_prints_small_parameter_counts_in_a_unit_that_fits(tmp_path, capsys):
    rc = cli.main(["plan", _tiny_gpt2_config(tmp_path), "--world-size", "1", "--batch", "1", "--seq", "16", "--hardware", "cpu-box"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0.00B" not in out
    n = 128 * 32 + 64 * 32 + 2 * (4 * 32 + 32 * 96 + 96 + 32 * 32 + 32 + 32 * 128 + 128 + 128 * 32 + 32) + 2 * 32
    assert f"{n / 1e3:.1f}k trainable parameters" in out, out


def test_fully_replicated_report_says_so(capsys):
    """A plan with every chunk replicated used to read "chunk size 0 elements (0 sharded, 1
    replicated)" and "padding waste 100.00%"."""
    from elixir.search import optimal_search

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    sr = optimal_search(model, 2, verbose=True, device_memory=1 << 30, host_memory=1 << 30)
    out = capsys.readouterr().out
    assert not any(c.sharded for c in sr.chunks), sr.chunks
    assert "replicated" in out and "chunk size 0" not in out and "100.00%" not in out, out
    assert sr.info["waste"] == 0.0


def test_profile_names_the_module_and_phase_of_the_peak():
    from elixir.tracer import memory_profiling  # noqa: F401  (the public entry point exists)
    from elixir.tracer.memory_tracer import profile_from_trace
    from elixir.tracer.run import trace_step

    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def step(m, batch):
        loss = m(batch["x"]).square().mean()
        loss.backward()
        return loss

    prof = profile_from_trace(trace_step(model, {"x": torch.randn(32, 8)}, step))
    names = {n for n, _ in model.named_modules() if n}
    assert prof.peak.module in names, prof.peak
    where = prof.peak.where()
    assert where.startswith(f"{prof.peak.phase} of {prof.peak.module}") and "#" not in where, where
    table = prof.table()
    notes = [str(c) for col in table.columns for c in col._cells]
    assert any(f"peak in the {where}" in n for n in notes), notes
    assert not any("op #" in n for n in notes), notes


def test_checkpointing_a_registry_model_emits_no_future_warning():
    from elixir import models

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        m = models.build_model("gpt2", n_layer=1)
        models.enable_checkpointing(m)
    assert m.is_gradient_checkpointing


def test_docs_point_nvme_users_at_disk_placement():
    text = (ROOT / "docs" / "optimizer.md").read_text()
    assert "nvme_offload_fraction" in text and "offload_dir" in text and "Placement.DISK" in text


def test_docs_name_shard_files_as_they_are_written(tmp_path):
    """The docs said ``rank{r}-of-{W}``; the files are ``rank00000-of-00001.safetensors``."""
    import re

    import elixir.checkpoint as checkpoint
    from elixir.search import minimum_waste_search
    from elixir.wrapper import ElixirModule

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    em = ElixirModule(model, minimum_waste_search(model, 1))
    checkpoint.save(str(tmp_path / "ckpt"), em)
    shards = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("rank"))
    assert shards == ["rank00000-of-00001.safetensors"], shards
    pattern = re.compile(r"rank\d{5}-of-\d{5}\.safetensors")
    for doc in (ROOT / "docs" / "optimizer.md", ROOT / "elixir" / "checkpoint" / "__init__.py"):
        text = doc.read_text()
        assert "rank{r}-of-{W}" not in text, doc
        named = pattern.findall(text)
        assert named and all(n.endswith("-of-00002.safetensors") or n == shards[0] for n in named), (doc, named)
