"""The state formats (issue 33 item 4) wherever a plan is made: `elixir plan --tp/--pp`, the
Booster's ``plugin="auto"``, GeminiPlugin and the trainer integrations.

- the mesh search prices each stage's optimizer state by the data-parallel search's footprint
  rule (the bytes a chunk's moments take in each format, int8's block scales by whole blocks)
  and records the formats in every stage's plan; ``--allow-lossy-state`` lets it turn to leaner
  formats, from the same ladder, where the asked ones do not fit (budgets from the search's own
  refusals, no figures written here); a frozen base's format reaches it too;
- ``Booster(plugin="auto", moments=...)`` plans in the formats and runs them (never on DDP, whose
  state is fp32); ``allow_lossy_state`` reaches the search from every front end, and is refused
  where no search would act on it.
"""

from __future__ import annotations

import pytest
import torch

from elixir import cli
from elixir.hardware import load_profile
from elixir.plan import MeshLayout, SearchResult
from elixir.plan.budgets import DoesNotFitError
from elixir.plan.state_format import frozen_shard_bytes, moment_nbytes
from elixir.plan.tensor_plans import local_shapes, style_plan
from elixir.search.mesh_profile import search_mesh
from elixir.search.step_profile import profile_from_module
from elixir.testing.zoo import build_model
from tests.search_cases import tiny_gpt2_config

MESH = ["--seq", "16", "--world-size", "8", "--tp", "2", "--pp", "2", "--hardware", "8xH100-80GB"]


def _stages(tmp_path, *flags: str) -> tuple[list[SearchResult], str]:
    """The stage plans ``elixir plan`` writes for the tiny GPT-2 on pp 2 x dp 2 x tp 2, and its report."""
    out = tmp_path / ("_".join(flags).replace("-", "") or "plain")
    out.mkdir()
    assert cli.main(["plan", tiny_gpt2_config(tmp_path), *MESH, *flags, "--out", str(out / "plan.json")]) == 0
    return [SearchResult.load(str(out / f"plan.stage{k}.json")) for k in range(2)]


