"""`elixir plan` refuses a budget the parameters alone exceed before tracing anything (issue 35: an
impossible budget took 6.9 s, mostly importing transformers' model code and tracing, to be refused).

The refusal must never refuse what the search would accept (the mesh search of ``--tp/--pp`` too): the parameter floor is at most the
built model's count, and at the least budget the untraced floor lets through less one byte, the
traced search refuses too. Its error is the search's (same class, same head, suggestions listed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from elixir import models
from elixir.hardware import load_profile
from elixir.plan import MeshLayout
from elixir.plan.budgets import (
    INF,
    Budgets,
    DoesNotFitError,
    MemoryPolicy,
    budget_head,
    unified_memory,
    untraced_refusal,
)
from elixir.plan.state_format import FP32_STATE, leaner_formats
from elixir.plan.tensor_plans import local_shapes, style_plan
from elixir.search.mesh_profile import search_mesh
from elixir.search.optimal import search_profile
from elixir.search.step_profile import profile_step

_TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 160, "max_position_embeddings": 64}
# one tiny config per family parameter_floor knows (OPT's with a projected embedding, Qwen3's with
# an explicit head_dim, Qwen2's tied and with q/k/v biases, Llama's untied)
TINY = {
    **models.SMALL_OVERRIDES,
    "opt-350m": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, ffn_dim=96, vocab_size=160,
                     max_position_embeddings=64, word_embed_proj_dim=32),
    "mistral-7b": dict(_TINY),
    "qwen2.5-0.5b": dict(_TINY),
    "qwen3-0.6b": dict(_TINY, head_dim=8),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_parameter_floor_is_at_most_the_models_count(name):
    floor = models.parameter_floor(name, **TINY[name])
    count = sum(p.numel() for p in models.build_model(name, **TINY[name]).parameters())  # tied ones once
    assert floor is not None and 0 < floor <= count


def test_an_unknown_family_gets_no_floor(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, '
                                          '"num_attention_heads": 4, "vocab_size": 100}')
    assert models.parameter_floor(str(tmp_path)) is None


def _least_budget(numel: int, dtype: torch.dtype, world: int, hw, disk: int, formats=FP32_STATE) -> int:
    """The least per-rank budget (device = host) the untraced floor lets through."""
    lo, hi = 0, INF
    while hi - lo > 1:
        mid = (lo + hi) // 2
        refused = untraced_refusal(numel, dtype, world, hw, Budgets(mid, mid, disk), formats=formats)
        lo, hi = (lo, mid) if refused is None else (mid, hi)
    return hi


CASES = [("gpt2", torch.float32, "cpu-box", 1, 0), ("llama-7b", torch.bfloat16, "8xA100-40GB", 2, 0),
         ("opt-350m", torch.bfloat16, "8xA100-40GB", 2, 1 << 16), ("qwen2.5-0.5b", torch.float32, "cpu-box", 1, 1 << 16)]


@pytest.mark.parametrize("name,dtype,hw_name,world,disk", CASES)
def test_the_search_refuses_every_budget_the_untraced_floor_refuses(name, dtype, hw_name, world, disk):
    hw = load_profile(hw_name)
    m = models.build_model(name, **TINY[name])
    profile = profile_step(m, models.make_batch(m, 1, 8), models.lm_step_fn, dtype)
    numel = models.parameter_floor(name, **TINY[name])
    v = _least_budget(numel, dtype, world, hw, disk) - 1
    below = untraced_refusal(numel, dtype, world, hw, Budgets(v, v, disk))
    with pytest.raises(DoesNotFitError) as traced:
        search_profile(profile, world, hardware=hw, device_memory=v, host_memory=v, disk=disk)
    # the same error: class, head (budgets, margins, disk, ranks), and a list of changes
    head = budget_head(Budgets(v, v, disk), MemoryPolicy().usable(v, v, disk), unified_memory(hw), world) + "; "
    for e in (traced.value, below):
        assert isinstance(e, DoesNotFitError) and str(e).startswith(head), str(e)
        assert e.suggestions and all(f"\n  - {s}" in str(e) for s in e.suggestions)
    assert "refused before tracing" in str(below) and "memory" in below.needs


@pytest.mark.parametrize("tp,pp,dp,lossy", [(2, 1, 2, False), (2, 3, 1, True)])
def test_the_mesh_search_refuses_every_budget_the_untraced_floor_refuses(tp, pp, dp, lossy):
    """`elixir plan --tp/--pp` refuses by the same floor over all its ranks (they hold every
    trainable parameter at least once, so the rank holding the most holds at least the average),
    with ``--allow-lossy-state`` at the leanest formats the search may turn to: at the least
    budget it lets through less one byte, the mesh search refuses too."""
    name, dtype, hw = "llama-7b", torch.bfloat16, load_profile("8xA100-40GB")
    m = models.build_model(name, **TINY[name])
    profile = profile_step(m, models.make_batch(m, 1, 8), models.lm_step_fn, dtype)
    formats = leaner_formats(*FP32_STATE)[-1] if lossy else FP32_STATE
    v = _least_budget(models.parameter_floor(name, **TINY[name]), dtype, tp * pp * dp, hw, 0, formats) - 1
    shapes = local_shapes(profile.params + profile.frozen_shapes, style_plan(m), tp)
    with pytest.raises(DoesNotFitError):
        search_mesh(profile, MeshLayout(pp=pp, dp_shard=dp, tp=tp), tp_shapes=shapes, hidden=m.config.hidden_size,
                    microbatches=2 * pp, hardware=hw, device_memory=v, host_memory=v, allow_lossy_state=lossy)


def test_the_cli_refuses_a_mesh_before_tracing(capsys):
    from elixir.cli import main

    assert main(["plan", "llama-70b", "--world-size", "16", "--tp", "8", "--hardware", "8xA100-40GB",
                 "--device-memory", "1GiB", "--host-memory", "2GiB", "--allow-lossy-state"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "refused before tracing" in out and "bf16-sr/int8" in out, out


@pytest.mark.dist  # a fresh interpreter, to see which modules the refusal imported
def test_the_cli_refuses_before_importing_the_tracer_or_transformers():
    code = ("import sys; from elixir.cli import main; "
            "rc = main(['plan', 'opt-175b', '--world-size', '1', '--device-memory', '8GiB', '--host-memory', '16GiB']); "
            "print('rc', rc); print('loaded', sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' "
            "or m.startswith(('elixir.search', 'elixir.tracer'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    out = " ".join(r.stdout.split())
    assert "rc 1" in out and "loaded []" in out, r.stdout + r.stderr
    assert "no plan fits: device budget 8.00 GiB" in out and "refused before tracing" in out and ">=" in out
