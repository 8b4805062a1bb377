"""The search's choice held against the plans it rejected: regret and prediction error per workload.

For each workload (a GPT-2 shape, a batch x sequence, a per-rank budget) the search traces the
step and picks a plan; this bench then builds the strongest alternatives the search passed over
and times every plan that fits the budget, each in fresh ranks, several repeats:

- ``runner-up-N``: the next plans of the search's own ranking, best first, one per distinct plan
  (another chunk size, block count or placement; replicated plans differ in chunk size only);
- ``zero3``: the search with every body chunk sharded (``body_sharding="sharded"``);
- ``zero12``: the search with every body chunk ZeRO-1/2 (``body_sharding="zero"``);
- ``min-waste``: ``minimum_waste_search`` with prefetch (the untuned default);
- ``blocks+1`` / ``blocks-1``: the search's plan with one rCache block more / fewer;
- ``tier-up`` / ``tier-down``: the search's offloaded chunks one placement tier up (disk -> host
  -> device) / its device-placed sharded chunks one tier down.

An alternative whose predicted bytes break the budgets the search kept to (device, host, disk,
after the same margins; on a CPU box device and host share the host budget) is not timed: it
could win only with memory the search did not have. One that raises while running is reported as such. Each plan's step time is the
median of its timed steps, its spread the range of the per-repeat medians.

- **regret**: the search's plan's time over the best time measured, 1.0 when the search's plan
  is the fastest or within the spread of the fastest (a tie);
- **prediction_error**: ``(measured - predicted) / measured`` for the search's plan.

    python bench/search_regret.py --quick                 # 3 workloads, about 15 minutes
    python bench/search_regret.py --json out/regret.json  # the full grid (under an hour, quiet box)
    python bench/search_regret.py --smoke                 # one tiny workload, seconds (the test)
    python bench/search_regret.py --merge a.json b.json --json all.json  # one table from slices

The grid can run in slices (``--only NAME --json NAME.json`` per workload, each alone on the
box); ``--merge`` then joins the slices' workloads into one summary and table.

Run it alone on a quiet box: step times on 2 cores move with any other load. The JSON holds
``{"workloads": [{"name", "regret", "prediction_error", "plans": [...]}, ...]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

GiB = 2**30


@dataclass(frozen=True)
class Workload:
    """One point of the grid: a GPT-2 shape, a batch per rank and a sequence, a per-rank budget."""

    name: str
    n_embd: int
    n_layer: int
    vocab: int
    batch: int
    seq: int
    budget_gib: Optional[float] = None  # per-rank device budget; None: the box shared by the ranks
    disk_gib: float = 0.0  # disk allowed per rank (0: none)

    @property
    def n_head(self) -> int:
        return max(1, self.n_embd // 64)


# 10M-350M parameters; communication-bound (batch 1 x seq 8) to compute-bound (4 x 256); budgets
# from everything fits, through tight, to disk needed
GRID = (
    Workload("10M-comm", 256, 4, 16384, 1, 8),
    Workload("10M-compute", 256, 4, 16384, 4, 256),
    Workload("30M-mid", 512, 6, 16384, 2, 64),
    Workload("30M-tight", 512, 6, 16384, 2, 64, budget_gib=0.45),
    Workload("82M-comm", 768, 6, 50257, 1, 8),
    Workload("82M-mid", 768, 6, 50257, 2, 128),
    Workload("82M-tight", 768, 6, 50257, 2, 128, budget_gib=1.6),
    # disk needed: the state outweighs the activations (an 82M model at 2 x 128 cannot: its
    # activations and the process leave no room a disk tier would free)
    Workload("124M-disk", 768, 12, 50257, 1, 32, budget_gib=1.8, disk_gib=4.0),
    Workload("124M-mid", 768, 12, 50257, 2, 64),
    Workload("124M-tight", 768, 12, 50257, 2, 64, budget_gib=2.0),
    Workload("354M-comm", 1024, 24, 50257, 1, 8),
    Workload("354M-tight", 1024, 24, 50257, 1, 8, budget_gib=5.75),
)
QUICK = ("10M-comm", "30M-tight", "82M-mid")
SMOKE = (Workload("smoke", 64, 2, 512, 1, 16),)


def build_model(w: Workload):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=w.vocab, n_embd=w.n_embd, n_layer=w.n_layer, n_head=w.n_head,
                     n_positions=max(1024, w.seq), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def make_batch(w: Workload, step: int, rank: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(7919 * step + rank)
    ids = torch.randint(0, w.vocab, (w.batch, w.seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def step_fn(model, batch):
    loss = model(**batch).loss
    loss.backward()
    return loss


# ---- plans -----------------------------------------------------------------------------------

def _budgets(w: Workload, world: int) -> dict:
    if w.budget_gib is None:
        box = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return {"device_memory": box // world, "disk": int(w.disk_gib * GiB)}
    b = {"device_memory": int(w.budget_gib * GiB), "disk": int(w.disk_gib * GiB)}
    if w.disk_gib:  # a disk workload: the host binds too (on a CPU box device and host are one pool)
        b["host_memory"] = b["device_memory"]
    return b


def _one_tier(plan, up: bool):
    """The plan with its offloaded chunks one tier up (disk -> host -> device), or its device-placed
    sharded chunks one tier down (device -> host); None when nothing moves."""
    from elixir.plan import ChunkPlan, Placement, placement_problem

    order = [Placement.DEVICE, Placement.HOST, Placement.DISK]
    chunks, moved = [], False
    for c in plan.chunks:
        shard, optim = c.shard_placement, c.optim_placement
        if up and optim is not Placement.DEVICE:
            optim = order[order.index(optim) - 1]
            shard = order[max(0, order.index(shard) - 1)] if c.sharded else shard
        elif not up and c.sharded and optim is Placement.DEVICE:
            optim = Placement.HOST
        if (shard, optim) != (c.shard_placement, c.optim_placement) and not placement_problem(c.sharding, shard, optim):
            c = ChunkPlan(c.params, c.shapes, c.chunk_size, c.dtype, c.sharding, shard, optim)
            moved = True
        chunks.append(c)
    return dataclasses.replace(plan, chunks=tuple(chunks), prediction=None) if moved else None


def candidate_plans(w: Workload, world: int, hw) -> dict[str, Any]:
    """The search's plan and its alternatives (see the module docstring), by name."""
    from elixir.search import minimum_waste_search
    from elixir.search.optimal import search_profile
    from elixir.search.step_profile import profile_step

    model = build_model(w)
    profile = profile_step(model, make_batch(w, 0), step_fn)
    kw = dict(hardware=hw, overlap=True, **_budgets(w, world))
    t0 = time.perf_counter()
    chosen = search_profile(profile, world, **kw)
    plans: dict[str, Any] = {"search": chosen}
    search_s = time.perf_counter() - t0
    for i, alt in enumerate(runner_up_plans(profile, world, hw, _budgets(w, world)), 1):
        plans[f"runner-up-{i}"] = alt
    for name, sharding in (("zero3", "sharded"), ("zero12", "zero")):
        try:
            plans[name] = search_profile(profile, world, body_sharding=sharding, **kw)
        except Exception as e:  # does not fit: reported, not timed
            plans[name] = f"does not fit: {str(e).splitlines()[0]}"
    plans["min-waste"] = minimum_waste_search(model, world, prefetch=True, inp=make_batch(w, 0), step_fn=step_fn)
    sharded = sum(c.sharded for c in chosen.all_chunks)
    for name, d in (("blocks+1", 1), ("blocks-1", -1)):
        b = chosen.cache_blocks + d
        if sharded and 1 <= b <= sharded:
            plans[name] = dataclasses.replace(chosen, cache_blocks=b, prediction=None)
    for name, up in (("tier-up", True), ("tier-down", False)):
        alt = _one_tier(chosen, up)
        if alt is not None:
            plans[name] = alt
    timed: list[tuple[str, Any]] = []
    for name, p in list(plans.items()):  # a plan already listed under another name: not timed twice
        if isinstance(p, str):
            continue
        twin = next((n for n, q in timed if _same_plan(p, q)), None)
        if twin is not None:
            plans[name] = "same as the search's plan" if twin == "search" else f"same as {twin}"
        else:
            timed.append((name, p))
    return {"plans": plans, "profile": profile, "search_s": search_s}


