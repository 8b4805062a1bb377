"""HybridParallelPlugin and GeminiPlugin(tp_size=...) (issue 31, step 4) under ColossalAI's names.

In one world-4 job, against a one-process full-batch reference (SGD, clipping that clips at every
step): GeminiPlugin(tp_size=2) and HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=3) train
through ``model(**batch)`` / ``booster.backward``; HybridParallelPlugin(pp_size=2, zero_stage=1,
num_microbatches=4) and (tp_size=2, pp_size=2) through ``booster.execute_pipeline`` with a
ColossalAI ``criterion(outputs, inputs)``, ``prepare_dataloader`` sharding over dp, and the
user's optimizer object (with its LR scheduler) doing the step. Losses within rtol 1e-5. A TP2 x PP2
checkpoint (``booster.save_model``, Hugging Face's layout) loads into PP2 x DP2 and, at world 1,
into transformers' own ``from_pretrained``, and both continue with the uninterrupted losses.
"""

from __future__ import annotations

import pytest
import torch

from elixir import distributed as edist
from elixir.testing import run_distributed
from elixir.testing.reference import shard_batch
from elixir.testing.zoo import ZOO
from tests.mesh_cases import Rows, plugin_steps

STEPS = 3
LR = 0.5
MAX_NORM = 0.3
BATCH = 8


def _build():
    torch.manual_seed(0)
    return ZOO["gpt2"].build(n_layer=4)


def _batches() -> list[dict]:
    return [ZOO["gpt2"].make_batch(BATCH, step) for step in range(STEPS)]


def _reference(trained: bool = False):
    model = _build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses = []
    for batch in _batches():
        loss = ZOO["gpt2"].loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return model if trained else losses


def _run(plugin, save: str = "") -> list[float]:
    from elixir.booster import Booster

    booster = Booster(plugin=plugin)
    model = _build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    pipelined = getattr(plugin, "pp_size", 1) > 1
    dp = plugin.dp_size if hasattr(plugin, "dp_size") else edist.get_world_size() // plugin.tp_size
    losses = []
    for step in range(STEPS):
        if pipelined:
            loader = plugin.prepare_dataloader(Rows(_batches()[step]["input_ids"]), batch_size=BATCH // dp)
            out = booster.execute_pipeline(iter(loader), model, lambda outputs, inputs: outputs.loss, opt)
            loss = out["loss"]
        else:
            rank = edist.get_rank() // plugin.tp_size  # the dp coordinate: tp is the inner axis
            loss = ZOO["gpt2"].loss(model, shard_batch(_batches()[step], rank, dp))
            booster.backward(loss, opt)
        if not pipelined:
            clipped = booster.clip_grad_by_norm(model, opt, MAX_NORM)
            assert clipped > MAX_NORM
        opt.step()
        opt.zero_grad()
        sched.step()
        t = torch.zeros(()) if loss is None else loss.detach().clone()  # every rank joins the sum
        edist.all_reduce(t)
        losses.append(t.item())
    if save:
        booster.save_model(model, save)
    return losses


def _pipeline_steps(booster, plugin, model, opt, steps) -> list[float]:
    return plugin_steps(booster, plugin, model, opt, [_batches()[s] for s in steps], ZOO["gpt2"].loss)


def _checkpoints(path: str) -> dict:
    """TP2 x PP2 trains 2 steps, saves (HF layout), trains 2 more; the checkpoint loaded into a
    PP2 x DP2 (ZeRO-3) layout continues with the same losses. The test process loads it at world 1."""
    from elixir.booster import Booster, HybridParallelPlugin

    def boosted(momentum: float = 0.0, **kw):
        plugin = HybridParallelPlugin(pp_size=2, microbatch_size=2, precision="fp32", max_norm=MAX_NORM, **kw)
        booster = Booster(plugin=plugin)
        model = _build()
        model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum))
        return booster, plugin, model, opt

    booster, plugin, model, opt = boosted(tp_size=2, zero_stage=1)
    first = _pipeline_steps(booster, plugin, model, opt, range(2))
    booster.save_model(model, path)
    after = _pipeline_steps(booster, plugin, model, opt, range(2))
    booster, plugin, model, opt = boosted(tp_size=1, zero_stage=3)
    booster.load_model(model, path)
    reloaded = _pipeline_steps(booster, plugin, model, opt, range(2))
    # optimizer state (SGD momentum) saved and loaded at the same layout
    booster, plugin, model, opt = boosted(tp_size=2, zero_stage=1, momentum=0.9)
    _pipeline_steps(booster, plugin, model, opt, range(1))
    booster.save_model(model, path + "_m")
    booster.save_optimizer(opt, path + "_opt")
    kept = _pipeline_steps(booster, plugin, model, opt, range(1, 3))
    resumed = {}
    for load_state in (True, False):
        booster, plugin, model, opt = boosted(tp_size=2, zero_stage=1, momentum=0.9)
        booster.load_model(model, path + "_m")
        if load_state:
            booster.load_optimizer(opt, path + "_opt")
        resumed[load_state] = _pipeline_steps(booster, plugin, model, opt, range(1, 3))
    return {"first": first, "after": after, "reloaded": reloaded, "kept": kept, "resumed": resumed[True],
            "fresh_state": resumed[False]}


