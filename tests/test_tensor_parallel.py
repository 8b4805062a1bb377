"""Tensor parallelism (issue 31, step 2): DTensor TP from torch's ``parallelize_module``, with
elixir's chunks as the data-parallel axis on a (dp_shard, tp) mesh.

- plans: a Hugging Face model's own ``tp_plan`` translated to torch's styles; elixir's plans for
  GPT-2 (Conv1D, fused qkv), OPT and BERT; a model with no plan refused naming how to pass one;
- at world 4, TP2 x DP2 matches a single-process full-batch reference on a LLaMA-style and a GPT-2
  (tied) model with ZeRO-3 chunks, ZeRO-1 chunks and host-placed optimizer state: losses within
  rtol 1e-5, final weights within 2x torch DDP's error in the same run, with global-norm clipping
  that clips (the norm summed over tp for Shard placements, replicated ones counted once); OPT
  (tied, vocab-parallel) and BERT (tied, embeddings whole) the same with ZeRO-3 chunks;
- sequence parallelism (``sequence_parallel=True``: the residual stream split over the sequence)
  and loss parallelism (``loss_parallel=True``: logits split over the vocabulary, the loss from
  :func:`elixir.parallel.vocab_parallel_lm_loss`) on LLaMA, TP2 x DP2 with ZeRO-3 chunks, in the
  same launch and held to the same bounds; a family without a sequence-parallel plan is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.parallel import (
    NoTensorParallelPlan,
    hf_plan,
    plan_for,
    qkv_from_tp_order,
    tensor_parallel,
    vocab_parallel_lm_loss,
)
from elixir.parallel.tensor import _reorder
from elixir.plan import MeshLayout, Sharding
from elixir.plan.tensor_plans import local_shapes, sequence_parallel_plan, style_plan
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import shard_batch
from elixir.testing.zoo import ZOO
from tests.mesh_cases import (
    cache_use,
    check_cache_use,
    ddp_reference,
    plugin_steps,
    sgd_reference,
    tiny_llama,
)

STEPS = 3
LR = 0.5
MAX_NORM = 0.3  # below the tiny models' gradient norms: clipping acts at every step
BATCH = 4


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return tiny_llama() if name == "llama" else ZOO[name].build()


def test_hf_plan_is_translated_to_torch_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = hf_plan(_build("llama"))
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["lm_head"], ColwiseParallel) and isinstance(plan["model.embed_tokens"], RowwiseParallel)
    tied = plan_for(tiny_llama(tie=True))  # tied: both sharded over the vocabulary, Shard(0)
    assert isinstance(tied["lm_head"], ColwiseParallel) and isinstance(tied["model.embed_tokens"], RowwiseParallel)
    for name in ("gpt2", "opt", "bert"):
        assert plan_for(_build(name)), name


def test_model_without_a_plan_is_refused_naming_how_to_pass_one():
    with pytest.raises(NoTensorParallelPlan, match=r"no tensor-parallel plan for Sequential.*plan=\{'layers\.\*\.fc1': ColwiseParallel\(\)"):
        plan_for(nn.Sequential(nn.Linear(4, 4)))


def test_qkv_reorder_round_trips():
    t = torch.arange(2 * 12.0).reshape(2, 12)  # [in, 3E], E = 4, tp = 2
    there = _reorder(t, 2, to_tp=True)
    assert there[0].tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]  # q0 k0 v0 | q1 k1 v1
    assert torch.equal(qkv_from_tp_order(there, 2), t)


def test_searches_plan_tp_but_refuse_pipeline_axes():
    model = _build("gpt2")
    sr = minimum_waste_search(model, MeshLayout(dp_shard=2, tp=2))
    assert sr.layout == MeshLayout(dp_shard=2, tp=2) and sr.world_size == 2
    with pytest.raises(NotImplementedError, match="Plan each pipeline stage's module on its own sub-mesh"):
        minimum_waste_search(model, MeshLayout(pp=2, dp_shard=2))


# ------------------------------------------------------------------------------------------------
# world 4: TP2 x DP2 against the one-process reference and torch DDP


def _batches(name: str) -> list[dict]:
    return [ZOO[name].make_batch(BATCH, step) for step in range(STEPS)]


def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return sgd_reference(_build(name), _batches(name), ZOO[name].loss, LR, MAX_NORM)


def _ddp(name: str, dp_group, dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    return ddp_reference(_build(name), _batches(name), ZOO[name].loss, LR, MAX_NORM, dp_group, dp_rank, dp)


def _options(variant: str) -> tuple[str, bool, bool]:
    """``"zero3+sp+lp"`` -> (chunk variant, sequence parallel, loss parallel)."""
    base, *flags = variant.split("+")
    return base, "sp" in flags, "lp" in flags


def _vocab_parallel_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return vocab_parallel_lm_loss(model(input_ids=batch["input_ids"]).logits, batch["input_ids"])


def _plan(model: nn.Module, layout: MeshLayout, variant: str):
    sr = minimum_waste_search(model, layout, cpu_offload=variant == "host_optim")
    if variant == "zero1":
        sr = dataclasses.replace(sr, chunks=tuple(c.with_sharding(Sharding.ZERO1, sr.world_size) for c in sr.chunks))
    return sr


def _elixir_tp(name: str, mesh, variant: str) -> tuple[list[float], dict[str, torch.Tensor], list]:
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    dp, tp = mesh["dp_shard"].size(), mesh["tp"].size()
    dp_rank = mesh.get_local_rank("dp_shard")
    variant, sp, lp = _options(variant)
    plain = _build(name)
    styles = sequence_parallel_plan(plain, lp) if sp else style_plan(plain)
    expected = local_shapes(tuple((n, tuple(q.shape)) for n, q in plain.named_parameters()), styles, tp)
    model = tensor_parallel(_build(name), mesh, sequence_parallel=sp, loss_parallel=lp)
    held = {n: tuple(getattr(q, "_local_tensor", q).shape) for n, q in model.named_parameters()}
    em = ElixirModule(model, _plan(model, MeshLayout(dp_shard=dp, tp=tp), variant), mesh=mesh)
    kinds = sorted({(c.spec.sharding.value, c.spec.master_on_host) for c in em.chunks})
    opt = ElixirOptimizer(em, torch.optim.SGD(em.parameters(), lr=LR), max_norm=MAX_NORM)
    losses = []
    for batch in _batches(name):
        loss = (_vocab_parallel_loss if lp else ZOO[name].loss)(em, shard_batch(batch, dp_rank, dp))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        edist.all_reduce(mean, mesh["dp_shard"].get_group())
        losses.append(mean.item() / dp)
    full = {}
    for k, v in em.state_dict().items():  # local TP shards, whole over dp
        w = em.tensor_parallel.full_tensor(k, v)
        full[k] = qkv_from_tp_order(w, tp) if k.endswith("attn.c_attn.weight") or k.endswith("attn.c_attn.bias") else w
    edist.barrier()
    return losses, full, (kinds, held == expected or {"held": held, "search's shapes": expected}, cache_use(em))


def _tp_worker(cases):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    dp_group, dp_rank = mesh["dp_shard"].get_group(), mesh.get_local_rank("dp_shard")
    out = {}
    for name, variants in cases:
        ref_losses, ref = _reference(name)
        ddp = _ddp(name, dp_group, dp_rank, 2)
        ddp_err = max((ddp[k] - ref[k]).abs().max().item() for k in ref)
        for variant in variants:
            losses, full, (kinds, shapes, cache) = _elixir_tp(name, mesh, variant)
            # loss parallelism sums the log-softmax over vocab shards in another order: allow one
            # fp32 ulp of each tensor's magnitude where DDP's own error is below that
            ulp = _options(variant)[2] * torch.finfo(torch.float32).eps
            errs = {k: max((full[k] - ref[k]).abs().max().item() - ulp * ref[k].abs().max().item(), 0.0) for k in ref}
            worst = max(errs, key=errs.get)
            out[(name, variant)] = {"ref": ref_losses, "losses": losses, "ddp_err": ddp_err,
                                    "err": errs[worst], "worst": worst, "kinds": kinds, "shapes": shapes, "cache": cache,
                                    "moved": max((full[k] - _build(name).state_dict()[k]).abs().max().item() for k in ref)}
        if name == "llama":
            out["plugin_sp"] = _plugin_sp(ref_losses, ref, ddp_err)
    return out


def _plugin_sp(ref_losses: list[float], ref: dict[str, torch.Tensor], ddp_err: float) -> dict:
    """HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=True) on 4 ranks (dp 2): its
    losses, and on rank 0 the worst weight error of its full state dict against the reference."""
    from elixir.booster import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=3, precision="fp32", max_norm=MAX_NORM,
                                  enable_sequence_parallelism=True)
    booster = Booster(plugin=plugin)
    model = _build("llama")
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR))
    losses = plugin_steps(booster, plugin, model, opt, _batches("llama"), ZOO["llama"].loss)
    full = plugin.full_state_dict(model)
    err = max(((full[k] - ref[k]).abs().max().item() for k in ref), default=None) if full else None
    return {"ref": ref_losses, "losses": losses, "ddp_err": ddp_err, "err": err, "sp": plugin.sequence_parallel}


def _check(results, cases):
    for r in results:
        for name, variants in cases:
            for variant in variants:
                res = r[(name, variant)]
                assert res["moved"] > 1e-3, res  # the weights trained
                assert res["losses"] == pytest.approx(res["ref"], rel=1e-5), (name, variant, res)
                assert res["err"] <= 2 * res["ddp_err"], (name, variant, res)
                assert res["kinds"], res
                assert res["shapes"] is True, (name, res["shapes"])  # plan/tensor_plans.local_shapes, as the search sees them
                check_cache_use(res["cache"], (name, variant))


_TP_CASES = [("llama", ("zero3", "zero1", "host_optim")), ("gpt2", ("zero3", "zero1", "host_optim")),
             ("opt", ("zero3",)), ("bert", ("zero3",))]
_SP_CASES = [("llama", ("zero3+sp", "zero3+sp+lp", "zero3+lp"))]


@pytest.fixture(scope="module")
def tp_results():
    """Every TP2 x DP2 case in one launch of 4 ranks (starting the ranks costs more than a case)."""
    cases = [(name, _TP_CASES[0][1] + _SP_CASES[0][1] if name == "llama" else v) for name, v in _TP_CASES]
    return run_distributed(_tp_worker, 4, cases, timeout=400)


@pytest.mark.dist
def test_tp2_dp2_matches_reference_llama_gpt2_opt_bert(tp_results):
    _check(tp_results, _TP_CASES)
    kinds = tp_results[0][("gpt2", "zero1")]["kinds"]
    assert any(k[0] == "zero1" for k in kinds), kinds
    assert all(k[1] for k in tp_results[0][("llama", "host_optim")]["kinds"])


@pytest.mark.dist
def test_sequence_and_loss_parallel_match_reference(tp_results):
    _check(tp_results, _SP_CASES)
    for r in tp_results:  # ... and through HybridParallelPlugin(enable_sequence_parallelism=True)
        res = r["plugin_sp"]
        assert res["sp"] and res["losses"] == pytest.approx(res["ref"], rel=1e-5), res
    res = tp_results[0]["plugin_sp"]
    assert res["err"] is not None and res["err"] <= 2 * res["ddp_err"], res


def test_sequence_parallel_refuses_a_family_without_a_plan():
    with pytest.raises(NoTensorParallelPlan, match=r"no sequence-parallel plan for GPT2LMHeadModel.*without sequence_parallel"):
        plan_for(_build("gpt2"), sequence_parallel=True)
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    plan = plan_for(_build("llama"), sequence_parallel=True, loss_parallel=True)
    assert isinstance(plan["model.layers.*.input_layernorm"], SequenceParallel)
    assert isinstance(plan["model.layers.*.self_attn"], PrepareModuleInput)
