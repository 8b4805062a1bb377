"""The search prices the optimizer state's formats (issue 33 item 4).

- a budget the fp32 state does not fit but a leaner format does is refused unless the policy
  allows lossy state (``allow_lossy_state``); allowed, the search takes the least lossy format
  that fits, and the plan records it (and the runtime runs it without being told);
- a low-precision plan's predicted peak holds what the runtime has live at once (its ledger, the
  optimizer state and the traced activations) within the tolerance of the disk plans' test
  (``tests/test_disk_plan_memory.py``: at least it, at most 10% above);
- with the default formats the plan is the one made without them.

The budgets come from the search's own refusals (the least memory each format needs), not from
figures written here.
"""

from __future__ import annotations

import pytest
import torch

from elixir.hardware import load_profile
from elixir.optim import CPUAdam
from elixir.plan.budgets import DoesNotFitError
from elixir.search import optimal_search
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer, MixedPrecisionPolicy
from tests.ledger_cases import live_peak

MODEL = "llama"
BATCH = 4


def _search(budget: int, **kw):
    """The plan of the zoo's tiny LLaMA in bf16 at world size 1 for ``budget`` bytes of the CPU
    box's one memory pool, no disk, and only elixir's own bytes (no process term)."""
    case = ZOO[MODEL]
    return optimal_search(build_model(MODEL), 1, torch.bfloat16, hardware=load_profile("cpu-box"), host_memory=budget,
                          device_memory=budget, inp=case.make_batch(BATCH, 0), step_fn=case.step_fn, process_bytes=0,
                          **kw)


def _least(master: str, moments: str) -> int:
    """The least budget a plan in these formats fits (the search's refusal says it)."""
    with pytest.raises(DoesNotFitError) as e:
        _search(1 << 16, master=master, moments=moments)
    return e.value.needs["memory"]


@pytest.fixture(scope="module")
def least() -> dict[tuple[str, str], int]:
    return {f: _least(*f) for f in (("fp32", "fp32"), ("fp32", "int8"), ("bf16-sr", "int8"))}


@pytest.mark.parametrize("leaner", [("fp32", "int8"), ("bf16-sr", "int8")])
def test_lossy_state_only_where_the_policy_allows_it(least, leaner):
    """Between what ``leaner`` needs and what the next richer format needs, only ``leaner`` fits:
    refused as asked (fp32), taken with ``allow_lossy_state``, and recorded."""
    richer = ("fp32", "fp32") if leaner == ("fp32", "int8") else ("fp32", "int8")
    assert least[("bf16-sr", "int8")] < least[("fp32", "int8")] < least[("fp32", "fp32")], least
    budget = (least[leaner] + least[richer]) // 2
    with pytest.raises(DoesNotFitError):
        _search(budget)
    with pytest.raises(DoesNotFitError):
        _search(budget, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    plan = _search(budget, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, allow_lossy_state=True))
    assert (plan.master_format, plan.moments_format) == leaner
    assert plan.info["state_formats"]["why"].startswith("allow_lossy_state: fp32/fp32 does not fit")
    assert plan.to_json()["master_format"] == leaner[0] and plan.to_json()["moments_format"] == leaner[1]
    # what fits as asked stays as asked, recorded (the search was allowed to change it)
    roomy = _search(least[("fp32", "fp32")] * 2, allow_lossy_state=True)
    assert (roomy.master_format, roomy.moments_format) == ("fp32", "fp32")


def test_default_formats_plan_as_without_them(least):
    """fp32 state asked for (loose, or by a default policy) is the plan made without formats:
    the same JSON but the search's own time, no formats recorded."""
    budget = least[("fp32", "fp32")] * 2
    plain = _search(budget).to_json()
    plain["info"].pop("search_time_s")
    for kw in (dict(master="fp32", moments="fp32"), dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))):
        again = _search(budget, **kw).to_json()
        again["info"].pop("search_time_s")
        assert again == plain, kw
    assert "master_format" not in plain and "state_formats" not in plain["info"]


