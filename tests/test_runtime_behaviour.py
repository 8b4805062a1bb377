"""Runtime behaviour beyond the training matrix: inference, eval, two modules, state dicts,
accounting, host placement, no_sync, budgets, plan validation, and the chunk-level parts."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from elixir import distributed as edist
from elixir.chunk import (
    BlockCache,
    Chunk,
    ChunkSpec,
    ChunkState,
    ElixirMemoryError,
    IllegalTransition,
    MemoryLedger,
    Schedule,
)
from elixir.search import ChunkPlan, SearchResult, minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.reference import default_optimizer, shard_batch, train_reference
from elixir.testing.zoo import ZOO, build_model
from elixir.wrapper import ElixirModule, ElixirOptimizer, PlanMismatch, StateDictMismatch


class Stack(nn.Module):
    """Eight identical layers: a uniform plan is easy to write by hand."""

    def __init__(self, dim: int = 16, depth: int = 8, classes: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def uniform_plan(model: nn.Module, world: int, per_chunk: int, cache_blocks: int, offload: bool = False) -> SearchResult:
    """Hand-written plan: ``per_chunk`` params per chunk, one chunk size (the largest need)."""
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    groups = [named[i : i + per_chunk] for i in range(0, len(named), per_chunk)]
    need = max(sum(torch.Size(s).numel() for _, s in g) for g in groups)
    size = -(-need // world) * world
    from elixir.search import Placement

    place = Placement.HOST if offload else Placement.DEVICE
    chunks = tuple(
        ChunkPlan(tuple(n for n, _ in g), tuple(s for _, s in g), size, shard_placement=place, optim_placement=place)
        for g in groups
    )
    return SearchResult(chunks=chunks, world_size=world, cache_blocks=cache_blocks)


def sgd(params):
    """SGD with momentum: linear in the gradients, so data-parallel rounding stays at 1e-7 (AdamW
    amplifies it in near-zero gradients; the matrix test handles that case)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _vec_batch(step: int, bs: int = 4):
    return ZOO["routed"].make_batch(bs, step)


