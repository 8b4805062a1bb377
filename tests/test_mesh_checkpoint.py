"""Model and optimizer state across mesh layouts (issue 31: What to build 5, Done when 2).

One world-4 launch, a tiny LLaMA, AdamW, HybridParallelPlugin: an uninterrupted run at
(tp 2, pp 2, dp 1) saves its model (Hugging Face layout) and optimizer (``booster.save_optimizer``:
a mesh checkpoint) after 1 of 3 steps. The optimizer checkpoint then loads at (tp 1, pp 2, dp 2),
is saved again there and loads at (tp 2, pp 1, dp 2), saved again and loaded at (tp 1, pp 1, dp 4):
each run continues with the uninterrupted run's last 2 losses (rtol 1e-5), and the four
checkpoints hold the same values bit for bit (``consolidate``: masters, ``exp_avg``,
``exp_avg_sq``, ``step``), torch AdamW's state after that step. In the test process
(world size 1, Done when 2), ``elixir.checkpoint.load`` reads the TP2 x PP2 checkpoint into a plain
ElixirModule that continues with the same losses. The model saved at TP2 x PP2 (``save_model``:
each stage its own files, ``save_pretrained_mesh``) holds the same masters. A tiny GPT-2 (fused
``c_attn``, ``wte`` tied to ``lm_head`` across stages) goes from TP2 x PP2 to DP4 the same way.
Refusals: a checkpoint with a part missing, and an optimizer with other param groups, raise on
every rank, and every rank carries on.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from elixir import distributed as edist
from elixir.testing.zoo import ZOO
from tests.launch_jobs import Job, result, run_jobs
from tests.mesh_cases import plugin_steps, tiny_llama

STEPS, SAVE_AT, LR, BATCH = 3, 1, 1e-2, 8  # the state compared with torch's is the first step's (below)
LOSS = ZOO["llama"].loss
# (name, (tp, pp, zero_stage), loads the optimizer checkpoint of)
CHAIN = [("b", (1, 2, 3), "a"), ("c", (2, 1, 2), "b"), ("d", (1, 1, 3), "c")]
# GPT-2: its fused c_attn (reordered by tp rank) and the wte / lm_head tie (one parameter on each of
# two stages at pp 2, one at pp 1), from TP2 x PP2 straight to DP4
GPT2_CHAIN = [("gpt2_b", (1, 1, 3), "gpt2_a")]


def _build(family: str):
    if family == "llama":
        return tiny_llama()
    torch.manual_seed(0)
    return ZOO["gpt2"].build()


def _batches() -> list[dict]:
    return [ZOO["llama"].make_batch(BATCH, step) for step in range(STEPS)]  # tokens of the zoo's vocabulary


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _boost(tp: int, pp: int, zero: int, groups: int = 1, family: str = "llama"):
    from elixir.booster import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, zero_stage=zero, precision="fp32",
                                  microbatch_size=2 if pp > 1 else None)
    booster = Booster(plugin=plugin)
    model = _build(family)
    params = list(model.parameters())
    opt = _adamw(params if groups == 1 else [{"params": params[:1]}, {"params": params[1:]}])
    model, opt, *_ = booster.boost(model, opt)
    return booster, plugin, model, opt


def _chain(root: str, family: str = "llama", chain: tuple = tuple(CHAIN)) -> dict:
    """The uninterrupted run and the chain of layouts (module docstring); every run's losses."""
    batches = _batches()
    pre = "" if family == "llama" else f"{family}_"
    booster, plugin, model, opt = _boost(2, 2, 1, family=family)
    out = {"uninterrupted": plugin_steps(booster, plugin, model, opt, batches[:SAVE_AT], LOSS)}
    booster.save_model(model, os.path.join(root, pre + "model"))
    booster.save_optimizer(opt, os.path.join(root, pre + "a"))
    out["uninterrupted"] += plugin_steps(booster, plugin, model, opt, batches[SAVE_AT:], LOSS)
    for name, (tp, pp, zero), source in chain:
        booster, plugin, model, opt = _boost(tp, pp, zero, family=family)
        if name == chain[0][0]:  # the others take their weights from the optimizer checkpoint's masters alone
            booster.load_model(model, os.path.join(root, pre + "model"))
        booster.load_optimizer(opt, os.path.join(root, source))
        booster.save_optimizer(opt, os.path.join(root, name))  # before any step: the values it loaded
        out[name] = plugin_steps(booster, plugin, model, opt, batches[SAVE_AT:], LOSS)
    return out


