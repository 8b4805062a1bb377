"""Tracer behaviour: alias-aware accounting, gradients, untouched inputs, errors, registry, CLI."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from elixir import models
from elixir.testing.zoo import ZOO, build_model
from elixir.tracer import TracerError, cuda_memory_profiling, generate_tf_order, memory_profiling
from elixir.tracer.accounting import Bucket, StorageAccountant


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_views_inplace_and_frees_are_counted_once(device):
    acc = StorageAccountant()
    with acc:
        a = torch.empty(1000, device=device)  # 4000 bytes
        views = [a.view(10, 100), a.view(10, 100).t(), a[::2], a.as_strided((10,), (3,))]
        a.add_(1)
        a.mul_(2)
        assert acc.live[Bucket.ACTIVATION] == 4000
        b = a * 2
        assert acc.live[Bucket.ACTIVATION] == 8000
        del a
        assert acc.live[Bucket.ACTIVATION] == 8000  # views keep the storage alive
        del views
        assert acc.live[Bucket.ACTIVATION] == 4000
        c = torch.empty(10, device=device)
        c.resize_(100)
        assert acc.live[Bucket.ACTIVATION] == 4400
        del b, c
        assert acc.live[Bucket.ACTIVATION] == 0
    assert max(acc.t_act) == 8000


def test_static_storages_are_not_step_memory():
    w = torch.empty(100, 100, device="meta")
    acc = StorageAccountant()
    acc.add_static(w)
    with acc:
        wt = w.t()  # a view of a parameter allocates nothing
        y = wt.sum()
    assert max(acc.t_act) == y.untyped_storage().nbytes()


def test_grads_counted_once_frozen_excluded_tied_once():
    for name in ("frozen", "tied", "shared", "gpt2"):
        case = ZOO[name]
        model = build_model(name)
        prof = memory_profiling(model, case.make_batch(2, 0), case.step_fn)
        unique = list(model.parameters())  # deduplicated: a tied weight appears once
        assert prof.param_occ == sum(p.numel() * p.element_size() for p in unique), name
        trainable = sum(p.numel() * p.element_size() for p in unique if p.requires_grad)
        assert prof.grad_occ == trainable, name
        assert prof.timeline_grad[-1] == trainable  # all grads live at the end of backward
    # grads enter the timeline only in backward, as AccumulateGrad produces them
    assert all(g == 0 for g, ph in zip(prof.timeline_grad, prof.timeline_phase) if ph == "forward")


def test_dtype_is_applied_to_params_and_activations():
    case = ZOO["gpt2"]
    model = build_model("gpt2")
    batch = case.make_batch(2, 0)
    fp32 = memory_profiling(model, batch, case.step_fn, torch.float32)
    bf16 = memory_profiling(model, batch, case.step_fn, torch.bfloat16)
    assert bf16.param_occ * 2 == fp32.param_occ and bf16.grad_occ * 2 == fp32.grad_occ
    assert bf16.activation_occ < fp32.activation_occ


def test_user_model_and_inputs_are_untouched():
    case = ZOO["bert"]
    model = build_model("bert")
    model.train()
    batch = case.make_batch(2, 0)
    before = {k: (v.clone(), v.data_ptr(), v.dtype) for k, v in model.state_dict().items()}
    inputs = {k: v.clone() for k, v in batch.items()}
    hooks = (len(model._forward_hooks), len(model._forward_pre_hooks))
    memory_profiling(model, batch, case.step_fn, torch.bfloat16)
    generate_tf_order(model, batch, case.step_fn)
    for k, v in model.state_dict().items():
        val, ptr, dtype = before[k]
        assert v.data_ptr() == ptr and v.dtype == dtype and torch.equal(v, val), k
    assert all(p.grad is None for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight  # still tied
    assert (len(model._forward_hooks), len(model._forward_pre_hooks)) == hooks
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(batch[k], v) for k, v in inputs.items())


def test_cuda_memory_profiling_returns_the_reference_keys():
    case = ZOO["opt"]
    d = cuda_memory_profiling(build_model("opt"), case.make_batch(2, 0), case.step_fn)
    assert {"param_occ", "buffer_occ", "grad_occ", "activation_occ"} <= set(d)
    assert all(isinstance(d[k], int) and d[k] >= 0 for k in ("param_occ", "buffer_occ", "grad_occ", "activation_occ"))


def test_profile_reports_peak_temporary_and_renders(tmp_path):
    case = ZOO["convnet"]
    prof = memory_profiling(build_model("convnet"), case.make_batch(4, 0), case.step_fn)
    assert prof.timeline_activation[prof.peak.op_index] == prof.activation_occ
    assert prof.timeline_op[prof.peak.op_index] == prof.peak.op_name
    assert prof.timeline_phase[prof.peak.op_index] == prof.peak.phase
    lt = prof.largest_temporary
    assert lt is not None and 0 < lt.nbytes <= prof.activation_occ
    from rich.console import Console

    console = Console(record=True, width=120)
    prof.print(console)
    assert "activation_occ" in console.export_text()
    png = tmp_path / "p.png"
    prof.plot(str(png))
    assert png.stat().st_size > 1000
    js = tmp_path / "p.json"
    prof.to_json(str(js), timeline=True)
    d = json.loads(js.read_text())
    assert d["activation_occ"] == prof.activation_occ and len(d["timeline"]["activation"]) == prof.num_ops


class _External(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return F.linear(self.a(x), self.b.weight).sum()  # b's weight used outside b.forward


def test_external_params_are_reported():
    r = generate_tf_order(_External(), {"x": torch.randn(2, 8)}, lambda m, b: m(b["x"]).backward())
    assert r["external_params"] == ["b.weight"]
    assert r["params_per_step"] == [("a.weight", "a.bias"), ("a.weight", "a.bias")]


# ------------------------------------------------------------------------------------------------
# errors


def _step(m, b):
    loss = m(b["x"]).sum()
    loss.backward()
    return loss


def test_bad_inputs_get_clear_errors():
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(TracerError, match="dict"):
        memory_profiling(model, x, _step)
    with pytest.raises(TracerError, match="not tensors.*'y'"):
        memory_profiling(model, {"x": x, "y": 3}, _step)
    with pytest.raises(TracerError, match="never called backward"):
        memory_profiling(model, {"x": x}, lambda m, b: m(b["x"]).sum())
    with pytest.raises(TracerError, match="floating"):
        memory_profiling(model, {"x": x}, _step, dtype=torch.int64)
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    with pytest.raises(TracerError, match="different devices"):
        memory_profiling(mixed, {"x": x}, _step)


def test_data_dependent_python_is_named():
    def step(m, b):
        loss = m(b["x"]).sum()
        if loss.item() > 0:
            pass
        loss.backward()

    with pytest.raises(TracerError, match=r"\.item\(\)"):
        memory_profiling(nn.Linear(4, 4), {"x": torch.randn(2, 4)}, step)


_LIB = torch.library.Library("elixir_tracer_test", "DEF")  # noqa: TOR901
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.impl("twice", lambda x: torch.cat([x, x]), "CPU")


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.ops.elixir_tracer_test.twice(self.lin(x).detach()).sum() + self.lin(x).sum()


def test_missing_meta_kernel_is_named_then_registered():
    from elixir.tracer.meta_kernels import register_meta_kernel

    batch = {"x": torch.randn(3, 4)}
    with pytest.raises(TracerError, match="elixir_tracer_test.twice.*no meta kernel.*register_meta_kernel"):
        memory_profiling(_Twice(), batch, _step_sum)
    register_meta_kernel("elixir_tracer_test::twice", lambda x: x.new_empty((2 * x.shape[0], *x.shape[1:])))
    pm = memory_profiling(_Twice(), batch, _step_sum)
    pr = memory_profiling(_Twice(), batch, _step_sum, target="real")
    assert pm.activation_occ == pr.activation_occ


def _step_sum(m, b):
    m(b["x"]).backward()


# ------------------------------------------------------------------------------------------------
# registry and CLI


def test_registry_opt_175b_shape_and_param_count():
    cfg = models.load_config("opt-175b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.ffn_dim, cfg.vocab_size) == (
        12288, 96, 96, 49152, 50272)
    m = models.build_model("opt-175b")
    h, f, L, V = 12288, 49152, 96, 50272
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    expected = V * h + (2048 + 2) * h + L * layer + 2 * h
    assert sum(p.numel() for p in m.parameters()) == expected
    assert all(p.device.type == "meta" for p in m.parameters())


def test_registry_names_and_config_json(tmp_path):
    assert {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "opt-125m", "opt-175b", "llama-7b", "llama-13b",
            "llama-70b", "bert-base", "bert-large"} <= set(models.model_names())
    assert models.load_config("llama-70b").num_key_value_heads == 8
    path = tmp_path / "config.json"
    path.write_text(models.load_config("bert-base", num_hidden_layers=2).to_json_string())
    a = models.build_model(str(path))
    assert type(a).__name__ == "BertForMaskedLM" and a.config.num_hidden_layers == 2
    with pytest.raises(KeyError, match="unknown model"):
        models.load_config("no-such-model")


def test_cli_profile_prints_and_writes_json(tmp_path, capsys):
    from elixir.cli import main

    out = tmp_path / "p.json"
    rc = main(["profile", "gpt2", "--batch", "1", "--seq", "64", "--dtype", "bf16", "--checkpointing",
               "--json", str(out)])
    assert rc == 0
    assert "activation_occ" in capsys.readouterr().out
    d = json.loads(out.read_text())
    m = models.enable_checkpointing(models.build_model("gpt2"))
    ref = memory_profiling(m, models.make_batch(m, 1, 64), models.lm_step_fn, torch.bfloat16)
    assert d["activation_occ"] == ref.activation_occ and d["param_occ"] == ref.param_occ
    assert len(d["checkpoint_regions"]) == 12


class _Ctc(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x, t):
        return F.ctc_loss(self.lin(x).log_softmax(2), t, [5, 5], [3, 3])


def test_registered_meta_kernel_for_ctc_backward_matches_real():
    """torch ships no Meta kernel for CTC loss backward; elixir registers one."""
    batch = {"x": torch.randn(5, 2, 4), "t": torch.randint(1, 6, (2, 3))}

    def step(m, b):
        m(b["x"], b["t"]).backward()

    pm = memory_profiling(_Ctc(), batch, step)
    pr = memory_profiling(_Ctc(), batch, step, target="real")
    assert pm.phase_peaks == pr.phase_peaks


def test_meta_op_cache_changes_nothing_but_speed():
    from elixir.tracer.run import trace_step

    case = ZOO["llama"]
    model = models.enable_checkpointing(build_model("llama"))
    batch = case.make_batch(2, 0)
    a = trace_step(model, batch, case.step_fn, op_cache=True)
    b = trace_step(model, batch, case.step_fn, op_cache=False)
    assert a.acc.cache.hits > 0
    assert (a.acc.t_act, a.acc.t_grad, a.acc.t_phase) == (b.acc.t_act, b.acc.t_grad, b.acc.t_phase)
    assert [str(n) for n in a.acc.t_name] == [str(n) for n in b.acc.t_name]
    assert a.steps == b.steps


def test_real_model_is_traced_on_meta_twins_without_copying_weights():
    case = ZOO["tied"]
    model = build_model("tied")
    batch = case.make_batch(2, 0)
    seen = {}

    def step(m, b):
        seen["params"] = {p.device.type for p in m.parameters()}
        seen["inputs"] = {v.device.type for v in b.values()}
        seen["tied"] = m.head.weight is m.embed.weight
        seen["distinct"] = m is not model and m.embed.weight is not model.embed.weight
        return case.step_fn(m, b)

    memory_profiling(model, batch, step)
    assert seen == {"params": {"meta"}, "inputs": {"meta"}, "tied": True, "distinct": True}


@pytest.mark.slow
def test_opt_175b_profiles_on_this_box():
    """Scale smoke (not timed; bench/tracer.py measures): OPT-175B, batch 1, seq 2048, bf16."""
    m = models.build_model("opt-175b")
    numel = sum(p.numel() for p in m.parameters())
    batch = models.make_batch(m, 1, 2048)
    plain = memory_profiling(m, batch, models.lm_step_fn, torch.bfloat16)
    ck = memory_profiling(models.enable_checkpointing(m), batch, models.lm_step_fn, torch.bfloat16)
    assert plain.param_occ == ck.param_occ == 2 * numel == plain.grad_occ
    assert len(ck.checkpoint_regions) == 96 and ck.activation_occ < plain.activation_occ / 4
