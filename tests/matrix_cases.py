"""The runtime's correctness matrix, shared by the tests that run it on other plan kinds.

Cases (zoo model x prefetch x checkpointing x optimizer), the wrapped training each rank runs
(:func:`matrix_worker`), the single-process full-batch reference and :func:`compare`, which
checks a wrapped run against it (losses and first gradients at rtol 1e-5; final parameters after
AdamW against the same training in the data-parallel summation order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.search import minimum_waste_search
from elixir.testing.reference import default_optimizer, shard_batch, to_device, train_reference, train_wrapped
from elixir.testing.zoo import ZOO, ZooCase, _ce_loss, _vector_batch
from elixir.wrapper import ElixirModule, ElixirOptimizer

STEPS = 3
LR = 1e-2  # default_optimizer's AdamW learning rate
BATCH = 4


class InPlaceNet(nn.Module):
    """In-place ops on activations between (and inside) param-owning modules."""

    def __init__(self, dim: int = 16, classes: int = 8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.act = nn.ReLU(inplace=True)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.act(self.inp(x))
        h2 = self.mid(h)
        h2.mul_(0.5).add_(h)
        h2.tanh_()
        return self.head(h2)


INPLACE = ZooCase("inplace", InPlaceNet, _vector_batch, _ce_loss, tags=("toy",))
CASES = {**ZOO, "inplace": INPLACE}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


@dataclass(frozen=True)
class Case:
    model: str
    prefetch: bool = False
    ckpt: str = ""  # "", "reentrant", "nonreentrant"
    optim: str = "adamw"
    overrides: tuple = ()
    id: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        parts = [self.model, "prefetch" if self.prefetch else "ondemand"]
        if self.ckpt:
            parts.append(self.ckpt)
        if self.optim != "adamw":
            parts.append(self.optim)
        parts += [f"{k}={v}" for k, v in self.overrides]
        return "-".join(parts)


def build(case: Case) -> nn.Module:
    zc = CASES[case.model]
    torch.manual_seed(0)
    model = zc.build(**dict(case.overrides))
    if case.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": case.ckpt == "reentrant"})
    return model


def opt_fn(case: Case):
    return sgd if case.optim == "sgd" else default_optimizer


def cases_for(world: int) -> list[Case]:
    out = []
    for name in CASES:
        if name == "buffers" and world > 1:
            continue  # BatchNorm statistics are batch-dependent
        for pf in (False, True):
            out.append(Case(name, pf))
    out += [
        Case("gpt2", False, "reentrant"),
        Case("gpt2", True, "nonreentrant"),
        Case("llama", True, "reentrant"),
        Case("llama", False, "nonreentrant"),
        Case("convnet", False, optim="sgd"),
        Case("routed", True, optim="sgd"),
    ]
    if world == 1:  # dropout streams match the reference only when one rank sees the whole batch
        out += [Case("gpt2", False, overrides=(("dropout", 0.1),)), Case("opt", True, "nonreentrant", overrides=(("dropout", 0.1),))]
    return out


def train_case(case: Case) -> dict:
    zc = CASES[case.model]
    rank, world = edist.get_rank(), edist.get_world_size()
    model = build(case)
    if case.prefetch:
        sr = minimum_waste_search(model, world, prefetch=True, inp=zc.make_batch(BATCH, 0), step_fn=zc.step_fn)
    else:
        sr = minimum_waste_search(model, world)
    em = ElixirModule(model, sr, prefetch=case.prefetch)
    em.train()
    opt = ElixirOptimizer(em, opt_fn(case)([p for p in em.parameters() if p.requires_grad]))
    run = train_wrapped(zc, em, opt, steps=STEPS, batch_size=BATCH)
    losses, grads = run.losses, run.first_grads
    sd = em.state_dict(rank0_only=True)
    return {
        "losses": losses,
        "grads": grads if rank == 0 else None,
        "state": sd,
        "memory": em.memory_report(),
        "drifted": bool(em.schedule is not None and em.schedule.drifted),
        "prefetches": em.cache.prefetches,
        "warnings": run.warnings,
    }


def matrix_worker(cases: list) -> list:
    """Run in each spawned rank: train every case, return what :func:`compare` reads."""
    return [train_case(c) for c in cases]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@functools.cache
def reference(case: Case, device=None):
    """The plain single-process full-batch run (shared by every world size), on ``device``."""
    return train_reference(CASES[case.model], steps=STEPS, batch_size=BATCH, optimizer_fn=opt_fn(case), model=build(case),
                           device=device)


def train_dp_emulation(case: Case, world: int, device=None) -> dict[str, torch.Tensor]:
    """Single process, but each step sums the per-rank slices' gradients (each loss scaled by
    1/world, exact for powers of two) in rank order, as data-parallel ranks do: the wrapped run's
    per-rank arithmetic, so AdamW's amplification of reduction-order rounding mostly cancels."""
    zc = CASES[case.model]
    model = build(case).to(device or "cpu")
    model.train()
    opt = opt_fn(case)([p for p in model.parameters() if p.requires_grad])
    torch.manual_seed(1)
    for step in range(STEPS):
        batch = to_device(zc.make_batch(BATCH, step), device)
        opt.zero_grad(set_to_none=True)
        for r in range(world):
            (zc.loss(model, shard_batch(batch, r, world)) / world).backward()
        opt.step()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def compare(case: Case, got: dict, world: int, device=None, reordered: bool = False) -> list[str]:
    """Errors of the wrapped run ``got`` against the references, computed on ``device``.
    ``reordered``: the run's arithmetic may round differently from the reference's even at world
    size 1 (GPU kernels chosen by alignment, atomics), so final parameters get the tolerance for
    another reduction order that world sizes above 1 always get."""
    ref = reference(case, device)
    # losses and first gradients: against the plain full-batch reference. Final parameters after
    # AdamW: against the same training with the data-parallel summation order (see below).
    final = ref.state_dict if world == 1 or case.optim != "adamw" else train_dp_emulation(case, world, device)
    model = build(case)
    canonical = {id(p): n for n, p in model.named_parameters()}
    alias = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    grad_scale = max(g.abs().max().item() for g in ref.first_grads.values() if g is not None)
    errs = []
    if not all(abs(a - b) <= 1e-5 * abs(b) + 1e-7 for a, b in zip(got["losses"], ref.losses)):
        errs.append(f"losses {got['losses']} vs reference {ref.losses}")
    # got["grads"] is None when the fused backward-and-step consumed the gradients during backward
    # (tests/test_grad_memory.py checks it is bitwise the separate step); losses and final
    # parameters are still compared below
    for n, g in ref.first_grads.items() if got["grads"] is not None else ():
        if n not in got["grads"] and g is None:
            continue  # frozen parameter
        mine = got["grads"].get(n)
        if (g is None) != (mine is None):
            errs.append(f"grad of {n}: reference {'None' if g is None else 'set'}, elixir {'None' if mine is None else 'set'}")
        elif g is not None and not _close(mine, g):
            errs.append(f"grad of {n} differs by {(mine - g).abs().max().item():.3g}")
    if set(got["state"]) != set(ref.state_dict):
        errs.append(f"state-dict keys differ: {set(got['state']) ^ set(ref.state_dict)}")
    for k, v in final.items():
        if k not in got["state"]:
            continue
        mine = got["state"][k].to(v.dtype)
        tol = 1e-5 * v.abs() + 1e-6
        g = ref.first_grads.get(alias.get(k, k))
        if g is not None and (world > 1 or reordered) and case.optim == "adamw":
            # Adam divides by |g|, so a gradient rounding difference e (another reduction order;
            # the first step's gradients are checked at rtol 1e-5 above) moves a step by about
            # lr * e / |g|, and the difference compounds over the steps. Allow that with e = 1e-6
            # of the model's largest gradient: elements with ordinary gradients get a negligible
            # allowance; those whose true gradient is 0 (attention key biases: the reference's is
            # rounding noise) may differ by up to lr per step, in any data-parallel system.
            tol = tol + LR * STEPS * torch.clamp(1e-6 * grad_scale / g.abs().clamp_min(1e-30), max=1.0)
        bad = (mine - v).abs() > tol
        if bad.any():
            errs.append(f"final {k} differs by {(mine - v)[bad].abs().max().item():.3g} (beyond tolerance)")
    bad_warn = [w for w in got["warnings"] if "rCache" in w]
    if bad_warn:
        errs.append(f"cache warnings: {bad_warn}")
    return [f"{case.label}: {e}" for e in errs]
