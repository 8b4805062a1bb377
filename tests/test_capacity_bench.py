"""bench/capacity.py's elixir system (e) with low-precision optimizer state (issue 33): ``--master``
and ``--moments`` reach the MixedPrecisionPolicy it trains with, its state is kept at the widths
the footprint rule prices, its disk pre-check is that rule's bytes for the chosen formats, and the
search it plans with prices them (the plan records lossy ones)."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

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
        ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(1))
        run = []
        for _ in range(3):
            loss = em(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[formats] = run
        for master, st in opt.optim.state.items():
            assert master.dtype == master_torch_dtype(formats[0]), formats
            width = master.element_size() + st["exp_avg"].element_size() + st["exp_avg_sq"].element_size()
            assert width == disk_state_bytes(*formats), formats
    ref, low = losses[FORMATS[0]], losses[FORMATS[1]]
    assert low[0] == ref[0]
    assert low[-1] < low[0] and ref[-1] < ref[0]
