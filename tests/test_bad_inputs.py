"""Bad inputs from the catalogue of issue 18 (docs/reliability.md) that had no test or no clear
error: each gets an error (or, where the input is legal but useless, a warning) that names the fix.
World size 1, the tiny GPT-2 of the zoo: seconds in all."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from elixir import distributed as edist
from elixir.optim.loss_scaler import LossScalePolicy
from elixir.search import minimum_waste_search
from elixir.testing.reference import default_optimizer
from elixir.testing.zoo import ZOO
from elixir.wrapper import ElixirModule, ElixirOptimizer
from elixir.wrapper.plan_check import PlanMismatch

ZC = ZOO["gpt2"]


def _wrapped(**kw):
    torch.manual_seed(0)
    model = ZC.build()
    return ElixirModule(model, minimum_waste_search(model, 1), **kw)


def _train(em, eo, steps: int = 2) -> dict:
    for s in range(steps):
        eo.zero_grad()
        ZC.loss(em, ZC.make_batch(4, s)).backward()
        eo.step()
    return {k: v.clone() for k, v in em.state_dict().items()}


def test_plan_from_another_model_or_world_size():
    torch.manual_seed(0)
    gpt2, opt = ZC.build(), ZOO["opt"].build()
    with pytest.raises(PlanMismatch, match="does not match this model.*trainable parameters not in the plan"):
        ElixirModule(opt, minimum_waste_search(ZC.build(), 1))
    with pytest.raises(PlanMismatch, match=r"made for a mesh of dp_shard 2 \(2 ranks\) but this run is a single rank; re-run the search for this layout \(optimal_search\(model, 1"):
        ElixirModule(gpt2, minimum_waste_search(gpt2, 2))


def test_optimizer_over_other_parameters_is_refused():
    em = _wrapped()
    with pytest.raises(ValueError, match="does not manage; build the optimizer on the wrapped model's parameters"):
        ElixirOptimizer(em, default_optimizer(torch.nn.Linear(3, 3).parameters()))


def test_second_optimizer_on_one_module_takes_over():
    """Before: both optimizers kept their hooks, so with the fused backward-and-step every chunk was
    stepped twice per backward; now the newest takes over and the old one refuses to step."""
    em = _wrapped()
    old = ElixirOptimizer(em, default_optimizer(list(em.parameters())), fused_step=True)
    eo = ElixirOptimizer(em, default_optimizer(list(em.parameters())), fused_step=True)
    got = _train(em, eo)
    ref_em = _wrapped()
    want = _train(ref_em, ElixirOptimizer(ref_em, default_optimizer(list(ref_em.parameters())), fused_step=True))
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(RuntimeError, match="replaced by a newer one built on the same ElixirModule"):
        old.step()


def test_prefetch_with_a_plan_without_order_learns_it():
    """Before: a warning, and nothing was ever prefetched. Now the runtime follows the order the
    first training iteration took (tests/test_prefetch_front_ends.py checks the gathers ahead)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        em = _wrapped(prefetch=True)
    assert em.schedule is None and em.plan.param_order is None


@pytest.mark.parametrize("change", ["replaced", "added"])
def test_model_changed_after_wrapping_is_refused(change):
    """Before: a replaced parameter was silently never stepped (and an added one never trained)."""
    em = _wrapped()
    eo = ElixirOptimizer(em, default_optimizer(list(em.parameters())))
    _train(em, eo, 1)
    fc = em.module.transformer.h[0].mlp.c_fc
    if change == "replaced":
        fc.weight = torch.nn.Parameter(fc.weight.detach().clone())
        name = "transformer.h.0.mlp.c_fc.weight"
    else:
        fc.extra = torch.nn.Linear(2, 2)
        name = "transformer.h.0.mlp.c_fc.extra.weight"
    with pytest.raises(RuntimeError, match=f"parameters changed after it was wrapped.*{name}.*before wrapping"):
        ZC.loss(em, ZC.make_batch(4, 1))


def test_input_on_the_wrong_device_is_refused():
    em = _wrapped()
    batch = {k: v.to("meta") for k, v in ZC.make_batch(4, 0).items()}
    with pytest.raises(ValueError, match=r"is on meta, but the model computes on cpu: move the batch there first"):
        ZC.loss(em, batch)