def _worker(path: str):
    from elixir.booster import GeminiPlugin, HybridParallelPlugin

    ref = _reference()
    runs = {
        "gemini_tp2": GeminiPlugin(tp_size=2, precision="fp32"),
        "hybrid_tp2_dp2_zero3": HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=3, precision="fp32"),
        "hybrid_pp2_dp2_zero1": HybridParallelPlugin(tp_size=1, pp_size=2, zero_stage=1, num_microbatches=4,
                                                     precision="fp32", max_norm=MAX_NORM),
        "hybrid_tp2_pp2": HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, microbatch_size=2, precision="fp32",
                                               max_norm=MAX_NORM),
        # two stages per rank: the second steps a copy of the user's optimizer, which follows its LR
        "hybrid_pp2_interleaved": HybridParallelPlugin(tp_size=1, pp_size=2, zero_stage=3, num_microbatches=2,
                                                       pp_style="interleaved", num_model_chunks=2, precision="fp32",
                                                       max_norm=MAX_NORM),
    }
    out = {"ref": ref}
    for name, plugin in runs.items():
        last = plugin.stage_manager.is_last_stage() if getattr(plugin, "stage_manager", None) else True
        losses = _run(plugin, save=path + "_gemini" if name == "gemini_tp2" else "")
        # every rank summed the loss of the ranks that hold one: divide by how many do
        holders = torch.tensor([float(last)])
        edist.all_reduce(holders)
        out[name] = [x / holders.item() for x in losses]
    out["ckpt"] = _checkpoints(path)
    return out