def runner_up_plans(profile, world: int, hw, budgets: dict, k: int = 4) -> list:
    """The search's own runner-ups as plans: the best it priced at each other chunk size (and way of
    chunking tied parameters), best first, from the same configuration the search settled on.
    Reaches into the search's stages (a bench may; users read ``plan.info["runner_ups"]``)."""
    from elixir.search import optimal as search

    hw_, _, _, b = search._resolve_hardware(world, hw, None, None, budgets["device_memory"], budgets.get("host_memory"),
                                            budgets["disk"])
    s = search._Searcher(search.SearchRequest(profile, world, hw_, b, overlap=True))
    s, found = search._search_leanest(s, None, None)
    out, seen = [], set()
    for e in found[1]:  # best first; one per distinct plan (replicated plans differ in chunk size only)
        replicated = all(p.replicated for p in e.placements)
        key = ("replicated",) if replicated else (search._summary(e), e.chunk_size, e.shard_shared, e.blocks)
        if key in seen:
            continue
        seen.add(key)
        out.append(search.to_search_result(profile, world, e, s.layout_of(e), {}, grad_dtype=s.grad_dtype,
                                           fused_step=s.fused_step))
        if len(out) == k + 1:
            break
    return out[1:]


def _same_plan(a, b) -> bool:
    return (a.to_json()["chunks"] == b.to_json()["chunks"] and a.cache_blocks == b.cache_blocks
            and a.prefetch_depth == b.prefetch_depth and a.to_json()["frozen_chunks"] == b.to_json()["frozen_chunks"])


