"""Booster and its plugins against the one-process reference, checkpoints through the Booster,
and the arguments the runtime cannot honour.

One spawned world-2 run (gloo, fp32) trains GPT-2, LLaMA and a tied model for 3 steps under
every plugin (DDP, FSDP2, Gemini "static" at shard fractions 0/0.5/1 with offload, Gemini "auto",
plugin="auto"); the parent compares losses with ``train_reference`` (rtol 1e-5) and parameters
with DDP's in the same run. The same run checks that a Booster checkpoint (model, optimizer,
LR scheduler) taken after 2 steps resumes the third step exactly, and the dataloader helper.
"""

from __future__ import annotations

import os

import pytest
import torch

from elixir.testing.reference import default_optimizer, train_reference

MODELS = ("gpt2", "llama", "tied")
STEPS = 3
BATCH = 4


def _plugins():
    from elixir.booster import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    return {
        "ddp": lambda: TorchDDPPlugin(),
        "fsdp": lambda: TorchFSDPPlugin(),
        "gemini_static_0": lambda: GeminiPlugin(placement_policy="static", shard_param_frac=0.0, offload_optim_frac=1.0, precision="fp32"),
        "gemini_static_0.5": lambda: GeminiPlugin(placement_policy="static", shard_param_frac=0.5, offload_optim_frac=0.5, precision="fp32"),
        "gemini_static_1": lambda: GeminiPlugin(
            placement_policy="static", shard_param_frac=1.0, offload_param_frac=1.0, offload_optim_frac=1.0, precision="fp32"
        ),
        "gemini_auto": lambda: GeminiPlugin(placement_policy="auto", precision="fp32"),
        "auto": lambda: "auto",
        "gemini_accum": lambda: GeminiPlugin(placement_policy="static", shard_param_frac=1.0, enable_gradient_accumulation=True, precision="fp32"),
        "zero1": lambda: LowLevelZeroPlugin(stage=1, precision="fp32"),
        # a small bucket: several ZeRO-2 chunks; state on the host
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32", reduce_bucket_size_in_m=0.01, cpu_offload=True),
    }


TRAINED = ("ddp", "fsdp", "gemini_static_0", "gemini_static_0.5", "gemini_static_1", "gemini_auto", "auto", "zero1", "zero2")