def _shard_elements(r: SearchResult, chunks=None) -> list[int]:
    """Elements of each chunk (default: the trainable ones) one rank holds."""
    return [c.chunk_size // r.world_size if c.sharded else c.chunk_size for c in (chunks or r.chunks)]


def test_mesh_plan_prices_and_records_each_format(tmp_path, capsys):
    """Each stage's moments cost their format's bytes per element of every chunk it holds (the
    footprint rule, against the fp32 plan of the same chunks); every stage plan records the
    formats and the report names them."""
    fp32 = _stages(tmp_path)
    capsys.readouterr()
    for moments in ("bf16", "int8"):
        lossy = _stages(tmp_path, "--moments", moments)
        assert f"stage 1 state formats (master/moments): as asked (fp32/{moments})" in capsys.readouterr().out
        for a, b in zip(fp32, lossy):
            assert (b.master_format, b.moments_format) == ("fp32", moments)
            assert [c.params for c in b.chunks] == [c.params for c in a.chunks]
            saved = sum(moment_nbytes("fp32", n) - moment_nbytes(moments, n) for n in _shard_elements(a))
            placed = a.info["predicted_memory"]["placed_device"] - b.info["predicted_memory"]["placed_device"]
            assert placed == saved > 0, (moments, placed, saved)
    leanest = _stages(tmp_path, "--master", "bf16-sr", "--moments", "int8")
    for a, b in zip(lossy, leanest):
        assert (b.master_format, b.moments_format) == ("bf16-sr", "int8")
        assert b.prediction.peak_device_bytes < a.prediction.peak_device_bytes
    # --allow-lossy-state reaches the mesh search: room enough, the formats stay, recorded with why
    for r in _stages(tmp_path, "--allow-lossy-state"):
        assert (r.master_format, r.moments_format) == ("fp32", "fp32")
        assert r.info["state_formats"]["why"].startswith("as asked (fp32/fp32)")


def _on_tp(model):
    """``model``'s profile (bf16) and each parameter's local shape on tp 2."""
    prof = profile_from_module(model, activation_bytes=1 << 16, dtype=torch.bfloat16, tokens=64)
    return model, prof, local_shapes(prof.params + prof.frozen_shapes, style_plan(model), 2)


@pytest.fixture(scope="module")
def tp_llama():
    """The zoo's tiny LLaMA on tp 2 (one stage, no data-parallel axis) of the CPU box: its profile
    and each parameter's local shape. Searched with only elixir's own bytes (``process_bytes=0``:
    the process term would bury the state's bytes in the refusals' precision)."""
    return _on_tp(build_model("llama"))


def _mesh(tp_model, budget: int, **formats) -> SearchResult:
    model, prof, shapes = tp_model
    mp = search_mesh(prof, MeshLayout(tp=2), tp_shapes=shapes, hidden=model.config.hidden_size, microbatches=1,
                     hardware=load_profile("cpu-box"), device_memory=budget, host_memory=budget, process_bytes=0,
                     **formats)
    return mp.stages[0]


def _least(tp_llama, master: str, moments: str) -> int:
    with pytest.raises(DoesNotFitError) as e:
        _mesh(tp_llama, 1 << 16, master=master, moments=moments)
    return e.value.needs["host_memory"]  # the one pool of the CPU profile, as the host budget


def test_mesh_search_turns_to_leaner_formats_only_where_allowed(tp_llama):
    """Between what int8 moments need and what fp32 ones need on a tp rank, fp32 is refused and
    ``allow_lossy_state`` takes int8 moments (the data-parallel search's ladder), recorded."""
    fp32, int8 = _least(tp_llama, "fp32", "fp32"), _least(tp_llama, "fp32", "int8")
    assert int8 < fp32
    budget = (int8 + fp32) // 2
    with pytest.raises(DoesNotFitError):
        _mesh(tp_llama, budget)
    r = _mesh(tp_llama, budget, allow_lossy_state=True)
    assert (r.master_format, r.moments_format) == ("fp32", "int8")
    assert r.info["state_formats"]["why"].startswith("allow_lossy_state: fp32/fp32 does not fit")


def test_mesh_search_stores_a_frozen_base_in_its_format():
    """A frozen base (the embeddings and head, as an adapter fine-tune keeps them) is stored in its
    format on each tp rank when asked: its shards priced at the packed bytes the runtime writes
    (the footprint rule, ``frozen_shard_bytes``), fewer than in the compute dtype."""
    model = build_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_(".layers." in name)
    tp_model = _on_tp(model)
    held = {}
    for fmt in (None, "nf4", "int8"):
        r = _mesh(tp_model, 1 << 40, frozen=fmt)
        assert r.frozen_chunks and r.frozen_format == fmt
        held[fmt] = r.info["predicted_memory"]["frozen_shards"]
        assert held[fmt] == sum(frozen_shard_bytes(fmt, n, 2) for n in _shard_elements(r, r.frozen_chunks)), fmt
    assert held["nf4"] < held["int8"] < held[None]


def test_auto_booster_plans_and_runs_the_formats():
    """``Booster(plugin="auto", moments="int8")``: the plan records int8 moments, GeminiPlugin runs
    them (DDP keeps fp32 state, so it is never chosen then), and the module keeps them."""
    from elixir.booster import Booster, GeminiPlugin
    from elixir.booster.auto import choose_plugin
    from elixir.optim import CPUAdam

    choice = choose_plugin(build_model("gpt2"), torch.float32, formats={"moments": "int8"})
    assert isinstance(choice.plugin, GeminiPlugin) and choice.plugin.plan.moments_format == "int8"
    assert choice.plugin.state_formats == ("fp32", "int8") and "fp32/int8" in choice.reason
    # allow_lossy_state reaches the search: it records the formats it kept and why
    allowed = choose_plugin(build_model("gpt2"), torch.bfloat16, formats={"allow_lossy_state": True})
    assert "why" in allowed.plugin.plan.info["state_formats"]
    model = build_model("gpt2")
    booster = Booster(plugin="auto", moments="int8")
    em, _, *_ = booster.boost(model, CPUAdam(list(model.parameters()), lr=1e-3))
    assert em.state_formats == ("fp32", "int8") and isinstance(booster.plugin, GeminiPlugin)


def test_allow_lossy_state_reaches_every_front_ends_search_or_is_refused():
    """Every front end takes ``allow_lossy_state`` into its search (the plan records why it kept
    its formats); where its plan does not come from ``optimal_search`` it is refused, not ignored."""
    from elixir.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
    from elixir.integrations.options import ElixirOptions

    model = build_model("llama")
    for plan in (ElixirOptions(placement_policy="auto", allow_lossy_state=True).make_plan(model, 1, torch.bfloat16, False),
                 GeminiPlugin(placement_policy="auto", precision="bf16", allow_lossy_state=True).make_plan(model)):
        assert plan.info["state_formats"]["why"].startswith("as asked (fp32/fp32)")
    with pytest.raises(ValueError, match="placement_policy='auto' or search='optimal'"):
        ElixirOptions(allow_lossy_state=True)
    with pytest.raises(ValueError, match="placement_policy='auto'"):
        GeminiPlugin(allow_lossy_state=True)
    with pytest.raises(ValueError, match="minimum_waste_search"):
        LowLevelZeroPlugin(allow_lossy_state=True)
    with pytest.raises(ValueError, match="is for plugin='auto'"):
        Booster(plugin=TorchDDPPlugin(), moments="int8")


def test_trainer_integrations_take_allow_lossy_state(tmp_path):
    """The Lightning strategy and ElixirTrainer hand ``allow_lossy_state`` to their options (the
    search above), and refuse it with a placement that does not search."""
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from elixir.integrations.lightning import ElixirStrategy
    from elixir.integrations.transformers import ElixirTrainer

    assert ElixirStrategy(placement_policy="auto", allow_lossy_state=True).options.allow_lossy_state
    with pytest.raises(ValueError, match="allow_lossy_state"):
        ElixirStrategy(allow_lossy_state=True)
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    trainer = ElixirTrainer(model=build_model("gpt2"), args=args, placement_policy="auto", allow_lossy_state=True)
    assert trainer.options.allow_lossy_state
    with pytest.raises(ValueError, match="allow_lossy_state"):
        ElixirTrainer(model=build_model("gpt2"), args=args, allow_lossy_state=True)