def _run(budget: int, formats: tuple[str, str]) -> tuple[int, int]:
    """(predicted peak, live peak) of the plan in ``formats`` (fused step, bf16 gradients, world
    size 1): the prediction's device and host bytes (one pool), and what the runtime had live at
    once over two steps (:func:`tests.ledger_cases.live_peak`, the optimizer state included)."""
    from elixir.search.step_profile import profile_step

    case = ZOO[MODEL]
    plan = _search(budget, master=formats[0], moments=formats[1], fused_step=True, grad_dtype=torch.bfloat16)
    em = ElixirModule(build_model(MODEL), plan, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert em.state_formats == formats
    eo = ElixirOptimizer(em, CPUAdam(list(em.parameters()), lr=1e-3))

    def step(i: int) -> None:
        eo.zero_grad()
        case.loss(em, case.make_batch(BATCH, i)).backward()
        eo.step()

    acts = profile_step(build_model(MODEL), case.make_batch(BATCH, 0), case.step_fn, torch.bfloat16).step_activations
    live = live_peak(em, step, acts, resident_state=True)
    return plan.prediction.peak_device_bytes + plan.prediction.peak_host_bytes, live


@pytest.fixture(scope="module")
def fp32_run(least) -> tuple[int, int]:
    return _run(least[("fp32", "fp32")] * 2, ("fp32", "fp32"))


@pytest.mark.parametrize("formats", [("bf16-sr", "int8"), ("bf16-kahan", "bf16")])
def test_predicted_peak_holds_the_runtime_in_each_format(least, fp32_run, formats):
    """A low-precision plan's predicted peak covers what the runtime had live at once, and is
    above it by what the fp32 plan's is (the control, same model and budget): the formats' bytes
    are priced as the runtime holds them, to the int8 block scales' rounding (blocks per
    parameter in the runtime, per chunk in the footprint rule: a few bytes per parameter).

    Neither is within 10% of the live peak at this shape (world size 1, every chunk resident):
    the prediction counts a gradient buffer and a gradient in flight at the activation peak that
    the runtime's ledger does not hold then, the same bytes in every format."""
    predicted, live = _run(least[("fp32", "fp32")] * 2, formats)
    fp32_predicted, fp32_live = fp32_run
    assert live <= predicted and fp32_live <= fp32_predicted, (live, predicted, fp32_run)
    slack = 8 * (len(list(build_model(MODEL).parameters())) + 1)  # int8 scales: one more block per tensor at most
    assert abs((predicted - live) - (fp32_predicted - fp32_live)) <= slack, (formats, predicted, live, fp32_run)
    assert predicted < fp32_predicted and live < fp32_live  # fewer bytes, as priced


def test_elixir_plan_takes_the_formats_and_reports_them(tmp_path, capsys):
    """``elixir plan --master/--moments`` price and record the formats, and the report names them
    for the trainable chunks (with --tp/--pp: tests/test_mesh_formats.py)."""
    import json

    from elixir import cli
    from tests.search_cases import tiny_gpt2_config

    out_plan = tmp_path / "plan.json"
    args = ["plan", tiny_gpt2_config(tmp_path), "--seq", "16", "--world-size", "1", "--hardware", "cpu-box"]
    assert cli.main([*args, "--master", "bf16-sr", "--moments", "int8", "--out", str(out_plan)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "master bf16-sr, moments int8 (4.03" in out, out  # the table may wrap the rest
    saved = json.loads(out_plan.read_text())
    assert (saved["master_format"], saved["moments_format"]) == ("bf16-sr", "int8")


def test_front_ends_search_in_their_formats():
    """An integration's (and GeminiPlugin's) ``search="optimal"`` prices and records the formats it
    trains with."""
    from elixir.integrations.options import ElixirOptions

    opts = ElixirOptions(search="optimal", master="bf16-sr", moments="int8")
    plan = opts.make_plan(build_model(MODEL), 1, torch.bfloat16, main=False)
    assert (plan.master_format, plan.moments_format) == ("bf16-sr", "int8")