def _boosted(case: str, plugin_name: str, steps_sched: bool = False):
    from elixir.booster import Booster
    from elixir.testing.zoo import build_model

    model = build_model(case, seed=0)
    opt = default_optimizer([p for p in model.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9) if steps_sched else None
    booster = Booster(plugin=_plugins()[plugin_name]())
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched


def _accumulated_step(case: str, booster, model, opt) -> None:
    """Step 0 as two micro-batches per rank, the first under no_sync."""
    from elixir import distributed as edist
    from elixir.testing.reference import shard_batch
    from elixir.testing.zoo import get_case

    zc = get_case(case)
    mine = shard_batch(zc.make_batch(BATCH, 0), edist.get_rank(), edist.get_world_size())
    halves = [shard_batch(mine, i, 2) for i in range(2)]
    opt.zero_grad()
    with booster.no_sync(model, opt):
        booster.backward(zc.loss(model, halves[0]) / 2, opt)
    booster.backward(zc.loss(model, halves[1]) / 2, opt)
    opt.step()


def _train(case: str, booster, model, opt, steps, start=0, sched=None, norms=None) -> list[float]:
    from elixir import distributed as edist
    from elixir.testing.reference import shard_batch
    from elixir.testing.zoo import get_case

    zc = get_case(case)
    rank, world = edist.get_rank(), edist.get_world_size()
    torch.manual_seed(1)
    losses = []
    for step in range(start, start + steps):
        batch = shard_batch(zc.make_batch(BATCH, step), rank, world)
        opt.zero_grad()
        loss = zc.loss(model, batch)
        booster.backward(loss, opt)
        if norms is not None:
            norms.append(float(booster.clip_grad_by_norm(model, opt, 1e9)))  # the norm; clips nothing
        opt.step()
        if sched is not None:
            sched.step()
        t = loss.detach().clone()
        edist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _full_state(booster, model) -> dict:
    return {k: v.detach().clone() for k, v in booster.plugin.full_state_dict(model).items()}


def _resume(root: str, case: str, plugin_name: str) -> dict:
    """Train 2 steps, checkpoint, train 1; a fresh booster loads the checkpoint and trains the
    same step: losses and parameters must be equal."""
    booster, model, opt, sched = _boosted(case, plugin_name, steps_sched=True)
    _train(case, booster, model, opt, 2, sched=sched)
    d = os.path.join(root, f"{case}-{plugin_name}")
    booster.save_model(model, os.path.join(d, "model"), size_per_shard=0.02)  # 20 KiB: several shards
    booster.save_optimizer(opt, os.path.join(d, "optim"))
    booster.save_lr_scheduler(sched, os.path.join(d, "sched.pt"))
    cont = _train(case, booster, model, opt, 1, start=2, sched=sched)
    want = _full_state(booster, model)
    booster2, model2, opt2, sched2 = _boosted(case, plugin_name, steps_sched=True)
    booster2.load_model(model2, os.path.join(d, "model"))
    booster2.load_optimizer(opt2, os.path.join(d, "optim"))
    booster2.load_lr_scheduler(sched2, os.path.join(d, "sched.pt"))
    got_loss = _train(case, booster2, model2, opt2, 1, start=2, sched=sched2)
    got = _full_state(booster2, model2)
    return {
        "loss": (cont, got_loss),
        "param_diffs": [k for k in want if not torch.equal(want[k], got.get(k, torch.empty(0)))],
        "lr": (sched.get_last_lr(), sched2.get_last_lr()),
        "files": sorted(os.listdir(os.path.join(d, "model"))),
    }


def _worker(root: str) -> dict:
    from elixir.booster import TorchDDPPlugin

    out: dict = {"train": {}, "resume": {}, "reasons": {}, "norms": {}, "accum": {}}
    for case in MODELS:
        for name in TRAINED:
            booster, model, opt, _ = _boosted(case, name)
            norms: list = []
            losses = _train(case, booster, model, opt, STEPS, norms=norms)
            state = _full_state(booster, model)  # collective; the full dict on rank 0
            out["train"][(case, name)] = (losses, state)
            out["norms"][(case, name)] = norms
            if name == "auto":
                out["reasons"][case] = (type(booster.plugin).__name__, booster.reason)
    for name in ("ddp", "fsdp", "gemini_static_0.5", "zero2"):
        out["resume"][name] = _resume(root, "gpt2", name)
    for name in ("ddp", "fsdp", "gemini_accum", "zero2"):
        booster, model, opt, _ = _boosted("llama", name)
        _accumulated_step("llama", booster, model, opt)
        out["accum"][name] = _full_state(booster, model)
    # the dataloader helper: each rank its half, together everything once
    loader = TorchDDPPlugin().prepare_dataloader(list(range(10)), batch_size=2)
    out["data"] = [int(x) for b in loader for x in b]
    return out


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


@pytest.mark.dist
def test_plugins_match_reference_and_resume(tmp_path):
    from elixir.testing import run_distributed

    results = run_distributed(_worker, 2, str(tmp_path), timeout=600)
    got = results[0]
    errors = []
    for case in MODELS:
        ref = train_reference(case, steps=STEPS, batch_size=BATCH)
        ddp_losses, ddp_state = got["train"][(case, "ddp")]
        ddp_err = _max_diff({k: ref.state_dict[k] for k in ddp_state}, ddp_state)
        ddp_norms = got["norms"][(case, "ddp")]
        for name in TRAINED:
            if not torch.allclose(torch.tensor(got["norms"][(case, name)]), torch.tensor(ddp_norms), rtol=1e-5):
                errors.append(f"{case}/{name}: gradient norms {got['norms'][(case, name)]} != DDP's {ddp_norms}")
            losses, state = got["train"][(case, name)]
            if not torch.allclose(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-5, atol=0):
                errors.append(f"{case}/{name}: losses {losses} != reference {ref.losses}")
            if set(state) != set(ddp_state):
                errors.append(f"{case}/{name}: state keys differ from DDP's: {set(state) ^ set(ddp_state)}")
                continue
            err = _max_diff(ddp_state, state)
            if err > 2 * ddp_err + 1e-6:
                errors.append(f"{case}/{name}: parameters differ from DDP's by {err:.3g} (DDP vs reference: {ddp_err:.3g})")
    one = train_reference("llama", steps=1, batch_size=BATCH)
    for name, state in got["accum"].items():  # no_sync accumulation = one step on the whole batch
        err = _max_diff({k: one.state_dict[k] for k in state}, state)
        if err > 1e-5:
            errors.append(f"no_sync {name}: parameters differ from the one-step reference by {err:.3g}")
    for name, r in got["resume"].items():
        if r["loss"][0] != r["loss"][1] or r["param_diffs"] or r["lr"][0] != r["lr"][1]:
            errors.append(f"resume {name}: {r['loss']} params differing {r['param_diffs'][:3]} lr {r['lr']}")
        if "model.safetensors.index.json" not in r["files"] or "config.json" not in r["files"]:
            errors.append(f"resume {name}: not an HF sharded layout: {r['files']}")
    assert sorted(got["data"] + results[1]["data"]) == list(range(10))
    assert set(got["data"]).isdisjoint(results[1]["data"])
    for case, (plugin, reason) in got["reasons"].items():
        assert plugin in ("TorchDDPPlugin", "GeminiPlugin") and "optimal_search" in reason, (case, plugin, reason)
    assert not errors, "\n".join(errors)


# ---- in-process: arguments, plans ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"tp_size": 2}, "must divide the world size (1)"),
        ({"extra_dp_size": 2}, "extra_dp_size=1"),
        ({"master_weights": False}, "fp32 master"),
        ({"placement_policy": "auto", "offload_optim_frac": 0.5}, "placement_policy='static'"),
        ({"offload_param_frac": 0.5, "shard_param_frac": 0.5}, "shard_param_frac=1.0"),
        ({"precision": "fp8"}, "precision must be one of"),
    ],
)
def test_gemini_refuses_what_it_cannot_honour(kw, says):
    from elixir.booster import GeminiPlugin

    with pytest.raises(ValueError, match=None) as err:
        GeminiPlugin(**kw)
    assert says in str(err.value)


