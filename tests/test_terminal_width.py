"""Every table elixir prints reads well in an 80-column terminal (issue 34): `elixir plan`,
`elixir profile`, the demo's tables, the memory reports, `elixir checkpoint verify`, `elixir
hwprofile --show`, `elixir info`, the model list. Each is rendered at width 80 and checked: no
line is wider, no cell is cut with an ellipsis, and parameter names are shortened by prefix
(``transformer.h.0–5.*``) and appear whole."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from rich.console import Console

from elixir import cli
from elixir.tables import human_bytes, human_count, param_ranges

WIDTH = 80


BOX = set("┏┓┃┡┩│└┘┌┐├┤┳┻╇╋┼╭╮╰╯")


def assert_fits(text: str) -> None:
    assert text.strip(), "nothing was printed"
    assert "…" not in text, f"a cell was cut with an ellipsis:\n{text}"
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, "lines wider than 80 columns:\n" + "\n".join(wide)
    # rich crops a table wider than the console at its edge: a table line must end in its border
    cropped = [line for line in text.splitlines() if line.strip() and line.strip()[0] in BOX
               and line.rstrip()[-1] not in BOX]
    assert not cropped, "a table wider than 80 columns was cropped:\n" + text


def console() -> Console:
    return Console(width=WIDTH, file=io.StringIO(), highlight=False, color_system=None)


def printed(c: Console) -> str:
    return c.file.getvalue()


@pytest.fixture
def cols80(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))


def _config(tmp_path, **fields) -> str:
    d = {"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 2, "vocab_size": 128, "n_positions": 64,
         "bos_token_id": 0, "eos_token_id": 0, **fields}
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path)


# -- parameter names -----------------------------------------------------------------------------

def test_param_ranges_shorten_by_prefix():
    layers = [f"transformer.h.{i}.{leaf}" for i in range(6) for leaf in ("ln_1.weight", "attn.c_attn.weight")]
    assert param_ranges(layers) == "transformer.h.0–5.* (12)"
    assert param_ranges(["transformer.wte.weight", *layers[:4]]) == "transformer.wte.weight, transformer.h.0–1.* (5)"
    assert param_ranges(["transformer.ln_f.weight", "transformer.ln_f.bias"]) == "transformer.ln_f.{weight,bias} (2)"
    assert param_ranges(["lm_head.weight"]) == "lm_head.weight"
    # a gap in the layer numbers starts a new range; many pieces end in "and N more"
    assert param_ranges(["h.0.w", "h.1.w", "h.3.w"]) == "h.0–1.*, h.3.* (3)"
    assert param_ranges(["a.x", "b.y", "c.z", "d.w"]) == "a.x, b.y and 2 more (4)"


def test_human_units():
    assert human_count(6_738_415_616) == "6.7B" and human_count(840) == "840"
    assert human_bytes(300 * 2**10) == "300 KiB" and human_bytes(40 * 2**30) == "40 GiB"


# -- the command line ----------------------------------------------------------------------------

def test_plan_fits_80(tmp_path, cols80, capsys):
    rc = cli.main(["plan", _config(tmp_path), "--world-size", "2", "--seq", "32", "--hardware", "8xA100-40GB"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "runner-ups" in out and "placements" in out
    assert_fits(out)


def test_plan_for_another_machine_warns_within_80(tmp_path, cols80, monkeypatch, capsys):
    monkeypatch.setenv("ELIXIR_HARDWARE", str(tmp_path / "absent.json"))  # this machine: the CPU reference
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = cli.main(["plan", _config(tmp_path), "--world-size", "2", "--seq", "32", "--device-memory", "40GiB"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert_fits(out)


def test_profile_fits_80(tmp_path, cols80, capsys):
    rc = cli.main(["profile", _config(tmp_path), "--seq", "32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0.00B" not in out and "total_peak" in out
    assert_fits(out)


def test_model_list_and_info_fit_80(cols80, capsys):
    assert cli.main(["plan", "--list-models"]) == 0
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "llama-3-8b" in out and "native_extension" in out
    assert_fits(out)


@pytest.mark.parametrize("name", ["cpu-box", "8xA100-40GB", "8xH100-80GB", "1x24GB-workstation"])
def test_hardware_profile_table_fits_80(name):
    from elixir.hardware import load_profile
    from elixir.hardware_cli import render

    c = console()
    render(load_profile(name), c)
    assert_fits(printed(c))


def test_checkpoint_verify_fits_80():
    from elixir.checkpoint import Verified
    from elixir.checkpoint.cli import render

    path = "/srv/experiments/" + "/".join(["a-rather-long-run-name-with-a-date-2026-11-26"] * 3) + "/step-000100"
    for checked in (True, False):
        c = console()
        render(Verified(path, "sharded", 8, {f"rank{i:05d}.safetensors": 2**30 for i in range(8)}, checked, 0.5), c)
        out = printed(c)
        assert_fits(out)
        values = "".join(line.split("│")[2].strip() for line in out.splitlines() if line.count("│") == 3)
        assert path in values, f"the path was cut:\n{out}"  # folded onto several lines, every character kept


# -- the demo and the searches ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_plan():
    from elixir.demo import build_gpt
    from elixir.search import minimum_waste_search

    with torch.device("meta"):
        model = build_gpt("small", 128)
    return minimum_waste_search(model, 2)


def test_demo_chunk_table_fits_80_with_whole_names(demo_plan):
    from elixir.demo import print_chunks

    c = console()
    print_chunks(c, demo_plan)
    out = printed(c)
    assert_fits(out)
    for chunk in demo_plan.chunks:
        for piece in param_ranges(chunk.params).split(", "):
            piece = re.sub(r" \(\d+\)$", "", piece)
            if " " not in piece:  # a name or a range: whole, on one line
                assert piece in out, f"{piece!r} was cut:\n{out}"


def test_minimum_waste_table_fits_80(demo_plan):
    from elixir.search import print_plan

    c = console()
    print_plan(demo_plan, torch.bfloat16, console=c)
    assert_fits(printed(c))


def test_demo_summary_and_memory_tables_fit_80():
    from elixir.demo import DemoConfig, _print_summary

    mib = 2**20
    mem = {"shard": 21 * mib, "master": 42 * mib, "cache": 12 * mib, "peak_gathered": 24 * mib,
           "peak_rss": 1400 * mib, "device_peak": 90 * mib}
    s = {
        "params": 10_764_288, "world_size": 2, "losses": [5.5 - i / 40 for i in range(180)],
        "val_loss_before": 5.6, "val_loss_after": 1.4, "setup_s": 12.3, "train_s": 95.1, "tokens_per_s": 4845.0,
        "memory": [mem, mem],
        "plan": {"search": "optimal", "chunks": 9, "chunk_size": 2_359_296, "sharded": 7, "waste": 0.012,
                 "cache_blocks": 3, "search_s": 4.2},
        "measured_step_s": 0.52, "predicted_step_s": 0.47, "predicted_runtime_bytes": 88 * mib,
    }
    for sharded in (7, 0):
        c = console()
        _print_summary(c, DemoConfig(), {**s, "plan": {**s["plan"], "sharded": sharded}})
        out = printed(c)
        assert "memory per rank" in out and "predicted by the search" in out
        assert_fits(out)