def _refusals(root: str) -> dict:
    """Loads that must fail on every rank, each followed by a collective every rank must reach."""
    from elixir.checkpoint import CheckpointError

    bad = os.path.join(root, "a_bad")
    if edist.get_rank() == 0:
        shutil.copytree(os.path.join(root, "a"), bad)
        shutil.rmtree(os.path.join(bad, "stage01-tp01"))
    edist.barrier()
    out = {}
    for what, groups, path in (("part", 1, bad), ("groups", 2, os.path.join(root, "a"))):
        booster, _, _, opt = _boost(1, 2, 3, groups)
        try:
            booster.load_optimizer(opt, path)
            out[what] = ""
        except CheckpointError as e:
            out[what] = str(e)
        edist.barrier()  # no rank is left behind in the load's collectives
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("mesh_ckpt"))
    jobs = {"chain": Job(_chain, (root,)), "gpt2": Job(_chain, (root, "gpt2", tuple(GPT2_CHAIN))),
            "refusals": Job(_refusals, (root,))}
    return root, run_jobs(4, jobs, timeout=400)


def _reference() -> tuple[list[float], dict, dict]:
    """Plain torch AdamW on the full batches: the losses, and the weights and state after SAVE_AT steps."""
    model = tiny_llama()
    opt = _adamw(model.parameters())
    losses, saved = [], ({}, {})
    names = {id(p): n for n, p in model.named_parameters()}
    for step, batch in enumerate(_batches()):
        loss = LOSS(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step + 1 == SAVE_AT:
            saved = ({n: p.detach().clone() for n, p in model.named_parameters()},
                     {names[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()})
    return losses, saved[0], saved[1]


@pytest.mark.dist
def test_optimizer_state_crosses_layouts_and_resumes(launched):
    from elixir.checkpoint import consolidate

    root, results = launched
    ref_losses, ref_weights, ref_state = _reference()
    for r in result(results, "chain"):
        assert r["uninterrupted"] == pytest.approx(ref_losses, rel=1e-5), (r["uninterrupted"], ref_losses)
        for name, layout, _ in CHAIN:  # each layout continues as the run that never stopped
            assert r[name] == pytest.approx(r["uninterrupted"][SAVE_AT:], rel=1e-5), (name, layout, r)
    saved = {name: consolidate(os.path.join(root, name)) for name in ("a", "b", "c", "d")}
    a = saved["a"]
    assert set(a["model"]) == set(ref_weights) and set(a["optimizer"]["state"]) == set(ref_state)
    for name in ("b", "c", "d"):  # loaded at another layout and saved again: the same values, bit for bit
        other = saved[name]
        assert set(other["model"]) == set(a["model"]), name
        for k, v in a["model"].items():
            assert torch.equal(other["model"][k], v), (name, k)
        for p, st in a["optimizer"]["state"].items():
            assert set(other["optimizer"]["state"][p]) == set(st), (name, p)
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(other["optimizer"]["state"][p][k]), torch.as_tensor(v)), (name, p, k)
    # save_model at TP2 x PP2 (each stage its own files, no rank gathering the model): the same masters
    with open(os.path.join(root, "model", "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    assert len(files) >= 2, files  # one file per stage at least
    hf = {k: v for name in files for k, v in load_file(os.path.join(root, "model", name)).items()}
    assert set(hf) == set(a["model"]), set(hf) ^ set(a["model"])
    for k, v in a["model"].items():
        assert torch.equal(hf[k], v), k
    # ... and the state is torch's own AdamW's, in the full logical shapes. (Not the masters, element
    # by element: AdamW's normalised step turns fp32 rounding in a near-zero gradient into a step of
    # up to lr, so they differ from torch's in a few elements, and so do the next step's gradients:
    # the state compared is the first step's. The losses above and the world-1 resume check them.)
    for p, st in ref_state.items():
        assert a["model"][p].shape == ref_weights[p].shape, p
        for k in ("exp_avg", "exp_avg_sq", "step"):
            got = torch.as_tensor(a["optimizer"]["state"][p][k])
            assert got.shape == st[k].shape, (p, k)
            torch.testing.assert_close(got.float(), st[k].float(), rtol=1e-4, atol=1e-4 * st[k].float().abs().max().item())


@pytest.mark.dist
def test_gpt2_fused_qkv_and_tied_weights_cross_layouts(launched):
    _, results = launched
    for r in result(results, "gpt2"):
        for name, layout, _ in GPT2_CHAIN:
            assert r[name] == pytest.approx(r["uninterrupted"][SAVE_AT:], rel=1e-5), (name, layout, r)


@pytest.mark.dist
def test_tp2_pp2_checkpoint_resumes_at_world_size_1(launched):
    """Done when 2: the TP2 x PP2 checkpoint, read by elixir.checkpoint.load into one process's
    ElixirModule, continues with the uninterrupted run's losses."""
    from elixir import checkpoint
    from elixir.search import minimum_waste_search
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    root, results = launched
    uninterrupted = result(results, "chain")[0]["uninterrupted"]
    model = tiny_llama()
    em = ElixirModule(model, minimum_waste_search(model, 1))
    eo = ElixirOptimizer(em, _adamw(em.parameters()))
    checkpoint.load(os.path.join(root, "a"), em, eo)
    losses = []
    for batch in _batches()[SAVE_AT:]:
        losses.append(ZOO["llama"].step_fn(em, batch).item())
        eo.step()
        eo.zero_grad()
    assert losses == pytest.approx(uninterrupted[SAVE_AT:], rel=1e-5), (losses, uninterrupted)


@pytest.mark.dist
def test_bad_mesh_checkpoints_fail_on_every_rank(launched):
    _, results = launched
    for r in result(results, "refusals"):
        assert "stage01-tp01" in r["part"] and "index.json" in r["part"], r
        assert "param groups" in r["groups"] and "build the optimizer with the param groups" in r["groups"], r


def test_mesh_checkpoints_refuse_a_replica_axis(tmp_path):
    """A replica axis (HSDP's dp_replicate) has no place in a mesh checkpoint: refused at save
    (the layout it would record) and at load (a mesh.json that records one), naming the fix."""
    from types import SimpleNamespace

    from elixir.checkpoint import CheckpointError
    from elixir.checkpoint.mesh import _layout
    from elixir.checkpoint.mesh_source import MESH, MESH_FORMAT, MESH_VERSION, read_meta
    from elixir.plan import MeshLayout

    def on(layout):
        return SimpleNamespace(mesh=SimpleNamespace(layout=layout))

    assert _layout(on(MeshLayout(dp_shard=2, tp=2))) == {"pp": 1, "dp_shard": 2, "tp": 2}
    with pytest.raises(CheckpointError, match="fold dp_replicate into dp_shard"):
        _layout(on(MeshLayout(dp_replicate=2, dp_shard=2)))
    meta = {"format": MESH_FORMAT, "version": MESH_VERSION, "layout": {"pp": 1, "dp_shard": 2, "tp": 1}, "parts": {}}
    for replicas in (1, 2):
        meta["layout"]["dp_replicate"] = replicas
        with open(tmp_path / MESH, "w") as f:
            json.dump(meta, f)
        if replicas == 1:
            assert read_meta(str(tmp_path))["layout"]["dp_shard"] == 2
        else:
            with pytest.raises(CheckpointError, match="replica axis .*dp_replicate folded into dp_shard"):
                read_meta(str(tmp_path))