# ColossalAI 0.5's GeminiPlugin and LowLevelZeroPlugin signatures (colossalai/booster/plugin/*.py at
# v0.5.0), each name with a value other than its default
GEMINI_05 = dict(
    chunk_config_dict={2: {"chunk_size": 1 << 20}}, chunk_init_device="cpu", placement_policy="static",
    enable_gradient_accumulation=True, max_prefetch=1, shard_param_frac=1.0, offload_optim_frac=0.5,
    offload_param_frac=0.0, warmup_non_model_data_ratio=0.5, steady_cuda_cap_ratio=0.5, precision="bf16",
    pin_memory=True, force_outputs_fp32=True, strict_ddp_mode=True, search_range_m=64, hidden_dim=768,
    min_chunk_size_m=8, memstats=object(), gpu_margin_mem_ratio=0.5, initial_scale=2**8, min_scale=2, growth_factor=4,
    backoff_factor=0.25, growth_interval=10, hysteresis=3, max_scale=2**20, max_norm=1.0, norm_type=2.0,
    enable_all_optimization=True, enable_fused_normalization=True, enable_flash_attention=True,
    enable_sequence_parallelism=True, enable_jit_fused=True, enable_async_reduce=False, use_fp8=True, verbose=False,
    fp8_communication=True,
)
LOW_LEVEL_ZERO_05 = dict(
    stage=2, precision="bf16", initial_scale=2**8, min_scale=2, growth_factor=4, backoff_factor=0.25, growth_interval=10,
    hysteresis=3, max_scale=2**20, max_norm=1.0, norm_type=2.0, reduce_bucket_size_in_m=4,
    communication_dtype=torch.float32, overlap_communication=False, overlap_allgather=True, cpu_offload=True,
    verbose=False, cast_inputs=False, fp8_communication=True, use_fp8=True,
)