def test_no_sync_nested_is_the_same_as_once():
    """Nesting ``no_sync`` is allowed (the inner block is a no-op): no collective inside, and the
    accumulated step equals the one accumulated under a single ``no_sync``."""

    def run(nested: bool) -> dict:
        em = _wrapped()
        eo = ElixirOptimizer(em, default_optimizer(list(em.parameters())))
        eo.zero_grad()
        with edist.count_collectives() as counted, em.no_sync():
            if nested:
                with em.no_sync():
                    ZC.loss(em, ZC.make_batch(4, 0)).backward()
            else:
                ZC.loss(em, ZC.make_batch(4, 0)).backward()
        assert sum(counted.values()) == sum(1 for c in em.chunks if c.spec.sharded)  # the entry gathers only
        ZC.loss(em, ZC.make_batch(4, 1)).backward()
        eo.step()
        return em.state_dict()

    once, nested = run(False), run(True)
    assert all(torch.equal(once[k], nested[k]) for k in once)


def test_fp16_overflow_on_every_step_is_reported():
    """Before: every step was skipped (the scale backing off to its floor) and training looped on
    without a word; now the N-th skipped step in a row raises, naming the fixes."""
    em = _wrapped(dtype=torch.float16)
    eo = ElixirOptimizer(em, default_optimizer(list(em.parameters())), loss_scale_policy=LossScalePolicy(max_skipped_steps=3))
    for s in range(2):
        eo.zero_grad()
        (ZC.loss(em, ZC.make_batch(4, s)) * math.inf).backward()
        eo.step()
        assert eo.last_step_skipped
    eo.zero_grad()
    (ZC.loss(em, ZC.make_batch(4, 2)) * math.inf).backward()
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row were skipped.*compute in bf16.*max_skipped_steps"):
        eo.step()
    with pytest.raises(ValueError, match="max_skipped_steps"):
        LossScalePolicy(max_skipped_steps=-1)


def test_zero_or_negative_learning_rate():
    em = _wrapped()
    with pytest.warns(UserWarning, match="every param group has lr=0, so no parameter will change"):
        ElixirOptimizer(em, torch.optim.SGD(list(em.parameters()), lr=0.0))
    eo = ElixirOptimizer(em, default_optimizer(list(em.parameters())))
    eo.optim.param_groups[0]["lr"] = -1e-3  # as a bad LR schedule would set it
    eo.zero_grad()
    ZC.loss(em, ZC.make_batch(4, 0)).backward()
    with pytest.raises(ValueError, match="param group 0 has learning rate -0.001: it must be >= 0"):
        eo.step()
    em = _wrapped()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a positive lr: no warning
        ElixirOptimizer(em, default_optimizer(list(em.parameters())))


@pytest.mark.parametrize("argv,text", [
    (["profile", "no-such-model"], "unknown model 'no-such-model'."),
    (["plan", "no-such-model", "--world-size", "2", "--hardware", "cpu-box"], "unknown model 'no-such-model'"),
    (["plan", "gpt2", "--world-size", "2", "--hardware", "/no/such/profile.json"], "no hardware profile '/no/such/profile.json'"),
    (["checkpoint", "verify", "/no/such/checkpoint"], "no checkpoint at /no/such/checkpoint"),
])
def test_cli_given_a_missing_file_or_an_unknown_model(argv, text, capsys):
    """Before: a KeyError traceback for an unknown model or a missing hardware profile."""
    from elixir.cli import main

    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0 and text in err and "Traceback" not in err, err


def test_load_state_dict_assign_is_refused_not_ignored():
    """Before: assign=True was silently ignored. The parameters are views of elixir's chunks, so the
    state dict's tensors cannot become them: refused, naming assign=False (which copies the values)."""
    em = _wrapped()
    sd = em.state_dict()
    with pytest.raises(ValueError, match=r"assign=True\) is not supported.*Use assign=False"):
        em.load_state_dict(sd, assign=True)
    em.load_state_dict(sd, assign=False)