def predicted(plan, profile, world: int, hw) -> tuple[float, int, int, int]:
    """(step seconds, peak device, host and disk bytes) the cost model gives ``plan``."""
    from elixir.plan import MeshLayout
    from elixir.search.cost_model import Setting, evaluate_plan

    e = 2 if profile.dtype in ("bfloat16", "float16") else 4
    st = Setting(layout=MeshLayout.data_parallel(world), elem=e, reduce_elem=e, opt_bytes=8,
                 hardware=hw.per_rank(hw.ranks_per_node(world)), dtype=profile.dtype)
    ev = evaluate_plan(profile, plan, st)
    return float(ev.step_time), int(ev.device_bytes), int(ev.host_bytes), int(ev.disk_bytes)


def over_budget(pred: tuple[float, int, int, int], budgets: dict, hw) -> Optional[str]:
    """Why a plan's predicted bytes break the budgets the search kept to (after the same margins;
    on a CPU box device and host bytes share the host budget), or None. An alternative that the
    search could not have picked is not a fair rival: it would win with memory the search did not have."""
    from elixir.plan.budgets import MemoryPolicy, unified_memory

    box = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    dev, host, disk = MemoryPolicy().usable(budgets["device_memory"], budgets.get("host_memory") or box, budgets["disk"])
    _, d, h, k = pred
    if d > dev:
        return "over budget (predicted device bytes)"
    if h > host or (unified_memory(hw) and d + h > host):
        return "over budget (predicted host bytes)"
    if k > disk:
        return "over budget (predicted disk bytes)"
    return None


# ---- timing ----------------------------------------------------------------------------------

def _time_worker(w: Workload, plan_json: dict, steps: int, warmup: int, memory_limit: Optional[int]) -> dict:
    import torch

    from elixir import distributed as edist
    from elixir.optim import HybridAdam
    from elixir.plan import SearchResult
    from elixir.wrapper import ElixirModule, ElixirOptimizer

    rank = edist.get_rank()
    torch.manual_seed(0)
    em = ElixirModule(build_model(w), SearchResult.from_json(plan_json), prefetch=plan_json.get("prefetch_depth", 0) > 0,
                      memory_limit=memory_limit)
    opt = ElixirOptimizer(em, HybridAdam(em.parameters(), lr=1e-4))
    times = []
    for i in range(warmup + steps):
        edist.barrier()
        t0 = time.perf_counter()
        em(**make_batch(w, i, rank)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"times": times[warmup:]}


def time_plan(w: Workload, plan, world: int, steps: int, warmup: int, repeats: int, limit: Optional[int]) -> dict:
    from elixir.launch import run_distributed

    medians = []
    for _ in range(repeats):
        res = run_distributed(_time_worker, world, w, plan.to_json(), steps, warmup, limit, timeout=900)
        medians.append(statistics.median(res[0]["times"]))
    return {"median_s": statistics.median(medians), "spread_s": max(medians) - min(medians), "repeat_medians": medians}