def test_every_colossalai_05_argument_is_accepted_and_what_is_ignored_says_so():
    """Before: strict_ddp_mode, chunk_init_device, device= were TypeErrors, hidden_dim a ValueError.
    Now each argument is honoured or ignored with a one-line note naming what elixir does."""
    import warnings

    from elixir.booster import Booster, GeminiPlugin, LowLevelZeroPlugin

    for plugin, kw, ignored in (
        (GeminiPlugin, GEMINI_05, {"chunk_config_dict", "chunk_init_device", "search_range_m", "hidden_dim", "min_chunk_size_m",
                                   "memstats", "warmup_non_model_data_ratio", "steady_cuda_cap_ratio", "gpu_margin_mem_ratio",
                                   "enable_fused_normalization", "enable_jit_fused", "enable_sequence_parallelism",
                                   "enable_async_reduce", "use_fp8", "fp8_communication", "enable_all_optimization"}),
        (LowLevelZeroPlugin, LOW_LEVEL_ZERO_05, {"overlap_communication", "overlap_allgather", "cast_inputs",
                                                 "fp8_communication", "use_fp8"}),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = plugin(**kw)
        said = [str(w.message) for w in caught]
        for name in ignored:
            assert any(f"({name}=" in m and m.startswith("elixir: ") for m in said), (name, said)
        assert all("\n" not in m for m in said)  # one line each
        if plugin is GeminiPlugin:
            assert p.use_fused_kernels and p.output_fp32 is True and p.pin_memory and p.max_prefetch == 1
        # at ColossalAI's defaults nothing is said
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plugin(strict_ddp_mode=False) if plugin is GeminiPlugin else plugin(overlap_communication=True, cast_inputs=True)
    with pytest.warns(UserWarning, match=r"device=.* is ignored: elixir computes on its default device"):
        GeminiPlugin(device="cpu")
    # Booster: ColossalAI's arguments and positional order
    g = GeminiPlugin(precision="fp32")
    with pytest.warns(UserWarning, match="Booster\\(device='cuda'\\) is ignored"):
        assert Booster("cuda", None, g).plugin is g
    with pytest.warns(UserWarning, match="precision= sets the compute dtype"):
        Booster(plugin=g, mixed_precision="bf16")
    assert Booster(g).plugin is g


def test_pin_memory_reaches_the_plan_on_every_path():
    """Before: dropped on the 'auto' and plan= paths (GeminiPlugin(placement_policy='auto', pin_memory=False) pinned)."""
    from elixir.booster import GeminiPlugin
    from elixir.search import minimum_waste_search
    from elixir.testing.zoo import build_model

    model = build_model("gpt2")
    pinned = minimum_waste_search(model, 1)
    assert pinned.info.get("pin_memory", True) is True
    for kw in ({"placement_policy": "auto"}, {"plan": pinned}, {"placement_policy": "cpu"}, {}):
        for pin in (False, True):
            plan = GeminiPlugin(precision="fp32", pin_memory=pin, **kw).make_plan(model)
            assert plan.info["pin_memory"] is pin, (kw, pin)


def test_booster_argument_errors():
    from elixir.booster import Booster, GeminiPlugin, TorchDDPPlugin

    with pytest.raises(ValueError, match="precision on the plugin"):
        Booster(plugin=TorchDDPPlugin(), mixed_precision="bf16")
    with pytest.raises(ValueError, match="'auto'"):
        Booster(plugin="gemini")
    with pytest.raises(TypeError, match="unexpected argument"):
        GeminiPlugin(no_such_thing=1)


@pytest.mark.parametrize("fracs", [(0.0, 0.0, 0.0), (0.5, 0.0, 0.5), (1.0, 1.0, 1.0), (1.0, 0.25, 0.75)])
def test_static_fractions_give_exactly_that_plan(fracs):
    from elixir.search import Placement, minimum_waste_search
    from elixir.search.placement_policy import StaticFractions, apply_static
    from elixir.testing.zoo import build_model

    shard, off_p, off_o = fracs
    base = minimum_waste_search(build_model("gpt2"), 2)
    n = len(base.chunks)
    plan = apply_static(base, StaticFractions(shard, off_p, off_o))
    assert [c.sharded for c in plan.chunks] == [i < round(shard * n) for i in range(n)]
    assert [c.shard_placement is Placement.HOST for c in plan.chunks] == [i < round(off_p * n) for i in range(n)]
    assert [c.optim_placement is Placement.HOST for c in plan.chunks] == [i < round(off_o * n) for i in range(n)]
    assert [c.params for c in plan.chunks] == [c.params for c in base.chunks]  # chunks in order


def test_auto_chooses_gemini_for_low_precision_and_says_why():
    from elixir.booster import GeminiPlugin
    from elixir.booster.auto import choose_plugin
    from elixir.testing.zoo import build_model

    choice = choose_plugin(build_model("gpt2"), torch.bfloat16)
    assert isinstance(choice.plugin, GeminiPlugin) and choice.plugin.plan is not None
    assert choice.plugin.dtype == torch.bfloat16
    assert "optimal_search" in choice.reason and "bfloat16" in choice.reason


@pytest.mark.dist
def test_booster_gemini_example_smoke(tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "example/booster_gemini.py", "--small", "--steps", "3", "--save", str(tmp_path / "ckpt")]
    r = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(x == x for x in losses)
    assert (tmp_path / "ckpt" / "model" / "model.safetensors").exists()
    assert (tmp_path / "ckpt" / "optimizer" / "index.json").exists()


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"stage": 3}, "GeminiPlugin"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"communication_dtype": torch.float16, "precision": "bf16"}, "torch.float32"),
        ({"master_weights": False}, "fp32 master"),
        ({"extra_dp_size": 2}, "extra_dp_size=1"),
        ({"reduce_bucket_size_in_m": 0}, "reduce_bucket_size_in_m"),
    ],
)
def test_low_level_zero_refuses_what_it_cannot_honour(kw, says):
    from elixir.booster import LowLevelZeroPlugin

    with pytest.raises(ValueError) as err:
        LowLevelZeroPlugin(**kw)
    assert says in str(err.value)
    with pytest.raises(TypeError, match="unexpected argument"):
        LowLevelZeroPlugin(no_such_thing=1)


