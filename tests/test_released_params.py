"""Issue 36's runtime defects: what used to segfault or abort now raises a named error or works
like DDP (item 2: the user's model read after wrapping, a second wrap; item 4: a parameter handed
from a module to its children; item 5: a parameter used on one rank only; item 10: un-freezing
after wrapping, and a LoRA plan's rCache under ``no_sync``). One world-2 launch runs every case."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from elixir import distributed as edist
from elixir.search import minimum_waste_search
from elixir.testing import run_distributed
from elixir.testing.zoo import FrozenLoRA
from elixir.wrapper import ElixirModule, ElixirOptimizer

STEPS = 3


class HandsDown(nn.Module):
    """DeBERTa-v2's pattern: the parent reads a child's weight directly (never calling the child)
    and hands it to every layer, which uses it in its own forward."""

    def __init__(self, dim: int = 16, depth: int = 3, classes: int = 8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)
        self.rel = nn.Embedding(4, dim)  # packed last: its chunk is released when the forward starts

    def forward(self, x):
        rel = self.norm(self.rel.weight)  # read outside rel's own call
        for layer in self.layers:
            x = torch.tanh(layer(x) + rel.mean(0))
        return self.head(x)


class OneRankBranch(nn.Module):
    """``extra`` runs only where ``use_extra`` is true (on rank 0 only in the test)."""

    def __init__(self, dim: int = 16, classes: int = 8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.extra = nn.Linear(dim, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x, use_extra: bool = False):
        h = torch.tanh(self.inp(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(torch.tanh(self.mid(h)))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randint(0, 8, (4,), generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _ddp_and_elixir(build, plan_fn, forward_kw=lambda rank: {}, find_unused=False):
    """Train a DDP copy and an ElixirModule on the same per-rank batches; (ddp, elixir) losses and weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = edist.get_rank()
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    ddp = DDP(ref, find_unused_parameters=find_unused)
    opt = _sgd(ref.parameters())
    ddp_losses = []
    for s in range(STEPS):
        x, y = _batch(s, rank)
        loss = F.cross_entropy(ddp(x, **forward_kw(rank)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ddp_losses.append(loss.item())
    em = ElixirModule(model, plan_fn(model))
    eo = ElixirOptimizer(em, _sgd(em.parameters()))
    losses = []
    for s in range(STEPS):
        x, y = _batch(s, rank)
        loss = F.cross_entropy(em(x, **forward_kw(rank)), y)
        loss.backward()
        eo.step()
        eo.zero_grad()
        losses.append(loss.item())
    sd = em.state_dict()
    ref_sd = {k: v.detach() for k, v in ref.state_dict().items()}
    worst = max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
    return ddp_losses, losses, worst, em


def _small_chunks(model):
    """Many sharded chunks and a one-block rCache, so a chunk is released between uses."""
    plan = minimum_waste_search(model, edist.get_world_size(), max_chunk_size=300)
    return plan


def _deberta():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification  # optional dependency

    cfg = DebertaV2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=32, max_position_embeddings=32, relative_attention=True,
                          position_buckets=8, norm_rel_ebd="layer_norm", pos_att_type=["p2c", "c2p"],
                          num_labels=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return DebertaV2ForSequenceClassification(cfg)


class _Logits(nn.Module):
    """An HF classifier called on token ids, returning its logits (the tests' loss takes a tensor)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        ids = (x[:, :8].abs() * 10).long() % 64
        return self.inner(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _one_chunk(model):
    """Every parameter in one sharded chunk: gathered on every rank for the whole forward, so the
    branch taken on one rank only issues no gather of its own (see docs/reliability.md)."""
    from elixir.search import ChunkPlan, SearchResult

    named = list(model.named_parameters())
    size = sum(p.numel() for _, p in named)
    size += -size % 2
    chunk = ChunkPlan(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named), size)
    return SearchResult(chunks=(chunk,), world_size=2, cache_blocks=1)


def _errors(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reports the type and message
        return f"{type(e).__name__}: {e}"
    return ""


def _all_cases() -> dict:
    out: dict = {}
    rank = edist.get_rank()
    # item 2: the user's own model after wrapping, and after training
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
    em = ElixirModule(model, minimum_waste_search(model, 2))
    w = model[0].weight
    out["released_sum"] = _errors(lambda: w.sum())
    out["released_state_dict"] = _errors(lambda: model.state_dict())
    out["released_deepcopy"] = _errors(lambda: copy.deepcopy(model))
    out["released_meta"] = (tuple(w.shape), w.dtype, w.requires_grad, isinstance(w, nn.Parameter))
    eo = ElixirOptimizer(em, _sgd(em.parameters()))
    x, y = _batch(0, rank)
    F.cross_entropy(em(x), y).backward()
    eo.step()
    out["trained_state_dict"] = _errors(lambda: model.state_dict())
    out["wrapper_state_dict"] = sorted(em.state_dict())
    # item 2: a second wrap
    out["rewrap_wrapper"] = _errors(lambda: ElixirModule(em, minimum_waste_search(model, 2)))
    out["rewrap_model"] = _errors(lambda: ElixirModule(model, minimum_waste_search(model, 2)))
    # item 4: a weight handed from the parent to the layers
    d_losses, e_losses, worst, em4 = _ddp_and_elixir(HandsDown, _small_chunks)
    out["handed"] = (d_losses, e_losses, worst, len(em4.chunks), sorted(em4._access.names))
    # item 4 on the model it was found with: DeBERTa-v2's relative attention
    d_losses, e_losses, worst, em4 = _ddp_and_elixir(lambda: _Logits(_deberta()), _small_chunks)
    out["deberta"] = (d_losses, e_losses, worst, len(em4.chunks), sorted(em4._access.names))
    # item 5: a parameter used on rank 0 only
    d_losses, e_losses, worst, _ = _ddp_and_elixir(
        OneRankBranch, _one_chunk, lambda r: {"use_extra": r == 0}, find_unused=True)
    out["one_rank"] = (d_losses, e_losses, worst)
    # item 10: un-freezing a parameter after wrapping
    torch.manual_seed(0)
    lora = FrozenLoRA()
    em10 = ElixirModule(lora, minimum_waste_search(lora, 2))
    eo10 = ElixirOptimizer(em10, _sgd([p for p in em10.parameters() if p.requires_grad]))
    lora.base1.weight.requires_grad_(True)
    out["unfreeze"] = _errors(lambda: em10(_batch(0, rank)[0]))
    del eo10
    # item 10: a LoRA plan made for accumulation runs no_sync within its rCache (a plain one does not)
    for accumulation in (True, False):
        torch.manual_seed(0)
        lora = FrozenLoRA()
        plan = minimum_waste_search(lora, 2, max_chunk_size=300, accumulation=accumulation)
        em_acc = ElixirModule(lora, plan, strict_cache=True)
        eo_acc = ElixirOptimizer(em_acc, _sgd([p for p in em_acc.parameters() if p.requires_grad]))

        def micro_steps(em_acc=em_acc, eo_acc=eo_acc):
            with em_acc.no_sync():
                F.cross_entropy(em_acc(_batch(0, rank)[0]), _batch(0, rank)[1]).backward()
            F.cross_entropy(em_acc(_batch(1, rank)[0]), _batch(1, rank)[1]).backward()
            eo_acc.step()

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out[f"no_sync_cache_{accumulation}"] = _errors(micro_steps)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, 2, timeout=240)


@pytest.mark.dist
def test_reading_the_wrapped_model_raises_a_named_error(results):
    for r in results:
        for key in ("released_sum", "released_state_dict", "released_deepcopy", "trained_state_dict"):
            assert r[key].startswith("ReleasedParameterError"), (key, r[key])
            assert "ElixirModule.state_dict()" in r[key] and "0.weight" in r[key], r[key]
        assert r["released_meta"] == ((16, 16), torch.float32, True, True)
        assert r["wrapper_state_dict"] == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.dist
def test_wrapping_twice_is_a_type_error(results):
    for r in results:
        assert r["rewrap_wrapper"].startswith("TypeError") and "cannot be wrapped again" in r["rewrap_wrapper"]
        assert r["rewrap_model"].startswith("TypeError") and "already held" in r["rewrap_model"]


@pytest.mark.dist
def test_a_weight_handed_to_children_trains_like_ddp(results):
    for r in results:
        d_losses, e_losses, worst, n_chunks, names = r["handed"]
        assert n_chunks > 1  # the handed weight's chunk is released between uses
        assert names == ["rel.weight"]
        torch.testing.assert_close(torch.tensor(e_losses), torch.tensor(d_losses), rtol=1e-5, atol=1e-6)
        assert worst < 1e-5


@pytest.mark.dist
def test_deberta_v2_relative_attention_trains_like_ddp(results):
    for r in results:
        d_losses, e_losses, worst, n_chunks, names = r["deberta"]
        assert n_chunks > 1
        assert set(names) <= {"inner.deberta.encoder.rel_embeddings.weight"}  # gathered by the LayerNorm's chunk, or on access
        torch.testing.assert_close(torch.tensor(e_losses), torch.tensor(d_losses), rtol=1e-5, atol=1e-6)
        assert worst < 1e-5


@pytest.mark.dist
def test_a_parameter_used_on_one_rank_trains_like_ddp_find_unused(results):
    for r in results:
        d_losses, e_losses, worst = r["one_rank"]
        torch.testing.assert_close(torch.tensor(e_losses), torch.tensor(d_losses), rtol=1e-5, atol=1e-6)
        assert worst < 1e-5


@pytest.mark.dist
def test_unfreezing_after_wrapping_raises_naming_the_parameter(results):
    for r in results:
        assert r["unfreeze"].startswith("RuntimeError"), r["unfreeze"]
        assert "base1.weight" in r["unfreeze"] and "re-run the search" in r["unfreeze"]


@pytest.mark.dist
def test_an_accumulation_plan_holds_no_sync_within_its_cache(results):
    for r in results:
        assert r["no_sync_cache_True"] == "", r["no_sync_cache_True"]
        assert r["no_sync_cache_False"].startswith("ElixirMemoryError"), r["no_sync_cache_False"]


def test_accumulation_counts_the_chunks_no_sync_holds():
    lora = FrozenLoRA()
    plain = minimum_waste_search(lora, 2, max_chunk_size=300)
    acc = minimum_waste_search(lora, 2, max_chunk_size=300, accumulation=True)
    trainable = sum(c.sharded for c in acc.chunks)
    assert trainable >= 1 and any(c.sharded for c in acc.frozen_chunks)
    assert acc.cache_blocks >= trainable + 1 and acc.cache_blocks > plain.cache_blocks  # + a step's frozen chunks
    assert acc.chunks == plain.chunks and acc.frozen_chunks == plain.frozen_chunks