@pytest.mark.dist
def test_hybrid_and_gemini_tp_plugins_match_reference(tmp_path):
    from transformers import GPT2LMHeadModel

    path = str(tmp_path / "tp2_pp2")
    results = run_distributed(_worker, 4, path, timeout=400)
    for r in results:
        for name in ("gemini_tp2", "hybrid_tp2_dp2_zero3", "hybrid_pp2_dp2_zero1", "hybrid_tp2_pp2", "hybrid_pp2_interleaved"):
            assert r[name] == pytest.approx(r["ref"], rel=1e-5), (name, r[name], r["ref"])
        ckpt = r["ckpt"]  # saved at (tp 2, pp 2, dp 1), loaded at (tp 1, pp 2, dp 2): the same losses
        assert ckpt["first"] == pytest.approx(r["ref"][:2], rel=1e-5), ckpt
        assert ckpt["reloaded"] == pytest.approx(ckpt["after"], rel=1e-5), ckpt
        assert ckpt["resumed"] == pytest.approx(ckpt["kept"], rel=1e-6), ckpt  # with the momentum it saved
        assert ckpt["fresh_state"][1] != pytest.approx(ckpt["kept"][1], rel=1e-6), ckpt  # the state matters
    # ... and at world 1, by transformers itself, continuing with the same losses
    model = GPT2LMHeadModel.from_pretrained(path)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in _batches()[:2]:
        loss = ZOO["gpt2"].loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == pytest.approx(results[0]["ckpt"]["after"], rel=1e-5), (losses, results[0]["ckpt"])
    # GeminiPlugin(tp_size=2) saved whole tensors: the trained model, as the reference trained it
    saved, ref = GPT2LMHeadModel.from_pretrained(path + "_gemini"), _reference(trained=True)
    batch = ZOO["gpt2"].make_batch(BATCH, 99)
    with torch.no_grad():
        assert ZOO["gpt2"].loss(saved, batch).item() == pytest.approx(ZOO["gpt2"].loss(ref, batch).item(), rel=1e-5)


# ---- in-process: arguments ----------------------------------------------------------------------


@pytest.mark.parametrize("kw, says", [
    ({"custom_policy": object()}, "tp_plan="),
    ({"enable_sequence_parallelism": True, "tp_size": 2, "pp_size": 2, "num_microbatches": 2}, "pp_size=1"),
    ({"enable_sequence_parallelism": True, "tp_size": 2, "tp_plan": {}}, "SequenceParallel / PrepareModuleInput"),
    ({"enable_sequence_parallelism": True, "sequence_parallelism_mode": "all_to_all"}, "'split_gather'"),
    ({"sp_size": 2}, "enable_sequence_parallelism=True splits the sequence over the tp ranks"),
    ({"scheduler_nodes": [1]}, "pp_style='1f1b' or 'interleaved'"),
    ({"zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3"),
    ({"pp_size": 2}, "num_microbatches or microbatch_size"),
    ({"pp_size": 2, "num_microbatches": 4, "pp_style": "zbv"}, "zero-bubble"),
    ({"precision": "fp8"}, "precision must be one of"),
    ({"tp_size": 3}, "must divide by tp_size * pp_size"),
])
def test_hybrid_refuses_naming_the_alternative(kw, says):
    from elixir.booster import HybridParallelPlugin

    args = {"tp_size": 1, "pp_size": 1, **kw}
    with pytest.raises(ValueError) as err:
        HybridParallelPlugin(**args)
    assert says in str(err.value)


def test_hybrid_takes_every_colossalai_argument():
    import inspect

    from elixir.booster import HybridParallelPlugin
    from elixir.booster.hybrid import HYBRID

    own = set(inspect.signature(HybridParallelPlugin.__init__).parameters)
    scale = {"initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "max_scale"}
    colossalai = {  # ColossalAI's HybridParallelPlugin.__init__ arguments
        "tp_size", "pp_size", "sp_size", "precision", "zero_stage", "enable_all_optimization", "enable_fused_normalization",
        "enable_flash_attention", "enable_jit_fused", "enable_sequence_parallelism", "sequence_parallelism_mode",
        "parallel_output", "num_microbatches", "microbatch_size", "max_norm", "broadcast_buffers", "ddp_bucket_cap_mb",
        "find_unused_parameters", "check_reduction", "gradient_as_bucket_view", "static_graph", "zero_bucket_size_in_m",
        "cpu_offload", "communication_dtype", "overlap_communication", "custom_policy", "pp_style", "num_model_chunks",
        "scheduler_nodes", "num_layers_per_stage", "gradient_checkpoint_config", "enable_metadata_cache",
        "make_vocab_size_divisible_by", "dp_outside", "overlap_p2p", "overlap_allgather", "fp8_communication", "use_fp8",
        "inner_ring_size",
    } | scale
    assert colossalai <= own | set(HYBRID) | scale, colossalai - own - set(HYBRID) - scale