@pytest.mark.parametrize("stage", [1, 2])
def test_low_level_zero_plan_has_every_argument_in_it(stage):
    from elixir.booster import LowLevelZeroPlugin
    from elixir.search import Placement, Sharding
    from elixir.testing.zoo import build_model

    model = build_model("gpt2")
    big = LowLevelZeroPlugin(stage=stage).make_plan(model)
    small = LowLevelZeroPlugin(stage=stage, reduce_bucket_size_in_m=0.01, cpu_offload=True).make_plan(model)
    kind = {1: Sharding.ZERO1, 2: Sharding.ZERO2}[stage]
    for plan, optim in ((big, Placement.DEVICE), (small, Placement.HOST)):
        assert {c.sharding for c in plan.chunks} == {kind} and plan.cache_blocks == 0
        assert {c.optim_placement for c in plan.chunks} == {optim}
        assert {c.shard_placement for c in plan.chunks} == {Placement.DEVICE}
    largest = max(p.numel() for p in model.parameters())
    bucket = int(0.01 * 2**20)
    # reduce_bucket_size_in_m caps the chunks (a parameter larger than the bucket gets its own)
    assert len(small.chunks) > len(big.chunks)
    assert all(c.chunk_size <= max(bucket, largest) + 16 * 2 or len(c.params) == 1 for c in small.chunks)
    bf = LowLevelZeroPlugin(stage=stage, precision="bf16", communication_dtype=torch.float32)
    assert bf.dtype == torch.bfloat16 and bf.reduce_always_fp32
    assert bf.loss_scale.initial_scale == 2.0**32  # ColossalAI's default for this plugin


def test_plugins_take_colossalai_loss_scale_keywords():
    """Both runtime plugins build their LossScalePolicy from ColossalAI's loss-scale keywords
    (their own default initial_scale, the policy's for the rest) and check it at construction."""
    from elixir.booster import GeminiPlugin, LowLevelZeroPlugin
    from elixir.wrapper import LossScalePolicy

    kw = dict(min_scale=2.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7, hysteresis=3, max_scale=2.0**20)
    assert GeminiPlugin(**kw).loss_scale == LossScalePolicy(initial_scale=2.0**16, **kw)
    assert LowLevelZeroPlugin(**{**kw, "max_scale": 2.0**40}).loss_scale == LossScalePolicy(
        initial_scale=2.0**32, **{**kw, "max_scale": 2.0**40})
    assert GeminiPlugin(initial_scale=2.0**8).loss_scale == LossScalePolicy(initial_scale=2.0**8)
    for plugin in (GeminiPlugin, LowLevelZeroPlugin):
        with pytest.raises(ValueError, match="initial_scale"):
            plugin(initial_scale=0.5)
        with pytest.raises(TypeError):  # past precision, arguments are keywords: no silent shift
            plugin(*([1, "fp16"] if plugin is LowLevelZeroPlugin else ["static", 1.0, 0.0, 0.0, "fp16"]), 2.0**16)
