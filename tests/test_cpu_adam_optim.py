"""CPUAdam / HybridAdam as torch optimizers (training, state_dict both ways, errors), the
ELIXIR_SIMD switch, and the pure-torch fallback with the extension hidden."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from elixir.optim import CPUAdam, HybridAdam
from elixir.optim import functional as F

HERE = Path(__file__).resolve().parent
needs_kernel = pytest.mark.skipif(not F.kernel_available(), reason="native extension not built")


def mlp(dims: tuple[int, ...], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, model[0].in_features, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


ALIGNED = (32, 48, 16)  # every parameter a multiple of 16 elements: no torch scalar tail anywhere


@needs_kernel
@pytest.mark.parametrize("adamw", [True, False])
def test_training_matches_torch_fused_bitwise(adamw):
    a, b = mlp(ALIGNED), mlp(ALIGNED)
    ours = CPUAdam(a.parameters(), lr=1e-2, weight_decay=0.05, adamw_mode=adamw)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)(b.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    train(a, ours, 30)
    train(b, ref, 30)
    assert params_equal(a, b)


def test_training_with_tails_matches_torch_default():
    """Odd sizes, torch's default (for-loop) AdamW and Adam: 1e-6 relative after 30 steps."""
    for adamw, default_wd in ((True, 1e-2), (False, 0.0)):
        a, b = mlp((33, 17, 5)), mlp((33, 17, 5))
        ours = CPUAdam(a.parameters(), lr=1e-2, adamw_mode=adamw)
        assert ours.param_groups[0]["weight_decay"] == default_wd  # torch's default for the mode
        ref = (torch.optim.AdamW if adamw else torch.optim.Adam)(b.parameters(), lr=1e-2)
        train(a, ours, 30)
        train(b, ref, 30)
        for x, y in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("adamw", [True, False])
def test_state_dict_round_trips_with_torch(adamw):
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    kw = dict(lr=1e-2, weight_decay=0.05)
    a = mlp(ALIGNED)
    ours = CPUAdam(a.parameters(), adamw_mode=adamw, **kw)
    train(a, ours, 5)
    sd = ours.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and float(sd["state"][0]["step"]) == 5

    # ours -> torch, then both continue identically.
    b = copy.deepcopy(a)
    theirs = torch_cls(b.parameters(), fused=True, **kw)
    theirs.load_state_dict(copy.deepcopy(sd))
    assert theirs.param_groups[0]["decoupled_weight_decay"] == adamw
    for g in theirs.param_groups:
        g["fused"] = True  # our groups say None (torch's default); keep torch on its fused kernel
    train(a, ours, 5, seed=2)
    train(b, theirs, 5, seed=2)
    assert params_equal(a, b)

    # torch -> ours, then both continue identically.
    c = copy.deepcopy(b)
    mine = CPUAdam(c.parameters(), adamw_mode=not adamw, **kw)  # the loaded groups' mode wins, as in torch
    mine.load_state_dict(copy.deepcopy(theirs.state_dict()))  # torch aliases loaded tensors
    assert mine.param_groups[0]["decoupled_weight_decay"] == adamw
    assert mine.param_groups[0]["bias_correction"] is True
    train(b, theirs, 5, seed=3)
    train(c, mine, 5, seed=3)
    assert params_equal(b, c)
    assert float(mine.state[next(iter(c.parameters()))]["step"]) == 15


def test_unsupported_options_raise_clearly():
    model = mlp((4, 4))
    with pytest.raises(NotImplementedError, match="AMSGrad"):
        CPUAdam(model.parameters(), amsgrad=True)
    with pytest.raises(NotImplementedError, match="AMSGrad"):
        HybridAdam(model.parameters(), amsgrad=True)
    opt = CPUAdam(model.parameters())
    opt.load_state_dict(torch.optim.AdamW(model.parameters(), maximize=True).state_dict())
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(NotImplementedError, match="maximize"):
        opt.step()
    with pytest.raises(ValueError, match="betas"):
        CPUAdam(model.parameters(), betas=(0.9, 1.0))