def run_workload(w: Workload, world: int, hw, steps: int, warmup: int, repeats: int, say) -> dict:
    from elixir.search import DoesNotFitError

    try:
        found = candidate_plans(w, world, hw)
    except DoesNotFitError as e:  # reported, and the grid goes on
        say(f"  {w.name}: the search refused: {str(e).splitlines()[0]}")
        return {"name": w.name, "workload": dataclasses.asdict(w), "search_s": 0.0, "plans": [],
                "status": f"refused: {str(e).splitlines()[0]}", "regret": None, "best_plan": None, "prediction_error": None}
    plans, profile = found["plans"], found["profile"]
    budgets = _budgets(w, world)
    budget = budgets["device_memory"]
    rows = []
    for name, plan in plans.items():
        row: dict[str, Any] = {"plan": name}
        if isinstance(plan, str):  # did not fit, or is the search's own plan
            rows.append({**row, "status": plan})
            continue
        pred = predicted(plan, profile, world, hw)
        if plan.prediction:  # the search's own figure for the time (the same model, its own setting)
            pred = (plan.prediction.step_time_s,) + pred[1:]
        row.update(predicted_s=pred[0], predicted_peak_bytes=pred[1], predicted_host_bytes=pred[2],
                   predicted_disk_bytes=pred[3],
                   placements=plan.info.get("chunk_shardings") or plan.sharding_counts, cache_blocks=plan.cache_blocks)
        # the search's own plans (its pick, its runner-ups, its pure ZeRO-3 and ZeRO-1/2 answers)
        # fit its budgets by construction; the others are checked
        searched = name in ("search", "zero3", "zero12") or name.startswith("runner-up")
        why = None if searched else over_budget(pred, budgets, hw)
        if why:
            rows.append({**row, "status": why})
            continue
        try:
            row.update(time_plan(w, plan, world, steps, warmup, repeats, budget if w.budget_gib else None), status="ok")
        except Exception as e:  # a plan the runtime refused, or that failed: reported
            row["status"] = f"failed: {str(e).splitlines()[-1][:160]}"
        rows.append(row)
        say(f"  {w.name} {name}: {row.get('median_s', float('nan')):.3f} s ({row['status']})")
    out = {"name": w.name, "workload": dataclasses.asdict(w), "search_s": found["search_s"], "plans": rows}
    return {**out, **score(rows)}


def score(rows: list[dict]) -> dict:
    """Regret (1.0 when the search's plan is the fastest or within the larger of the two spreads
    of the fastest: a tie), the fastest plan, and the search's prediction error."""
    ok = [r for r in rows if r.get("status") == "ok"]
    mine = next(r for r in rows if r["plan"] == "search")
    if mine.get("status") != "ok":
        return {"regret": None, "best_plan": None, "prediction_error": None}
    best = min(ok, key=lambda r: r["median_s"])
    tie = mine["median_s"] - best["median_s"] <= max(mine["spread_s"], best["spread_s"])
    return {"regret": 1.0 if tie else mine["median_s"] / best["median_s"], "best_plan": best["plan"],
            "prediction_error": (mine["median_s"] - mine["predicted_s"]) / mine["median_s"]}