def _ce(model, batch):
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def _train_stack(em, rank, world, steps=3):
    opt = ElixirOptimizer(em, sgd(list(em.parameters())))
    losses = []
    for step in range(steps):
        b = shard_batch(_vec_batch(step), rank, world)
        opt.zero_grad()
        loss = _ce(em, b)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        edist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _reference_stack(steps=3):
    torch.manual_seed(0)
    model = Stack()
    opt = sgd(list(model.parameters()))
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = _ce(model, _vec_batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _behaviour_worker() -> dict:
    from transformers import GPT2LMHeadModel

    rank, world = edist.get_rank(), edist.get_world_size()
    out: dict = {}

    # --- no_grad inference and eval mode: outputs equal the plain model, chunks released ---
    plain = build_model("gpt2", dropout=0.1)
    model = build_model("gpt2", dropout=0.1)
    em = ElixirModule(model, minimum_waste_search(model, world))
    batch = shard_batch(ZOO["gpt2"].make_batch(4, 0), rank, world)
    em.eval()
    plain.eval()
    with torch.no_grad():
        ref_logits = plain(input_ids=batch["input_ids"]).logits
        diffs, gathered = [], []
        for _ in range(3):
            logits = em(input_ids=batch["input_ids"]).logits
            diffs.append((logits - ref_logits).abs().max().item())
            gathered.append(em.memory_report()["gathered_bytes"])
    out["nograd_diff"] = max(diffs)
    out["nograd_gathered"] = gathered
    out["nograd_states"] = sorted({c.state.name for c in em.chunks if c.spec.sharded})
    # eval with grad: deterministic (dropout off) and equal to the plain model
    out["eval_diff"] = (em(input_ids=batch["input_ids"]).logits - plain(input_ids=batch["input_ids"]).logits).abs().max().item()

    # --- state dict round trip with a plain HF model (tied weights) ---
    sd = em.state_dict()
    fresh = GPT2LMHeadModel(plain.config)
    fresh.load_state_dict(sd, strict=True)
    ref_sd = plain.state_dict()
    out["sd_keys_equal"] = set(sd) == set(ref_sd)
    out["sd_max_diff"] = max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
    out["sd_tied_still_tied"] = fresh.lm_head.weight is fresh.transformer.wte.weight
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(0.5)
    em.load_state_dict(fresh.state_dict())
    back = em.state_dict()
    out["sd_back_diff"] = max((back[k] - v).abs().max().item() for k, v in fresh.state_dict().items())
    with torch.no_grad():  # forward after loading uses the loaded values
        out["sd_forward_diff"] = (em(input_ids=batch["input_ids"]).logits - fresh.eval()(input_ids=batch["input_ids"]).logits).abs().max().item()
    bad = dict(fresh.state_dict())
    bad.pop("transformer.h.0.ln_1.weight")
    bad["not.a.key"] = torch.zeros(1)
    try:
        em.load_state_dict(bad)
        out["sd_strict_error"] = ""
    except StateDictMismatch as e:
        out["sd_strict_error"] = str(e)
    out["sd_rank0_only_len"] = len(em.state_dict(rank0_only=True))

    # --- accounting on a uniform hand-written plan, device and host placement ---
    for offload in (False, True):
        torch.manual_seed(0)
        stack = Stack()
        plan = uniform_plan(stack, world, per_chunk=4, cache_blocks=2, offload=offload)
        em2 = ElixirModule(stack, plan)
        losses = _train_stack(em2, rank, world)
        rep = em2.memory_report()
        key = "host" if offload else "device"
        out[f"acct_{key}"] = {
            "report": rep,
            "plan_shard": plan.shard_bytes_per_rank(4),
            "plan_cache": plan.cache_bytes(4),
            "losses": losses,
            "state": em2.state_dict(),
        }

    # --- two ElixirModules in one process, trained in an interleaved loop ---
    torch.manual_seed(0)
    a = Stack()
    b_model = build_model("tied")
    ea = ElixirModule(a, uniform_plan(a, world, per_chunk=2, cache_blocks=1))
    eb = ElixirModule(b_model, minimum_waste_search(b_model, world))
    oa = ElixirOptimizer(ea, sgd(list(ea.parameters())))
    ob = ElixirOptimizer(eb, default_optimizer(list(eb.parameters())))
    la, lb = [], []
    torch.manual_seed(1)
    for step in range(3):
        oa.zero_grad()
        ob.zero_grad()
        xa = shard_batch(_vec_batch(step), rank, world)
        xb = shard_batch(ZOO["tied"].make_batch(4, step), rank, world)
        loss_a = _ce(ea, xa)
        loss_b = ZOO["tied"].loss(eb, xb)
        (loss_a + loss_b).backward()  # one backward through both
        oa.step()
        ob.step()
        for lst, v in ((la, loss_a), (lb, loss_b)):
            t = v.detach().clone()
            edist.all_reduce(t)
            lst.append(t.item() / world)
    out["two_losses"] = (la, lb)

    # --- no_sync: no collective while accumulating; k=2 micro-steps + 1 sync equal 3x batch ---
    torch.manual_seed(0)
    s3 = Stack()
    e3 = ElixirModule(s3, uniform_plan(s3, world, per_chunk=4, cache_blocks=2))
    o3 = ElixirOptimizer(e3, sgd(list(e3.parameters())))
    counts, grad_mem = [], []
    for step in range(2):
        o3.zero_grad()
        with e3.no_sync():
            with edist.count_collectives() as c:
                _ce(e3, shard_batch(_vec_batch(10 + step), rank, world)).backward()
                _ce(e3, shard_batch(_vec_batch(30 + step), rank, world)).backward()
        counts.append(sum(c.values()))
        grad_mem.append(e3.memory_report())
        _ce(e3, shard_batch(_vec_batch(20 + step), rank, world)).backward()
        o3.step()
    out["nosync_counts"] = counts
    out["nosync_grad_buffer_peak"] = grad_mem[0]["peak_grad_buffer_bytes"]
    out["nosync_state"] = e3.state_dict()

    # --- budget and plan validation errors ---
    torch.manual_seed(0)
    s4 = Stack()
    try:
        ElixirModule(s4, uniform_plan(s4, world, per_chunk=4, cache_blocks=2), memory_limit=64)
        out["budget_error"] = ""
    except ElixirMemoryError as e:
        out["budget_error"] = str(e)
    errors = []
    for bad_plan in (uniform_plan(Stack(), world + 1, 4, 2), minimum_waste_search(build_model("routed"), world)):
        try:
            ElixirModule(Stack(), bad_plan)
            errors.append("")
        except PlanMismatch as e:
            errors.append(str(e))
    out["plan_errors"] = errors
    return out


def _nosync_reference():
    torch.manual_seed(0)
    model = Stack()
    opt = sgd(list(model.parameters()))
    for step in range(2):
        opt.zero_grad()
        (_ce(model, _vec_batch(10 + step)) + _ce(model, _vec_batch(30 + step)) + _ce(model, _vec_batch(20 + step))).backward()
        opt.step()
    return model.state_dict()


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_runtime_behaviour_world2():
    res = run_distributed(_behaviour_worker, 2, timeout=300)
    r = res[0]
    assert r["nograd_diff"] < 1e-5 and r["eval_diff"] < 1e-5
    assert r["nograd_gathered"] == [0, 0, 0] and r["nograd_states"] == ["RELEASED"]
    assert r["sd_keys_equal"] and r["sd_max_diff"] == 0.0 and r["sd_tied_still_tied"]
    assert r["sd_back_diff"] == 0.0 and r["sd_forward_diff"] < 1e-5
    assert "transformer.h.0.ln_1.weight" in r["sd_strict_error"] and "not.a.key" in r["sd_strict_error"]
    assert r["sd_rank0_only_len"] > 0 and res[1]["sd_rank0_only_len"] == 0

    ref_losses, ref_state = _reference_stack()
    for key in ("device", "host"):
        a = r[f"acct_{key}"]
        rep = a["report"]
        assert rep["shard_bytes"] == a["plan_shard"]
        assert rep[f"shard_{key}_bytes"] == a["plan_shard"]
        assert rep["cache_bytes"] == a["plan_cache"]
        assert rep["peak_gathered_bytes"] == a["plan_cache"]  # LRU fills both blocks, never more
        assert rep["gathered_bytes"] == 0  # released after the optimizer step
        assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a["losses"], ref_losses)), (a["losses"], ref_losses)
        for k, v in ref_state.items():
            assert _close(a["state"][k], v), k

    la, lb = r["two_losses"]
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(la, ref_losses))
    ref_b = train_reference(ZOO["tied"], steps=3, batch_size=4)
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(lb, ref_b.losses)), (lb, ref_b.losses)

    assert r["nosync_counts"] == [0, 0]
    assert r["nosync_grad_buffer_peak"] > 0
    ref_ns = _nosync_reference()
    for k, v in ref_ns.items():
        assert _close(r["nosync_state"][k], v), k

    assert "budget" in r["budget_error"]
    assert "made for a mesh of dp_shard 3 (3 ranks) but this run is a mesh of dp_shard 2" in r["plan_errors"][0]
    assert "not in the plan" in r["plan_errors"][1] or "does not have" in r["plan_errors"][1]


