"""Every zoo model builds from config, runs forward and backward, and the reference trainer is
deterministic and actually trains."""

import pytest
import torch

from elixir.testing.reference import shard_batch, train_reference
from elixir.testing.zoo import ZOO, build_model, get_case


@pytest.mark.parametrize("name", sorted(ZOO))
def test_forward_backward(name):
    case = get_case(name)
    model = build_model(name)
    loss = case.step_fn(model, case.make_batch(4, step=0))
    assert torch.isfinite(loss)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable
    got_grad = {n for n, p in trainable if p.grad is not None}
    if name == "routed":  # the unused expert and the never-used layer get no gradient at step 0
        assert "experts.2.weight" not in got_grad and "never_used.weight" not in got_grad
        assert "experts.0.weight" in got_grad
    else:
        assert got_grad == {n for n, _ in trainable}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n


def test_hard_cases_are_what_they_claim():
    tied = build_model("tied")
    assert tied.head.weight is tied.embed.weight
    frozen = build_model("frozen")
    assert any(not p.requires_grad for p in frozen.parameters())
    assert len(list(build_model("buffers").buffers())) >= 3
    gpt2 = build_model("gpt2")
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight


def test_reference_is_deterministic_and_trains():
    a = train_reference("gpt2", steps=3)
    b = train_reference("gpt2", steps=3)
    assert a.losses == b.losses
    for k in a.state_dict:
        assert torch.equal(a.state_dict[k], b.state_dict[k]), k
    longer = train_reference("tied", steps=15, batch_size=8)
    assert longer.losses[-1] < longer.losses[0]


def test_shard_batch_splits_evenly():
    batch = get_case("routed").make_batch(8, 3)
    parts = [shard_batch(batch, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert all(int(p["step"]) == 3 for p in parts)
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_batch(batch, 0, 3)
