"""RSS step by step of a GPT-2 with every chunk replicated and its optimizer state on the host (H)
or the device (D), beside the cost model's predicted device and host bytes and the ledger's peaks.

    python bench/replicated_state_rss.py LAYERS WIDTH WORLD H|D    # e.g. 4 512 1 H (run under the CPU lock)

Found the leak of one gradient copy per step with the state on the host (docs/benchmarks.md)."""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import search_regret as sr

GiB = 2**30

def rss():
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return {k: int(d[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon")}

def make_plan(w, world, optim):
    from elixir.plan import ChunkPlan, Placement, Sharding
    from elixir.search.optimal import search_profile
    from elixir.search.step_profile import profile_step
    model = sr.build_model(w)
    profile = profile_step(model, sr.make_batch(w, 0), sr.step_fn)
    box = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    plan = search_profile(profile, world, device_memory=box // world, overlap=True)
    pl = {"D": Placement.DEVICE, "H": Placement.HOST}[optim]
    chunks = tuple(ChunkPlan(c.params, c.shapes, c.chunk_size, c.dtype, Sharding.REPLICATED, Placement.DEVICE, pl)
                   for c in plan.chunks)
    plan = dataclasses.replace(plan, chunks=chunks, cache_blocks=0, prediction=None)
    return plan, profile

def worker(w, plan_json, steps):
    import gc

    import torch

    from elixir import distributed as edist
    from elixir.optim import HybridAdam
    from elixir.plan import SearchResult
    from elixir.wrapper import ElixirModule, ElixirOptimizer
    out = {"start": rss()}
    torch.manual_seed(0)
    m = sr.build_model(w)
    out["model"] = rss()
    em = ElixirModule(m, SearchResult.from_json(plan_json), prefetch=False)
    del m
    gc.collect()
    out["wrapped"] = rss()
    opt = ElixirOptimizer(em, HybridAdam(em.parameters(), lr=1e-4))
    out["opt"] = rss()
    for i in range(steps):
        em(**sr.make_batch(w, i, edist.get_rank())).loss.backward()
        out[f"bwd{i}"] = rss()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[f"step{i}"] = rss()
    L = em.ledger
    out["ledger"] = L.summary()
    out["ledger_peak"] = {f"{c}@{where}": n for (c, where), n in L.peak.items() if n}
    out["device_peak"] = L.device_peak
    return out

if __name__ == "__main__":
    from elixir.launch import run_distributed
    layers, width, world, optim = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    w = sr.Workload("x", width, layers, 50257, 1, 8)
    from elixir.hardware import choose_default_profile
    hw = choose_default_profile()[0]
    plan, profile = make_plan(w, world, optim)
    pred = sr.predicted(plan, profile, world, hw)
    print(f"predicted: dev {pred[1] / GiB:.3f} GiB host {pred[2] / GiB:.3f} GiB")
    res = run_distributed(worker, world, w, plan.to_json(), 4, timeout=900)
    for r, o in enumerate(res):
        print("rank", r)
        for k, v in o.items():
            if isinstance(v, dict) and "VmRSS" in v:
                print(f"  {k:8s} RSS {v['VmRSS']/GiB:.3f} HWM {v['VmHWM']/GiB:.3f} anon {v['RssAnon']/GiB:.3f} GiB")
            else:
                print(" ", k, v)
