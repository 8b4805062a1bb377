"""The search on a (pipeline, data, tensor) mesh (issue 31): `elixir plan --tp T --pp P`.

Each stage's profile is the whole model's cut to what one rank holds; these checks hold the cut
to the runtime's own rules (the tensor-parallel plan's local shapes, every parameter on exactly
one stage but a tied embedding on the first and last) and the priced extras to their formulas.
"""

import argparse
import dataclasses
import math

import pytest
import torch

from elixir import plan_cli as cli
from elixir.hardware import load_profile
from elixir.plan import MeshLayout
from elixir.plan.tensor_plans import local_shapes, style_plan
from elixir.search.mesh_profile import search_mesh, stage_names, stage_profiles, tensor_profile
from elixir.search.optimal import search_profile
from elixir.search.step_profile import profile_from_module
from elixir.tracer.op_costs import OpCosts

HW = load_profile("8xH100-80GB")
G = 1 << 30


def _llama(layers: int = 4, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - transformers: the hf extra

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def _profile(model):
    return profile_from_module(model, activation_bytes=8 << 20, dtype=torch.bfloat16, tokens=256)


@pytest.mark.parametrize("tie", [False, True])
def test_stages_partition_the_parameters_by_layer(tie):
    model = _llama(tie=tie)
    prof = _profile(model)
    stages = stage_names(prof, 2)
    names = {n for n, _ in prof.params}
    assert set().union(*stages) == names
    both = stages[0] & stages[1]
    assert both == (set(prof.shared) if tie else set())  # only a tied embedding sits on two stages
    assert {n for n in stages[0] if ".layers." in n} == {n for n in names if ".layers.0." in n or ".layers.1." in n}
    assert "model.embed_tokens.weight" in stages[0] and "model.norm.weight" in stages[1]
    # activations: 1F1B's first stage holds pp microbatches, the last one; GPipe all of them
    one = stage_profiles(prof, 2, 4, "1f1b")
    assert one[0].activation_bytes == 2 * one[1].activation_bytes == prof.activation_bytes // 2 * 2 // 4
    assert stage_profiles(prof, 2, 4, "gpipe")[1].activation_bytes == prof.activation_bytes // 2
    with pytest.raises(ValueError, match="at least 8 layers"):
        stage_names(prof, 8)


def test_tensor_profile_holds_the_runtimes_local_shapes():
    model = _llama()
    prof = _profile(model)
    shapes = local_shapes(prof.params, style_plan(model), 4)
    tp = tensor_profile(prof, shapes, 4)
    assert dict(tp.params) == shapes
    held = sum(math.prod(s) for s in shapes.values())
    assert prof.total_numel / 4 < held < prof.total_numel / 2  # the norms stay whole
    assert tp.matmul_param_numel < prof.matmul_param_numel
    # each rank's matmuls move its slice of the weights: FLOPs and operand bytes scale together
    traced = dataclasses.replace(prof, op_costs=OpCosts({20: [4.0, 4e6, 3e5]}, {10: [2.0, 2e3]}, 9))
    cut = tensor_profile(traced, shapes, 4).op_costs
    share = tp.matmul_param_numel / prof.matmul_param_numel
    assert cut.matmul_flops == pytest.approx(4e6 * share) and cut.matmul_bytes == pytest.approx(3e5 * share)
    # Korthikanti et al.: (10 + 24/t) / 34 of the activations without sequence parallelism, 1/t with
    assert tp.activation_bytes == int(prof.activation_bytes * (10 + 24 / 4) / 34)
    assert tensor_profile(prof, shapes, 4, sequence_parallel=True).activation_bytes == prof.activation_bytes // 4


def test_a_one_stage_one_shard_mesh_is_the_data_parallel_search():
    prof = _profile(_llama())
    kw = dict(hardware=HW, device_memory=80 * G, host_memory=64 * G)
    mp = search_mesh(prof, MeshLayout(dp_shard=2), tp_shapes=None, hidden=32, microbatches=1, **kw)
    plain = search_profile(prof, 2, **_step_growth(prof), **kw)
    assert mp.stages[0].chunks == plain.chunks
    assert mp.step_time_s == pytest.approx(plain.prediction.step_time_s, rel=1e-12)
    assert mp.stages[0].prediction.peak_host_bytes == plain.prediction.peak_host_bytes
    # the process's step growth is counted (optimal_search counts it for a live model); given, it is kept
    assert mp.stages[0].info["process_bytes"] == HW.step_extra_bytes(prof.activation_bytes, False) > 0
    given = search_mesh(prof, MeshLayout(dp_shard=2), tp_shapes=None, hidden=32, microbatches=1, process_bytes=0, **kw)
    assert given.stages[0].info["process_bytes"] == 0


def _step_growth(profile) -> dict:
    """What search_mesh adds to the data-parallel search's keywords on a GPU profile (activations on the device)."""
    extra = HW.step_extra_bytes(profile.activation_bytes, False)
    return {"process_bytes": extra, "heap_slack_bytes": extra - HW.step_untracked_bytes}


def test_pipeline_and_tensor_axes_add_their_priced_terms():
    model = _llama()
    prof = _profile(model)
    layout = MeshLayout(pp=2, dp_shard=2, tp=2)
    shapes = local_shapes(prof.params, style_plan(model), 2)
    kw = dict(hardware=HW, device_memory=80 * G, host_memory=64 * G)
    m4 = search_mesh(prof, layout, tp_shapes=shapes, hidden=32, microbatches=4, **kw)
    m8 = search_mesh(prof, layout, tp_shapes=shapes, hidden=32, microbatches=8, **kw)
    assert len(m4.stages) == 2 and all(r.layout == MeshLayout(dp_shard=2, tp=2) for r in m4.stages)
    for c4, c8 in zip(m4.costs, m8.costs):
        assert c4.tensor_collectives > 0 and c4.pipeline_sends > 0
        assert c4.bubble_fraction == pytest.approx(1 / 4) and c8.bubble_fraction == pytest.approx(1 / 8)
    for r in m4.stages:
        br = r.prediction.breakdown
        assert br["pipeline_bubble"] > 0 and br["tensor_collectives"] > 0
    with pytest.raises(ValueError, match="tp_shapes"):
        search_mesh(prof, layout, tp_shapes=None, hidden=32, microbatches=4, **kw)


def test_pipeline_stages_price_the_microbatches_accumulation():
    """A stage accumulates its microbatches under no_sync: every sharded chunk gathered and every
    chunk's gradient buffer open (elixir.parallel.ElixirPipeline). On a budget that makes the search
    split the stage into several chunks, the stage's plan gets a block per sharded chunk and the
    bytes the data-parallel search did not count; none without a dp axis or with one microbatch."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - transformers: the hf extra

    from elixir.search.mesh_profile import accumulation_bytes  # noqa: PLC0415

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                             num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4))
    prof = profile_from_module(model, activation_bytes=8 << 20, dtype=torch.bfloat16, tokens=256)
    shapes = local_shapes(prof.params, style_plan(model), 2)
    kw = dict(hardware=HW, device_memory=48 << 20, host_memory=64 * G)
    mp = search_mesh(prof, MeshLayout(pp=2, dp_shard=2, tp=2), tp_shapes=shapes, hidden=512, microbatches=4, **kw)
    for prof_s, r in zip(stage_profiles(prof, 2, 4), mp.stages):
        cut = tensor_profile(prof_s, shapes, 2)
        plain = search_profile(cut, 2, **_step_growth(cut), **kw)  # the same search, unadjusted
        assert len(plain.chunks) > 1 and plain.cache_blocks < len(plain.chunks)
        extra = r.info["accumulation_bytes"]
        assert extra == accumulation_bytes(plain, 2) > 0
        assert r.prediction.peak_device_bytes == plain.prediction.peak_device_bytes + extra
        assert r.cache_blocks == max(plain.cache_blocks, sum(c.sharded for c in r.chunks))
    one = search_mesh(prof, MeshLayout(pp=2, dp_shard=2, tp=2), tp_shapes=shapes, hidden=512, microbatches=1, **kw)
    assert all("accumulation_bytes" not in r.info for r in one.stages)
    no_dp = search_mesh(prof, MeshLayout(pp=2, tp=2), tp_shapes=shapes, hidden=512, microbatches=4, **kw)
    assert all(r.info["accumulation_bytes"] == 0 for r in no_dp.stages)


def test_plan_cli_predicts_a_70b_cluster_run(capsys):
    args = cli_args("llama-70b", "--tp", "8", "--pp", "4", "--world-size", "32", "--hardware", "8xH100-80GB",
                    "--seq", "2048", "--checkpointing")
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "predicted per rank" in out and "pp 4 x tp 8" in out
    assert cli.main(cli_args("llama-70b", "--tp", "8", "--pp", "4", "--world-size", "12")) == 2
    assert "multiple of --tp x --pp" in capsys.readouterr().out


def cli_args(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))
