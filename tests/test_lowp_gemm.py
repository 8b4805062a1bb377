"""Widened low-precision products (``elixir.lowp_gemm``): each product and its gradients equal the
fp32 product of the same low-precision operands rounded once, the mode reaches every product
form a model uses, and a bf16 ElixirModule trains the same with and without it.

The references: an fp32 computation on the upcast operands, rounded once to bf16 (what the
widened product promises, up to fp32 summation order), and torch's own bf16 kernel (what it
replaces, which accumulates in fp32 too). Both are compared at bf16's rounding (one ulp of the
result, 2**-8 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elixir import lowp_gemm
from elixir.lowp_gemm import WidenedGemms, describe, widened_gemms, widens

BF = torch.bfloat16
ULP = 2.0**-7  # two bf16 rounding steps: the reference's and the result's


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    scale = want.detach().float().abs().max().clamp_min(1e-3)
    err = float((got.detach().float() - want.detach().float()).abs().max() / scale)
    assert err <= ULP, f"relative error {err:.3g} > {ULP:.3g}"


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(BF).requires_grad_() for s in shapes]


CASES = {
    "linear": (((3, 5, 16), (8, 16), (8,)), lambda x, w, b: F.linear(x, w, b)),
    "linear_no_bias": (((4, 16), (8, 16)), lambda x, w: F.linear(x, w)),
    "addmm": (((8,), (4, 16), (16, 8)), lambda c, a, b: torch.addmm(c, a, b)),
    "addmm_scaled": (((4, 8), (4, 16), (16, 8)), lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0)),
    "mm": (((4, 16), (16, 8)), lambda a, b: torch.mm(a, b)),
    "bmm": (((2, 4, 16), (2, 16, 8)), lambda a, b: torch.bmm(a, b)),
    "baddbmm": (((2, 4, 8), (2, 4, 16), (2, 16, 8)), lambda c, a, b: torch.baddbmm(c, a, b)),
    "matmul_4d": (((2, 3, 4, 16), (2, 3, 16, 5)), lambda a, b: torch.matmul(a, b)),
    "matmul_broadcast": (((2, 3, 4, 16), (16, 5)), lambda a, b: a @ b),
    "method": (((4, 16), (16, 8)), lambda a, b: a.matmul(b)),
}


@pytest.mark.parametrize("blocked", [False, True], ids=["whole", "column-blocks"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_product_and_its_gradients_are_the_fp32_product_rounded_once(name, blocked, monkeypatch):
    if blocked:  # a weight widened 3 columns at a time (k = 16 in every case)
        monkeypatch.setattr(lowp_gemm, "BLOCK_BYTES", 4 * 16 * 3)
    shapes, fn = CASES[name]
    leaves = _leaves(*shapes)
    with WidenedGemms(BF) as mode:
        out = fn(*leaves)
    assert mode.widened == 1, f"{name} was not widened"
    assert out.dtype == BF
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF)
    out.backward(grad_out)

    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = fn(*ref_leaves)
    ref.backward(grad_out.float())
    _close(out, ref.to(BF))
    for got, want in zip(leaves, ref_leaves):
        _close(got.grad, want.grad.to(BF))

    native = [t.detach().clone().requires_grad_() for t in leaves]  # torch's own bf16 kernel
    nat = fn(*native)
    nat.backward(grad_out)
    _close(out, nat)
    for got, want in zip(leaves, native):
        _close(got.grad, want.grad)


def test_fp32_and_mixed_operands_are_left_alone():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with WidenedGemms(BF) as mode:
        torch.mm(a, b)
        with pytest.raises(RuntimeError, match="dtype"):  # a mixed pair keeps torch's own error
            F.linear(a.to(BF), torch.randn(3, 8))
    assert mode.widened == 0


def test_setting_forces_and_disables(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("ELIXIR_LOWP_GEMM", "widen")
    assert widens(BF, cpu) and not widens(torch.float32, cpu) and not widens(BF, torch.device("meta"))
    assert describe(BF) == "widened to fp32 (forced)"
    monkeypatch.setenv("ELIXIR_LOWP_GEMM", "native")
    assert not widens(BF, cpu) and describe(BF) == "native"
    with widened_gemms(BF, cpu) as mode:
        assert mode is None
    monkeypatch.setenv("ELIXIR_LOWP_GEMM", "sometimes")
    with pytest.raises(ValueError, match="ELIXIR_LOWP_GEMM"):
        widens(BF, cpu)


def _train(widen: str, monkeypatch) -> tuple[list[float], dict, int]:
    from elixir.optim import HybridAdam
    from elixir.search import minimum_waste_search
    from elixir.testing.zoo import build_model, get_case
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    monkeypatch.setenv("ELIXIR_LOWP_GEMM", widen)
    zc = get_case("gpt2")
    model = build_model("gpt2", seed=0)
    em = ElixirModule(model, minimum_waste_search(model, 1), dtype=BF)
    opt = ElixirOptimizer(em, HybridAdam(em.parameters(), lr=1e-3))
    losses, widened = [], 0
    for step in range(3):
        opt.zero_grad()
        loss = zc.loss(em, zc.make_batch(4, step))
        widened += em.widened_products
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.float() for k, v in em.state_dict().items()}, widened


def test_a_bf16_elixir_module_trains_the_same_widened(monkeypatch):
    widened_losses, widened_state, n_widened = _train("widen", monkeypatch)
    native_losses, native_state, n_native = _train("native", monkeypatch)
    assert n_widened > 0 and n_native == 0
    # three Adam steps on bf16 compute: both runs round every product to bf16, in another order
    assert torch.allclose(torch.tensor(widened_losses), torch.tensor(native_losses), rtol=2e-2), (widened_losses, native_losses)
    for k in native_state:
        err = (widened_state[k] - native_state[k]).abs().max()
        assert err <= 2e-2 * native_state[k].abs().max().clamp_min(1e-2), (k, float(err))