def summary(results: list[dict]) -> dict:
    regrets = [r["regret"] for r in results if r["regret"] is not None]
    errors = [abs(r["prediction_error"]) for r in results if r["prediction_error"] is not None]
    return {
        "median_regret": statistics.median(regrets) if regrets else None,
        "worst_regret": max(regrets) if regrets else None,
        "median_abs_prediction_error": statistics.median(errors) if errors else None,
        "worst_abs_prediction_error": max(errors) if errors else None,
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--smoke", action="store_true", help="one tiny workload, one repeat (seconds)")
    ap.add_argument("--only", nargs="*", default=(), help="workload names")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hardware", default=None, help="hardware profile (default: the search's own rule)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--merge", nargs="*", default=None, help="join these result files (slices of the grid)")
    ap.add_argument("--reprice", default=None, help="with --merge and --hardware (the profile the slices ran with): "
                    "the same measurements priced by another profile, and the plan its search picks")
    a = ap.parse_args(argv)
    if a.merge and a.reprice:
        return _reprice(a.merge, a.hardware, a.reprice, a.world, a.json)
    if a.merge:
        return _merge(a.merge, a.json)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks inherit it: no config chatter per launch
    from elixir.hardware import choose_default_profile, load_profile

    hw = load_profile(a.hardware) if a.hardware else choose_default_profile()[0]
    grid = SMOKE if a.smoke else tuple(w for w in GRID if (not a.quick or w.name in QUICK) and (not a.only or w.name in a.only))
    repeats = 1 if a.smoke else a.repeats
    t0 = time.perf_counter()
    results = []
    for w in grid:
        print(f"{w.name}: GPT-2 {w.n_layer}x{w.n_embd}, batch {w.batch} x seq {w.seq}, budget "
              f"{w.budget_gib or 'box'} GiB, disk {w.disk_gib} GiB", flush=True)
        results.append(run_workload(w, a.world, hw, 1 if a.smoke else a.steps, a.warmup, repeats,
                                    lambda s: print(s, flush=True)))
    out = {"hardware": hw.name, "world": a.world, **_provenance(), "load_average": os.getloadavg(), "wall_s": time.perf_counter() - t0,
           "summary": summary(results), "workloads": results}
    _report(out, a.json)
    return 0


def _provenance() -> dict:
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    return {"commit": commit, "finished_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def _report(out: dict, path: Optional[str]) -> None:
    print(f"\n{'workload':<14} {'regret':>7} {'best':>10} {'pred err':>9} {'search s':>9}")
    for r in out["workloads"]:
        reg = "-" if r["regret"] is None else f"{r['regret']:.3f}"
        err = "-" if r["prediction_error"] is None else f"{r['prediction_error']:+.2f}"
        print(f"{r['name']:<14} {reg:>7} {r.get('best_plan') or '-':>10} {err:>9} {r['search_s']:>9.2f}")
    print(json.dumps(out["summary"]), f"load average {out['load_average']}")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)


def _merge(paths: list[str], out_path: Optional[str]) -> int:
    """One summary from slices of the grid; each slice keeps its own hardware, load and wall time."""
    slices = [json.load(open(p)) for p in paths]
    hardware = {s["hardware"] for s in slices}
    if len(hardware) > 1:
        raise SystemExit(f"the slices used different hardware profiles {sorted(hardware)}: re-run them with one")
    results = [w for s in slices for w in s["workloads"]]
    out = {"hardware": hardware.pop(), "world": slices[0]["world"], "wall_s": sum(s["wall_s"] for s in slices),
           "load_average": max(s["load_average"][0] for s in slices), "summary": summary(results),
           "slices": [{"file": os.path.basename(p), "load_average": s["load_average"], "wall_s": s["wall_s"],
                       "workloads": [w["name"] for w in s["workloads"]]} for p, s in zip(paths, slices)],
           "workloads": results}
    _report(out, out_path)
    return 0


def _reprice(paths: list[str], measured_with: Optional[str], profile: str, world: int, out_path: Optional[str]) -> int:
    """The slices' measurements against another profile's predictions: each workload's candidate
    plans are rebuilt with the profile they ran with (the same plans, by name), priced with
    ``profile``, and the plan ``profile``'s search picks is found among them (its regret then
    comes from the same measurements; a pick that was not measured is reported as such)."""
    from elixir.hardware import load_profile
    from elixir.search.optimal import search_profile

    if not measured_with:
        raise SystemExit("--reprice needs --hardware: the profile the slices were measured with")
    old, new = load_profile(measured_with), load_profile(profile)
    rows = []
    for w_res in (w for p in paths for w in json.load(open(p))["workloads"]):
        w = next((x for x in GRID if x.name == w_res["name"]), None)
        measured = {r["plan"]: r for r in w_res["plans"] if r.get("status") == "ok"}
        if w is None or not measured:
            continue
        found = candidate_plans(w, world, old)
        priced = {n: predicted(p, found["profile"], world, new)[0] for n, p in found["plans"].items()
                  if not isinstance(p, str) and n in measured}
        pick = search_profile(found["profile"], world, hardware=new, overlap=True, **_budgets(w, world))
        twin = next((n for n, p in found["plans"].items() if not isinstance(p, str) and _same_plan(pick, p)), None)
        row = {"name": w.name, "pick": twin, "errors": {n: (measured[n]["median_s"] - t) / measured[n]["median_s"]
                                                       for n, t in priced.items()}}
        if twin in measured:
            mine = dict(measured[twin], plan="search", predicted_s=pick.prediction.step_time_s)
            row.update(score([mine] + [r for n, r in measured.items() if n != twin]))
        else:
            row.update(regret=None, best_plan=None, prediction_error=None, status="the pick was not measured")
        rows.append(row)
        print(f"{w.name:<14} pick {twin or '-':<12} regret {row['regret'] or '-'} error {row['prediction_error']}", flush=True)
    every = [abs(e) for r in rows for e in r["errors"].values()]
    out = {"measured_with": measured_with, "priced_with": profile, "summary": summary(rows),
           "all_plans_median_abs_error": statistics.median(every) if every else None,
           "all_plans_worst_abs_error": max(every) if every else None, "workloads": rows}
    print(json.dumps({k: v for k, v in out.items() if k != "workloads"}))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