# ---------------------------------------------------------------------------------------------
# chunk-level parts (single process)


def _chunk(capacity=8, world=1, ledger=None):
    c = Chunk(ChunkSpec(0, capacity, True, world, 0), ledger or MemoryLedger())
    c.init_from(torch.arange(capacity, dtype=torch.float32))
    c.release()
    return c


def test_chunk_states_are_checked():
    c = _chunk()
    assert c.state is ChunkState.RELEASED and c.payload.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError):
        c.pin()  # cannot pin what is not gathered
    c.gather()
    c.pin()
    with pytest.raises(IllegalTransition):
        c.release()  # pinned (COMPUTE) -> RELEASED is illegal
    c.unpin()
    c.release()
    assert c.ledger.bytes("gathered") == 0 and c.ledger.bytes("gathered", peak=True) == 32


def test_gather_restores_values_in_the_same_storage():
    c = _chunk()
    c.gather()
    view = c.payload[2:5]  # a view taken while gathered, as autograd would save
    c.release()
    c.gather()
    assert view.tolist() == [2.0, 3.0, 4.0]
    c.release()
    c.master.mul_(2)  # the optimizer updated the shard
    c.gather()
    assert view.tolist() == [4.0, 6.0, 8.0]


def test_cache_lru_and_belady_eviction():
    ledger = MemoryLedger()
    chunks = []
    for i in range(3):
        ch = Chunk(ChunkSpec(i, 4, True, 1, 0), ledger)
        ch.init_from(torch.zeros(4))
        ch.release()
        chunks.append(ch)
    cache = BlockCache(2)
    cache.acquire(chunks[0])
    cache.acquire(chunks[1])
    cache.acquire(chunks[2])  # LRU evicts chunk 0
    assert chunks[0].state is ChunkState.RELEASED and chunks[1].is_gathered
    cache = BlockCache(2)
    for ch in chunks:
        ch.release() if ch.is_gathered else None
    cache.acquire(chunks[0])
    cache.acquire(chunks[1])
    next_use = {0: 1.0, 1: 5.0, 2: 0.0}
    cache.acquire(chunks[2], lambda ch: next_use[ch.index])  # Belady evicts chunk 1 (furthest)
    assert chunks[1].state is ChunkState.RELEASED and chunks[0].is_gathered
    # all pinned: strict raises, lenient goes over capacity with one warning
    for ch in (chunks[0], chunks[2]):
        ch.pin()
    strict = BlockCache(2, strict=True)
    strict.resident = cache.resident
    with pytest.raises(ElixirMemoryError):
        strict.acquire(chunks[1])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cache.acquire(chunks[1])
    assert len(cache.resident) == 3 and any("rCache" in str(x.message) for x in w)


def test_schedule_follows_and_detects_drift():
    s = Schedule([frozenset({0}), frozenset({0}), frozenset(), frozenset({1}), frozenset({2}), frozenset({0})], lookahead=2)
    assert s.steps == [frozenset({0}), frozenset({1}), frozenset({2}), frozenset({0})]
    assert s.observe(frozenset({0}))
    assert s.upcoming() == [1, 2]
    assert s.next_use(2) == 2 and s.next_use(0) == 3 and s.next_use(7) == float("inf")
    assert s.observe(frozenset({2}))  # skipping one step is tolerated
    assert not s.observe(frozenset({5})) and s.drifted and not s.active
    s.restart()
    assert s.active and s.observe(frozenset({0}))


def test_ledger_budget_names_the_fix():
    ledger = MemoryLedger(device_limit=100)
    ledger.alloc("shard", "device", 60)
    ledger.alloc("shard", "host", 1000)  # host memory is not budgeted
    with pytest.raises(ElixirMemoryError, match="budget"):
        ledger.alloc("gathered", "device", 60)

