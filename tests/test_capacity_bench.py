"""bench/capacity.py's elixir systems with low-precision formats (issue 33). (e): ``--master`` and
``--moments`` reach the MixedPrecisionPolicy it trains with, its state is kept at the widths the
footprint rule prices, its disk pre-check is that rule's bytes for the chosen formats, and the
search it plans with prices them (the plan records lossy ones). (h), LoRA: ``--frozen`` stores the
frozen base quantised, through the policy and the search as a user asks for it, and its disk
pre-check is the frozen format's rule."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from tests.lm_cases import lm_steps

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
FORMATS = [("fp32", "fp32"), ("bf16-sr", "int8"), ("bf16-kahan", "bf16")]


def _bench():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)  # capacity.py imports bench/rss_cap.py
    spec = importlib.util.spec_from_file_location("capacity", os.path.join(BENCH, "capacity.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_disk_precheck_is_the_footprint_rule():
    from elixir.plan import disk_bytes_per_element

    cap = _bench()
    rung, vocab = cap.LADDER[12], 32000
    params = cap.n_params(*rung, vocab)
    for formats in FORMATS:
        rule = disk_bytes_per_element(formats=formats)
        assert cap._disk_need(rung, vocab, "e", formats) == rule * params, formats
        assert f"{rule} B/param" in cap._formats_label(formats)
    assert cap._disk_need(rung, vocab, "e", ("bf16-sr", "int8")) < cap._disk_need(rung, vocab, "e")


def _three_steps(em, opt) -> list[float]:
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    return lm_steps(em, opt, [ids] * 3)


def test_elixir_trains_in_the_asked_formats(tmp_path):
    """Both formats in one process, the fp32 run the reference: the same first loss (same weights,
    nothing stepped yet), falling losses, and state tensors as wide as the rule says."""
    from elixir.plan.state_format import disk_state_bytes, master_torch_dtype

    cap = _bench()
    losses = {}
    for formats in FORMATS[:2]:
        torch.manual_seed(0)
        em, opt = cap._build("e", cap.llama_config(64, 1, 512), str(tmp_path), 8 << 30, formats)
        assert (em.mp_policy.master, em.mp_policy.moments) == formats
        # the search priced the formats (its disk budget is the free disk itself) and the plan records lossy ones
        recorded = (em.plan.master_format, em.plan.moments_format)
        assert recorded == (formats if formats != ("fp32", "fp32") else (None, None)), recorded
        losses[formats] = _three_steps(em, opt)
        for master, st in opt.optim.state.items():
            assert master.dtype == master_torch_dtype(formats[0]), formats
            width = master.element_size() + st["exp_avg"].element_size() + st["exp_avg_sq"].element_size()
            assert width == disk_state_bytes(*formats), formats
    ref, low = losses[FORMATS[0]], losses[FORMATS[1]]
    assert low[0] == ref[0]
    assert low[-1] < low[0] and ref[-1] < ref[0]


def test_lora_disk_precheck_is_the_frozen_format_rule():
    """(h)'s pre-check scales with the library's bytes per frozen element: a quantised base needs
    that rule's fraction of the bf16 base's offload space (the padding bound is the same)."""
    from elixir.plan.state_format import FROZEN_FORMATS, frozen_element_bytes

    cap = _bench()
    rung, vocab = cap.LADDER[-1], 32000
    bf16 = cap._disk_need(rung, vocab, "h")
    for frozen in FROZEN_FORMATS:
        need = cap._disk_need(rung, vocab, "h", frozen=frozen)
        assert abs(need / bf16 - frozen_element_bytes(frozen, 2) / 2) < 1e-9, frozen


def test_lora_elixir_stores_the_asked_frozen_format(tmp_path):
    """(h) with a bf16 base (the reference) and an NF4 one in one process: the NF4 plan records
    the format, the runtime's frozen bytes are the library's rule for NF4 (and what the bench
    prints), under the bf16 base's, the weights the step computes with differ from the bf16
    ones (the first loss), and both runs' losses fall."""
    from elixir.plan.state_format import frozen_shard_bytes

    cap = _bench()
    runs = {}
    for frozen in (None, "nf4"):
        torch.manual_seed(0)
        em, opt = cap._build("h", cap.llama_config(64, 1, 512), str(tmp_path), 8 << 30, frozen=frozen, shape=(1, 16))
        assert em.plan.frozen_format == frozen and em.mp_policy.frozen == frozen
        ledger = em.ledger.bytes("frozen_shard")
        rule = sum(frozen_shard_bytes(frozen, c.shard_size(1), 2) for c in em.plan.frozen_chunks)
        assert ledger == rule == cap._lora_plan_figures(em.plan, frozen)["frozen_bytes"], frozen
        runs[frozen] = ledger, _three_steps(em, opt)
    (ref_bytes, ref), (nf4_bytes, nf4) = runs[None], runs["nf4"]
    assert nf4_bytes < ref_bytes
    assert nf4[0] != ref[0]
    assert ref[-1] < ref[0] and nf4[-1] < nf4[0]
