"""The hand-written plain-torch reference for mixed precision: the model cast to the compute dtype,
fp32 master copies of every parameter stepped by AdamW on fp32 copies of the low-precision
gradients, then copied back (fp16: the loss scaled by 2**16 and the gradients unscaled, as the
dynamic loss scaler does from its initial scale). Shared by the mixed-precision runtime tests and the CUDA tests, with the runs they train
(:func:`mixed_worker`) and the check against the reference (:func:`check_mixed`)."""

from __future__ import annotations

import torch

from elixir import distributed as edist
from elixir.lowp_gemm import widened_gemms
from elixir.search import minimum_waste_search
from elixir.testing.reference import shard_batch, to_device
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer

STEPS = 10


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def reference_mixed(name: str, dtype: torch.dtype, device=None) -> tuple[list[float], dict]:
    case = ZOO[name]
    model = build_model(name).to(device or "cpu")
    names = [n for n, _ in model.named_parameters()]
    masters = [torch.nn.Parameter(p.detach().clone().float()) for p in model.parameters()]
    for p in model.parameters():
        p.data = p.data.to(dtype)
    opt = adamw(masters)
    losses = []
    for step in range(STEPS):
        for p in model.parameters():
            p.grad = None
        # the products as the runtime computes them on this machine (widened to fp32 where torch
        # has no native low-precision kernel, elixir.lowp_gemm), so world 1 runs the very same ops
        with widened_gemms(dtype, torch.device(device or "cpu")):
            loss = case.loss(model, to_device(case.make_batch(4, step), device))
        scale = 2.0**16 if dtype == torch.float16 else 1.0
        (loss * scale).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = None if p.grad is None else p.grad.float() * (1.0 / scale)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        losses.append(loss.float().item())
    return losses, {n: m.detach().cpu().clone() for n, m in zip(names, masters)}


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_worker(runs: list, device=None) -> list:
    rank, world = edist.get_rank(), edist.get_world_size()
    out = []
    for name, dt, reduce32, out32 in runs:
        case = ZOO[name]
        model = build_model(name)
        em = ElixirModule(model, minimum_waste_search(model, world), dtype=DTYPES[dt],
                          reduce_always_fp32=reduce32, output_fp32=out32)
        opt = ElixirOptimizer(em, adamw(list(em.parameters())))
        losses, out_dtype = [], None
        for step in range(STEPS):
            opt.zero_grad()
            batch = to_device(shard_batch(case.make_batch(4, step), rank, world), device)
            res = em(input_ids=batch["input_ids"], labels=batch["input_ids"])
            out_dtype = str(res.logits.dtype)
            res.loss.backward()
            opt.step()
            t = res.loss.detach().float().clone()
            edist.all_reduce(t)
            losses.append(t.item() / world)
        masters = {}
        for c in em.chunks:  # full fp32 masters, gathered
            full = torch.empty(c.spec.capacity, device=c.master.device)
            if c.spec.sharded:
                edist.all_gather_into(full, c.master)
            else:
                full.copy_(c.master)
            for i in em._chunk_params[c.index]:
                s = em.slots[i]
                masters[s.name] = full[s.offset : s.offset + s.numel].view(s.shape).cpu().clone()
        rep = em.memory_report()
        out.append({"capacities": [c.spec.capacity for c in em.chunks], "losses": losses, "masters": masters, "out_dtype": out_dtype, "report": rep,
                    "master_bytes": rep["master_bytes"], "shard_bytes": rep["shard_bytes"]})
    return out


RUNS = [("gpt2", "bf16", False, False), ("llama", "bf16", True, True), ("gpt2", "fp16", False, True), ("llama", "fp16", False, False)]


def check_mixed(results: list, world: int, device=None) -> None:
    """Assert that ``mixed_worker``'s results track :func:`reference_mixed` (run on ``device``)."""
    for (name, dt, reduce32, out32), got in zip(RUNS, results):
        block = max(c for c in got["capacities"])
        ref_losses, ref_masters = reference_mixed(name, DTYPES[dt], device)
        # Tolerances: at world 1 the runtime runs the very same low-precision ops, so only
        # buffers kept in fp32 (LLaMA's rotary inv_freq, which the reference casts) and fp32
        # gradient reduction separate them. At world 2 each rank's gradient is a half-batch
        # mean rounded to the compute dtype before the sum (bf16 eps 7.8e-3, fp16 9.8e-4).
        # Over 10 AdamW steps (lr 1e-3) that stays well inside 2e-2 relative on the loss and
        # 2e-3 absolute on the masters (each step moves a master by at most ~lr).
        for a, b in zip(got["losses"], ref_losses):
            assert abs(a - b) <= 2e-2 * abs(b), (name, dt, got["losses"], ref_losses)
        diffs = torch.cat([(got["masters"][n] - m).abs().reshape(-1) for n, m in ref_masters.items() if n in got["masters"]])
        if world == 1:
            assert diffs.max().item() <= 2e-3, (name, dt, diffs.max().item())
        else:
            # at world 2, elements whose true gradient is 0 (attention key biases) follow rounding
            # noise at up to lr per step (see test_runtime.py), so bound the mean and the maximum
            assert diffs.mean().item() <= 2e-4, (name, dt, diffs.mean().item())
            assert diffs.max().item() <= 2 * 1e-3 * STEPS, (name, dt, diffs.max().item())
        # reduce_always_fp32: gradient buffers are fp32 (4 bytes an element), else compute dtype
        assert got["report"]["peak_grad_buffer_bytes"] % (4 if reduce32 else 2) == 0
        assert got["report"]["peak_grad_buffer_bytes"] >= block * (4 if reduce32 else 2)
        assert got["out_dtype"] == ("torch.float32" if out32 else str(DTYPES[dt]))
        # fp32 masters exist next to the low-precision shards: 2 bytes vs 4 per element
        assert got["master_bytes"] == 2 * got["shard_bytes"]
        if world == 1 and name == "gpt2" and device is None:  # nothing reduced: exactly the same ops
            assert got["losses"] == ref_losses  # (on CPU; CUDA kernels may use atomics)