def test_cpu_adam_refuses_accelerator_params_hybrid_takes_them():
    p = torch.nn.Parameter(torch.zeros(64, device="meta"))
    p.grad = torch.zeros(64, device="meta")
    with pytest.raises(RuntimeError, match="HybridAdam"):
        CPUAdam([p]).step()
    q = torch.nn.Parameter(torch.zeros(64))
    q.grad = torch.ones(64)
    HybridAdam([p, q], lr=0.1).step()  # the meta one goes down the torch path
    assert q.detach().lt(0).all()


@needs_kernel
def test_hybrid_equals_cpu_adam_on_cpu():
    a, b = mlp((32, 17, 3)), mlp((32, 17, 3))
    train(a, CPUAdam(a.parameters(), lr=1e-2), 10)
    train(b, HybridAdam(b.parameters(), lr=1e-2), 10)
    assert params_equal(a, b)


@needs_kernel
def test_step_params_fused_mixed_precision_entry():
    """step_params: bf16 grads, div_scale and bf16 copies out, against explicit torch casts."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (1000, 37, 16)]
    ref = [p.detach().clone() for p in params]
    ref_m = [torch.zeros_like(p) for p in ref]
    ref_v = [torch.zeros_like(p) for p in ref]
    opt = CPUAdam(params, lr=1e-3, weight_decay=0.01)
    outs = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in params]
    for step in range(1, 11):
        grads = [(torch.randn(p.numel(), generator=gen) * 512).bfloat16() for p in params]
        opt.step_params(params, grads, div_scale=512 / 0.5, out_lowps=outs)
        for p, g, m, v in zip(ref, grads, ref_m, ref_v):
            torch._fused_adamw_([p], [g.float() / (512 / 0.5)], [m], [v], [], [torch.tensor(float(step))], lr=1e-3,
                                beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip
    for p, r, o in zip(params, ref, outs):
        k = p.numel() - p.numel() % 16
        assert torch.equal(p.detach()[:k], r[:k])
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)
        assert torch.equal(o, p.detach().bfloat16())
    assert all(float(opt.state[p]["step"]) == 10 for p in params)
    with pytest.raises(ValueError, match="not a parameter"):
        opt.step_params([torch.zeros(3)], [torch.zeros(3)])


# ---------------------------------------------------------------------------------------------
# Subprocess scenarios: ELIXIR_SIMD (read once per process) and ELIXIR_DISABLE_NATIVE.


def scenario() -> dict[str, torch.Tensor]:
    """A fixed sequence of updates through every public entry; returns the final tensors."""
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(42)
    cases = [  # name, n, grad dtype, out dtype, adamw, wd, bias_correction, div_scale
        ("fp32_adamw", 1037, torch.float32, None, True, 0.01, True, 1.0),
        ("bf16_adam_l2", 2053, torch.bfloat16, torch.bfloat16, False, 0.05, True, 300.0),
        ("fp16_nobc", 517, torch.float16, torch.float16, True, 0.0, False, 8.0),
    ]
    for name, n, gdt, odt, adamw, wd, bc, ds in cases:
        p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
        o = None if odt is None else torch.empty(n, dtype=odt)
        for step in range(1, 21):
            g = (torch.randn(n, generator=gen) * ds).to(gdt)
            F.adam_step(p, g, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                        adamw_mode=adamw, bias_correction=bc, div_scale=ds, out_lowp=o)  # fmt: skip
        out.update({f"{name}.p": p, f"{name}.m": m, f"{name}.v": v})
        if o is not None:
            out[f"{name}.out"] = o
    model = mlp(ALIGNED, seed=5)
    train(model, CPUAdam(model.parameters(), lr=1e-2), 10, seed=6)
    out.update({f"model.{k}": t.detach().clone() for k, t in model.state_dict().items()})
    return out


def _child_main(path: str) -> None:  # runs in the subprocess
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = scenario()
    n_warn = sum("CPU Adam" in str(w.message) for w in caught)
    result["meta.n_warnings"] = torch.tensor(n_warn)
    result["meta.level"] = torch.tensor(list(F.kernel_level().encode()), dtype=torch.uint8)
    save_file(result, path)


def run_child(tmp_path: Path, env_extra: dict[str, str]) -> tuple[dict[str, torch.Tensor], str, int]:
    path = tmp_path / "result.safetensors"
    env = {**os.environ, **env_extra}
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_cpu_adam_optim as t; t._child_main({str(path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = load_file(str(path))
    level = bytes(res.pop("meta.level").tolist()).decode()
    return res, level, int(res.pop("meta.n_warnings"))


@pytest.mark.dist
@needs_kernel
def test_fallback_without_extension_gives_same_results(tmp_path):
    res, level, n_warn = run_child(tmp_path, {"ELIXIR_DISABLE_NATIVE": "1"})
    assert level == "torch" and n_warn == 1
    native = scenario()
    assert res.keys() == native.keys()
    for k, t in native.items():
        r = res[k]
        if k.startswith("fp16_nobc") or k.startswith("model."):  # explicit ops, or no tails: bitwise
            assert torch.equal(r, t), k
        else:  # torch's fused kernel: bitwise except its scalar tail (<= 1 ulp in v there)
            n = t.numel()
            assert torch.equal(r[: n - n % 16], t[: n - n % 16]), k
            torch.testing.assert_close(r.float(), t.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.dist
@needs_kernel
@pytest.mark.parametrize("simd", ["scalar", "avx2"])
def test_elixir_simd_env_selects_variant(tmp_path, simd):
    if simd not in F.get_native().adam_kernel_levels():
        pytest.skip(f"CPU lacks {simd}")
    res, level, n_warn = run_child(tmp_path, {"ELIXIR_SIMD": simd})
    assert level == simd and n_warn == 0
    with F._simd_override(simd):
        same = scenario()
    for k, t in same.items():
        assert torch.equal(res[k], t), k


def _on_accelerator(params) -> set:
    """The CPU stand-in for HybridAdam's accelerator parameters: these ids take the device branch
    (``_kernel_eligible`` says no), the rest the native kernel, in the same optimizer step."""
    return {id(p) for p in params}


@pytest.mark.parametrize("adamw_mode, fallback", [(True, False), (False, False), (True, True)])
def test_hybrid_device_branch_matches_torch(monkeypatch, adamw_mode, fallback):
    """HybridAdam's device branch (torch's fused multi-tensor Adam/AdamW, or the explicit ops where a
    device has no fused kernel) against torch.optim.AdamW/Adam, through a CPU stand-in: the first
    layer is "on the accelerator", the rest on the native kernel, stepped together. Before, the only
    HybridAdam test compared two objects running the same CPU code and could not fail."""
    a, b = mlp((32, 17, 3)), mlp((32, 17, 3))
    device_ids = _on_accelerator(a[0].parameters())
    eligible = F._kernel_eligible
    taken = []

    def stand_in(p, g, m, v, o):
        if id(p) in device_ids:
            taken.append(id(p))
            return False
        return eligible(p, g, m, v, o)

    monkeypatch.setattr(F, "_kernel_eligible", stand_in)
    if fallback:  # a device without torch's fused kernel: the explicit ops
        def no_fused(*args, **kwargs):
            raise NotImplementedError("no fused kernel on this device")

        monkeypatch.setattr(torch, "_fused_adamw_", no_fused)
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    train(a, HybridAdam(a.parameters(), adamw_mode=adamw_mode, **kw), 10)
    monkeypatch.undo()
    ref = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(b.parameters(), foreach=False, **kw)
    train(b, ref, 10)
    assert device_ids <= set(taken)  # the stand-in really routed them through the device branch
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-6)
