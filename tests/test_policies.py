"""The runtime's policies (MixedPrecisionPolicy, OffloadPolicy, LossScalePolicy): the same run
whichever spelling is used, bad values refused where they are written, never both spellings."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from elixir.optim import CPUAdam
from elixir.search import minimum_waste_search
from elixir.wrapper import ElixirModule, ElixirOptimizer, LossScalePolicy, MixedPrecisionPolicy, OffloadPolicy


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def _train(steps: int = 3, **kw) -> tuple[list[float], torch.dtype]:
    net = _net()
    opt_kw = {k: kw.pop(k) for k in ("loss_scale_policy", "initial_scale") if k in kw}
    em = ElixirModule(net, minimum_waste_search(net, 1), **kw)
    opt = ElixirOptimizer(em, CPUAdam(em.parameters(), lr=1e-2), **opt_kw)
    g = torch.Generator().manual_seed(1)
    losses, out_dtype = [], None
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        out = em(x)
        out_dtype = out.dtype
        loss = ((out.float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, out_dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_policy_runs_exactly_as_the_keywords(dtype):
    old, old_out = _train(dtype=dtype, reduce_always_fp32=True, output_fp32=True, grad_dtype=dtype)
    new, new_out = _train(mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                                         grad_dtype=dtype, output_dtype=torch.float32))
    assert new == old and new_out == old_out == torch.float32
    _, low_out = _train(mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
    assert low_out == dtype  # no output_dtype: outputs stay as computed


def test_loss_scale_policy_runs_exactly_as_the_keywords():
    old, _ = _train(dtype=torch.float16, initial_scale=2.0**10)
    new, _ = _train(dtype=torch.float16, loss_scale_policy=LossScalePolicy(initial_scale=2.0**10))
    assert new == old


def test_offload_policy_is_the_module_keywords(tmp_path):
    net = _net()
    em = ElixirModule(net, minimum_waste_search(net, 1), offload_policy=OffloadPolicy(str(tmp_path), direct=True))
    assert (em.offload_dir, em.offload_direct) == (str(tmp_path), True)


def test_bad_values_are_refused_where_they_are_written():
    with pytest.raises(ValueError, match=r"param_dtype must be torch.float32, torch.bfloat16 or torch.float16"):
        MixedPrecisionPolicy(param_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"reduce_dtype must be the param_dtype .* or torch.float32"):
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match="grad_dtype"):
        MixedPrecisionPolicy(grad_dtype="bfloat16")
    with pytest.raises(ValueError, match="offload_dir must be a directory path"):
        OffloadPolicy(offload_dir=3)
    with pytest.raises(ValueError, match="initial_scale"):
        LossScalePolicy(initial_scale=0.5)
    net = _net()
    plan = minimum_waste_search(net, 1)
    with pytest.raises(ValueError, match="param_dtype must be"):  # the alias is checked by the same rule
        ElixirModule(net, plan, dtype=torch.float64)


def test_both_spellings_at_once_are_refused():
    net = _net()
    plan = minimum_waste_search(net, 1)
    with pytest.raises(ValueError, match="pass mp_policy or dtype, output_fp32, not both"):
        ElixirModule(net, plan, dtype=torch.bfloat16, output_fp32=True, mp_policy=MixedPrecisionPolicy())
    with pytest.raises(ValueError, match="pass offload_policy or offload_dir, not both"):
        ElixirModule(net, plan, offload_dir="/tmp", offload_policy=OffloadPolicy())
    em = ElixirModule(net, plan)
    with pytest.raises(ValueError, match="pass loss_scale_policy or hysteresis, not both"):
        ElixirOptimizer(em, CPUAdam(em.parameters()), hysteresis=3, loss_scale_policy=LossScalePolicy())


def test_integration_options_check_their_loss_scale_at_construction():
    from elixir.integrations.options import ElixirOptions

    with pytest.raises(ValueError, match="loss_scale got \\['initial_scal'\\]; its keys are"):
        ElixirOptions(loss_scale={"initial_scal": 2.0})
    with pytest.raises(ValueError, match="initial_scale"):
        ElixirOptions(loss_scale={"initial_scale": 0.5})
    assert ElixirOptions(loss_scale={"hysteresis": 3}).scale_policy() == LossScalePolicy(hysteresis=3)
