"""Adapter fine-tuning: PEFT LoRA models and a frozen-backbone classifier, with every frozen
parameter in frozen chunks (sharded, gathered for use, never reduced, no master, no optimizer
state), against plain PEFT on the full batch in one process and torch DDP in the same run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from elixir import checkpoint  # noqa: E402
from elixir import distributed as edist  # noqa: E402
from elixir.search import minimum_waste_search  # noqa: E402
from elixir.testing import run_distributed  # noqa: E402
from elixir.testing.reference import default_optimizer, shard_batch, train_reference, train_wrapped  # noqa: E402
from elixir.testing.zoo import ZooCase, _lm_loss, _token_batch, build_model  # noqa: E402
from elixir.wrapper import ElixirModule, ElixirOptimizer  # noqa: E402
from tests.lora_cases import CASES, TARGETS  # noqa: E402

STEPS = 3
BATCH = 4


def _frozen(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _ddp_run(case: ZooCase, model: nn.Module) -> dict[str, torch.Tensor]:
    """torch DDP on the same batches, in the same processes: its trained adapter weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = edist.get_rank(), edist.get_world_size()
    ddp = DDP(model)
    opt = default_optimizer([p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        batch = shard_batch(case.make_batch(BATCH, step), rank, world)
        opt.zero_grad()
        case.loss(ddp, batch).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _train(name: str, tmp: str) -> dict:
    case = CASES[name]
    world = edist.get_world_size()
    model = case.build()
    twin = copy.deepcopy(model)
    before = _frozen(model)
    names = _trainable_names(model)
    plan = minimum_waste_search(model, world)
    em = ElixirModule(model, plan)
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    run = train_wrapped(case, em, opt, steps=STEPS, batch_size=BATCH)
    mem = em.memory_report()
    ledger = {c: em.ledger.bytes(c, peak=True) for c in ("shard", "master", "frozen_shard", "grad_buffer", "shard_grad")}
    frozen_chunks = [(c.spec.capacity, c.spec.shard_numel, c.spec.sharded, c.master is None, c.grad_buffer is None,
                      c.shard_grad is None) for c in em.frozen_chunks]
    trainable_caps = [(c.spec.capacity, c.spec.shard_numel) for c in em.chunks]
    sd = em.state_dict()
    out = {
        "losses": run.losses, "adapters": {n: sd[n] for n in names}, "frozen_same": all(
            torch.equal(sd[n], v) for n, v in before.items() if n in sd),
        "frozen_keys": sorted(set(before) & set(sd)), "mem": mem, "ledger": ledger, "frozen_chunks": frozen_chunks,
        "trainable_caps": trainable_caps, "ddp": _ddp_run(case, twin),
    }
    out["resume"] = _resume(case, plan, tmp)
    return out


def _resume(case: ZooCase, plan, tmp: str) -> dict:
    """Checkpoint after 2 steps, train a third; a fresh wrap loads it and trains the same third step."""
    rank, world = edist.get_rank(), edist.get_world_size()

    def wrap():
        em = ElixirModule(case.build(), plan)
        return em, ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))

    def one(em, opt, step):
        batch = shard_batch(case.make_batch(BATCH, step), rank, world)
        opt.zero_grad()
        loss = case.loss(em, batch)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        edist.all_reduce(t)
        return t.item() / world

    em, opt = wrap()
    for s in range(2):
        one(em, opt, s)
    checkpoint.save(f"{tmp}/full", em, opt)
    checkpoint.save(f"{tmp}/adapters", em, opt, frozen=False)
    checkpoint.save(f"{tmp}/hf", em, opt, shard=False, frozen=False)
    want = one(em, opt, 2)
    want_sd = em.state_dict()
    got = {}
    for kind in ("full", "adapters", "hf"):
        em2, opt2 = wrap()
        if kind == "full":  # scramble the frozen weights first: the full checkpoint restores them
            for c in em2.frozen_chunks:
                c.shard.add_(1.0)
        checkpoint.load(f"{tmp}/{kind}", em2, opt2)
        loss = one(em2, opt2, 2)
        sd = em2.state_dict()
        got[kind] = (loss == want, all(torch.equal(sd[k], want_sd[k]) for k in want_sd))
    return got


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_lora_matches_plain_peft_and_ddp(world, tmp_path):
    names = list(CASES)
    for n in names:
        (tmp_path / n).mkdir()
    results = run_distributed(_worker, world, names, str(tmp_path), timeout=600)
    errors = []
    for name, got in zip(names, results[0]):
        case = CASES[name]
        ref = train_reference(case, steps=STEPS, batch_size=BATCH, model=case.build())
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref.losses), rtol=1e-5, atol=0)
        ddp_err = max((got["ddp"][n] - ref.state_dict[n]).abs().max().item() for n in got["adapters"])
        our_err = max((got["adapters"][n] - ref.state_dict[n]).abs().max().item() for n in got["adapters"])
        if our_err > 2 * ddp_err + 1e-6:
            errors.append(f"{name}: adapters off by {our_err:.3g}, DDP by {ddp_err:.3g}")
        if not got["frozen_same"] or not got["frozen_keys"]:
            errors.append(f"{name}: frozen weights changed")
        for kind, (loss_ok, state_ok) in got["resume"].items():
            if not (loss_ok and state_ok):
                errors.append(f"{name}: resume from the {kind} checkpoint is not exact ({loss_ok}, {state_ok})")
        _check_memory(name, got, world, errors)
    assert not errors, "\n".join(errors)


def _check_memory(name: str, got: dict, world: int, errors: list) -> None:
    """A frozen chunk costs each rank its shard (booked as frozen_shard) and nothing else."""
    fc = got["frozen_chunks"]
    if not fc:
        errors.append(f"{name}: no frozen chunks")
        return
    for cap, shard, sharded, no_master, no_grad, no_shard_grad in fc:
        if not (no_master and no_grad and no_shard_grad):
            errors.append(f"{name}: a frozen chunk holds a master or gradient")
        if world == 2 and (not sharded or shard * 2 != cap):
            errors.append(f"{name}: a frozen chunk is not split in two at world size 2")
    frozen_bytes = sum(shard for _, shard, *_ in fc) * 4
    led = got["ledger"]
    if led["frozen_shard"] != frozen_bytes or got["mem"]["frozen_shard_bytes"] != frozen_bytes:
        errors.append(f"{name}: frozen shards booked {led['frozen_shard']} B, expected {frozen_bytes} B")
    trainable = got["trainable_caps"]
    # masters and gradients exist for trainable chunks only (fp32, device: the master is the shard)
    if led["master"] != 0 or led["shard"] != sum(s for _, s in trainable) * 4:
        errors.append(f"{name}: trainable state {led} does not match the trainable chunks {trainable}")
    if led["grad_buffer"] > sum(c for c, _ in trainable) * 4 or led["shard_grad"] > sum(s for _, s in trainable) * 4:
        errors.append(f"{name}: gradient bytes {led} exceed the trainable chunks' {trainable}")


def _worker(names: list, tmp: str) -> list:
    return [_train(n, f"{tmp}/{n}") for n in names]


def _searched(name: str, tight: bool) -> dict:
    """optimal_search prices frozen chunks (weights only, gathered, never reduced); the runtime
    books exactly the frozen bytes the search predicted."""
    from elixir.hardware import load_profile
    from elixir.search import DoesNotFitError, optimal_search

    case = CASES[name]
    world = edist.get_world_size()
    model = case.build()
    kw = dict(hardware=load_profile("cpu-box"), host_memory=1 << 30, inp=case.make_batch(BATCH // world, 0),
              step_fn=case.step_fn, process_bytes=0)
    device = 1 << 30
    if tight:  # the least device memory that fits: the frozen shards move to the host
        try:
            optimal_search(model, world, device_memory=1, **kw)
            raise AssertionError("a 1-byte budget fitted")
        except DoesNotFitError as e:
            device = e.needs["device_memory"]
    plan = optimal_search(model, world, device_memory=device, **kw)
    em = ElixirModule(model, plan)
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    run = train_wrapped(case, em, opt, steps=STEPS, batch_size=BATCH)
    mem = em.memory_report()
    return {"losses": run.losses, "predicted": plan.info["predicted_memory"], "frozen_where": [
        c.shard_placement.value for c in plan.frozen_chunks], "frozen_ledger": em.ledger.bytes("frozen_shard", peak=True),
        "frozen_host": mem["frozen_shard_host_bytes"], "gathered_peak": mem["peak_gathered_bytes"],
        "frozen_params": plan.frozen_params}


def _search_worker(cases: list) -> list:
    return [_searched(n, t) for n, t in cases]


@pytest.mark.dist
def test_search_prices_frozen_chunks_as_the_runtime_books_them():
    cases = [("llama-lora", False), ("llama-lora", True), ("classifier", False)]
    results = run_distributed(_search_worker, 2, cases, timeout=600)
    for (name, tight), got in zip(cases, results[0]):
        case = CASES[name]
        ref = train_reference(case, steps=STEPS, batch_size=BATCH, model=case.build())
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref.losses), rtol=1e-5, atol=0)
        assert got["frozen_where"] and not got["frozen_params"], got
        # each rank holds exactly its shard of every frozen chunk, as predicted
        assert got["predicted"]["frozen_shards"] == got["frozen_ledger"] > 0, got
        assert got["gathered_peak"] <= got["predicted"]["rcache"], got
        if tight:
            assert set(got["frozen_where"]) == {"host"} and got["frozen_host"] == got["frozen_ledger"], got


def _load_base(path: str) -> dict:
    from elixir.checkpoint import load_pretrained

    model = CASES["gpt2-lora"].build()
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    em = ElixirModule(model, minimum_waste_search(model, edist.get_world_size()))
    report = load_pretrained(path, em)
    sd = em.state_dict()
    return {"sd": sd, "adapters": adapters, "missing": report.missing_keys, "unexpected": report.unexpected_keys,
            "frozen_shard": em.ledger.bytes("frozen_shard"), "frozen_chunks": len(em.frozen_chunks)}


@pytest.mark.dist
def test_load_pretrained_streams_the_base_into_frozen_chunks(tmp_path):
    """The base model's HF checkpoint fills a LoRA model's frozen chunks (PEFT names mapped to
    the base names); the adapters keep their initial values and are not reported missing."""
    base = build_model("gpt2", seed=5)  # other weights than the LoRA model's own base
    base.save_pretrained(tmp_path / "base")
    got = run_distributed(_load_base, 2, str(tmp_path / "base"), timeout=300)[0]
    assert got["frozen_chunks"] and not got["missing"] and not got["unexpected"], got["missing"]
    saved = base.state_dict()
    n_frozen = 0
    for k, v in got["sd"].items():
        if k in got["adapters"]:
            assert torch.equal(v, got["adapters"][k]), k
            continue
        bk = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if bk in saved:
            assert torch.equal(v, saved[bk]), k
            n_frozen += 1
    assert n_frozen >= len(saved) - 2  # every base tensor (the tied head counted once)


def test_meta_built_lora_model_starts_as_peft_builds_it(tmp_path):
    """A LoRA model built on meta materialises chunk by chunk with PEFT's own adapter init
    (lora_B zero), and load_pretrained streams the base into its frozen chunks: its first loss is
    the base model's."""
    from elixir.checkpoint import load_pretrained

    base = build_model("llama", seed=3)
    base.save_pretrained(tmp_path / "base")
    with torch.device("meta"):
        meta = build_model("llama")
    model = get_peft_model(meta, LoraConfig(r=4, target_modules=TARGETS["llama"], lora_dropout=0.0))
    em = ElixirModule(model, minimum_waste_search(model, 1))
    report = load_pretrained(str(tmp_path / "base"), em)
    assert not report.missing_keys and not report.unexpected_keys
    sd = em.state_dict()
    lora_b = [k for k in sd if "lora_B" in k]
    assert lora_b and all(not sd[k].any() for k in lora_b)
    assert all(sd[k].abs().sum() > 0 for k in sd if "lora_A" in k)
    batch = _token_batch(BATCH, 0)
    with torch.no_grad():
        assert _lm_loss(em, batch).item() == _lm_loss(base, batch).item()


def test_frozen_base_left_uninitialised_when_a_checkpoint_overwrites_it(tmp_path):
    """ElixirModule(..., init_frozen=False): a meta-built LoRA model's frozen base starts at zero
    (no initialiser runs for it), the adapters get the values they get with it, and after
    load_pretrained the model is exactly the one built with every initialiser run."""
    from elixir.checkpoint import load_pretrained

    base = build_model("llama", seed=3)
    base.save_pretrained(tmp_path / "base")
    got = {}
    for init in (True, False):
        with torch.device("meta"):
            meta = build_model("llama")
        model = get_peft_model(meta, LoraConfig(r=4, target_modules=TARGETS["llama"], lora_dropout=0.0))
        em = ElixirModule(model, minimum_waste_search(model, 1), init_seed=7, init_frozen=init)
        before = em.state_dict()
        frozen = [n for n, p in em.named_parameters() if not p.requires_grad]
        report = load_pretrained(str(tmp_path / "base"), em)
        assert not report.missing_keys and not report.unexpected_keys
        got[init] = (before, em.state_dict(), frozen)
    (b_init, sd_init, frozen), (b_skip, sd_skip, _) = got[True], got[False]
    names = [n.removeprefix("module.") for n in frozen if n.removeprefix("module.") in b_skip]
    assert len(names) == len(frozen) > 0, (frozen[:3], list(b_skip)[:3])
    assert all(not b_skip[n].any() for n in names)
    assert any(b_init[n].any() for n in names)  # the initialisers did run with init_frozen
    assert all(torch.equal(b_skip[k], b_init[k]) for k in b_skip if "lora_" in k)
    assert sd_skip.keys() == sd_init.keys() and all(torch.equal(sd_skip[k], sd_init[k]) for k in sd_init)


def test_merge_and_unload_on_the_gathered_model():
    """merge_and_unload works on the gathered state (a plain PEFT model on rank 0), not on the
    wrapped model: the merged model computes what the trained wrapped one does."""
    case = CASES["llama-lora"]
    em = ElixirModule(case.build(), minimum_waste_search(case.build(), 1))
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    train_wrapped(case, em, opt, steps=2, batch_size=BATCH)
    plain = case.build()
    plain.load_state_dict(em.state_dict())
    merged = plain.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    batch = _token_batch(BATCH, 5)
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, em(**batch).logits, rtol=1e-5, atol=1e-5)


def _frozen_backbone_rise(fields: dict) -> dict:
    """Peak RSS rise (VmHWM) of wrapping a frozen LLaMA backbone built on meta, on this rank."""
    import ctypes

    from transformers import LlamaConfig, LlamaForSequenceClassification

    from elixir import device as dev

    with torch.device("meta"):
        model = LlamaForSequenceClassification(LlamaConfig(num_labels=2, pad_token_id=0, tie_word_embeddings=False,
                                                           **fields))
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("score"))
    plan = minimum_waste_search(model, edist.get_world_size())
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS
    before = dev.rss_bytes()
    em = ElixirModule(model, plan, init_seed=1)
    peak = dev.peak_rss_bytes()
    frozen = sum(c.spec.capacity for c in em.frozen_chunks) * 4
    return {"rise": peak - before, "frozen": frozen, "chunk": max(c.spec.capacity for c in em.frozen_chunks) * 4,
            "held": em.ledger.bytes("frozen_shard")}


def check_frozen_backbone_rss(fields: dict) -> list[dict]:
    """At world size 2 each rank's peak RSS rises by about half the frozen backbone: its shards,
    plus construction staging (the flat chunk being assembled and its payload: two chunks) and
    allocator slack, never the whole backbone."""
    results = run_distributed(_frozen_backbone_rise, 2, fields, timeout=1800)
    for r in results:
        assert r["held"] * 2 == r["frozen"], r
        assert r["rise"] >= 0.45 * r["frozen"], r
        assert r["rise"] <= 0.5 * r["frozen"] + 3 * r["chunk"] + (64 << 20), r
    return results


@pytest.mark.slow
@pytest.mark.dist
def test_frozen_1b_backbone_on_meta_costs_each_rank_half_its_bytes():
    """About 1.1B frozen parameters (4.4 GB in fp32): each of 2 ranks peaks near 2.2 GB more."""
    check_frozen_backbone_rss(dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                   num_attention_heads=32, num_key_value_heads=4))


def test_frozen_chunks_stay_in_bf16_with_no_fp32_copy(tmp_path):
    """A bf16 model: frozen chunks hold the bf16 weights as loaded (bitwise), no master, 2 bytes
    per element in the ledger; only the adapters have fp32 masters."""
    from elixir.checkpoint import load_pretrained

    base = build_model("llama", seed=4).to(torch.bfloat16)
    base.save_pretrained(tmp_path / "base")
    model = CASES["llama-lora"].build()
    em = ElixirModule(model, minimum_waste_search(model, 1, unified_dtype=torch.bfloat16), dtype=torch.bfloat16)
    load_pretrained(str(tmp_path / "base"), em)
    assert em.frozen_chunks and all(c.shard.dtype == torch.bfloat16 and c.master is None for c in em.frozen_chunks)
    assert em.ledger.bytes("frozen_shard") == sum(c.spec.capacity for c in em.frozen_chunks) * 2
    assert all(c.master.dtype == torch.float32 for c in em.chunks)
    sd, saved = em.state_dict(), base.state_dict()
    for k, v in sd.items():
        bk = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if "lora_" not in k and bk in saved:
            assert v.dtype == torch.bfloat16 and torch.equal(v, saved[bk]), k
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    before = {k: v for k, v in sd.items() if "lora_" not in k}
    train_wrapped(CASES["llama-lora"], em, opt, steps=2, batch_size=BATCH)
    after = em.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_peft_save_pretrained_writes_the_trained_adapters(tmp_path):
    """PEFT's own save_pretrained on the wrapped PeftModel (given the gathered state, which the
    guard supplies at world size 1) writes adapter_model.safetensors that PeftModel.from_pretrained
    loads onto a plain base: the trained adapters, nothing else."""
    from peft import PeftModel

    case = CASES["llama-lora"]
    em = ElixirModule(case.build(), minimum_waste_search(case.build(), 1))
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    train_wrapped(case, em, opt, steps=2, batch_size=BATCH)
    em.module.save_pretrained(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    back = PeftModel.from_pretrained(build_model("llama"), str(tmp_path / "adapter"))
    sd, mine = back.state_dict(), em.state_dict()
    names = [n for n, p in em.module.named_parameters() if p.requires_grad]
    assert names and all(torch.equal(sd[n], mine[n]) for n in names)


def _disk_frozen(tmp: str) -> dict:
    """A tight budget with disk allowed: the search streams the frozen shards from disk (read for
    each gather, never written back); training matches, and no frozen byte stays resident."""
    from elixir.hardware import load_profile
    from elixir.search import DoesNotFitError, optimal_search

    case = CASES["llama-lora"]
    world = edist.get_world_size()
    model = case.build()
    kw = dict(hardware=load_profile("cpu-box"), inp=case.make_batch(BATCH // world, 0), step_fn=case.step_fn,
              process_bytes=0, disk=1 << 30, device_memory=1 << 30)
    try:
        optimal_search(model, world, host_memory=1, **kw)
        raise AssertionError("a 1-byte budget fitted")
    except DoesNotFitError as e:
        host = e.needs["host_memory"]
    plan = optimal_search(model, world, host_memory=host, **kw)
    em = ElixirModule(model, plan, offload_dir=f"{tmp}/offload")
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    run = train_wrapped(case, em, opt, steps=STEPS, batch_size=BATCH)
    sd = em.state_dict()
    checkpoint.save(f"{tmp}/ck", em, opt)
    em2 = ElixirModule(case.build(), plan, offload_dir=f"{tmp}/offload2")
    checkpoint.load(f"{tmp}/ck", em2)
    sd2 = em2.state_dict()
    return {"losses": run.losses, "where": {c.shard_placement.value for c in plan.frozen_chunks},
            "resident": em.memory_report()["frozen_shard_bytes"], "predicted_disk": plan.prediction.peak_disk_bytes,
            "frozen_bytes": plan.info["predicted_memory"]["frozen_shards"],
            "resumed": all(torch.equal(sd[k], sd2[k]) for k in sd)}


@pytest.mark.dist
def test_frozen_shards_stream_from_disk(tmp_path):
    case = CASES["llama-lora"]
    got = run_distributed(_disk_frozen, 2, str(tmp_path), timeout=600)[0]
    ref = train_reference(case, steps=STEPS, batch_size=BATCH, model=case.build())
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    assert got["where"] == {"disk"} and got["resident"] == 0, got
    assert got["predicted_disk"] >= got["frozen_bytes"] > 0 and got["resumed"], got


def _malloc_in_use() -> int:
    from elixir.device import host_allocator_stats

    st = host_allocator_stats()
    return st["heap_in_use_bytes"] + st["mmapped_bytes"]


def test_tracer_counts_a_lora_steps_activations_as_malloc_does():
    # issue 19: a LoRA plan's step peaked above its prediction. The tracer is not the cause: its
    # meta activation peak of a bf16 PEFT LoRA step equals the bytes glibc's malloc has handed out
    # at the real step's peak (the RSS above that is heap slack: see the next test)
    from torch.utils._python_dispatch import TorchDispatchMode

    from elixir.device import host_allocator_stats
    from elixir.tracer import memory_profiling

    if not host_allocator_stats():
        pytest.skip("needs glibc's mallinfo2")
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=256))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model = model.to(torch.bfloat16).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 256))

    def step(m, b):
        m(input_ids=b["input_ids"], labels=b["input_ids"]).loss.backward()

    traced = memory_profiling(model, {"input_ids": ids}, step, dtype=torch.bfloat16)
    step(model, {"input_ids": ids})  # warm up: kernels, thread pools, the grads' storage
    model.zero_grad(set_to_none=True)

    class PeakInUse(TorchDispatchMode):
        def __init__(self, base: int):
            super().__init__()
            self.base, self.peak = base, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, _malloc_in_use() - self.base)
            return out

    with PeakInUse(_malloc_in_use()) as mon:
        step(model, {"input_ids": ids})
    measured = mon.peak
    expected = traced.activation_occ + traced.grad_occ
    assert abs(measured - expected) <= 0.05 * expected + (256 << 10), (measured, expected)


def test_search_counts_heap_slack_in_proportion_to_host_activations(monkeypatch):
    # issue 19: where activations live in host RAM, the heap keeps a step's freed temporaries
    # resident between the saved tensors, in proportion to the activations (0.57x at LoRA hidden
    # 1536, 12 layers; 0.62x at 2048, 16). A fixed 128 MiB for everything a step adds let a LoRA
    # plan predicted at 1.17 GiB peak at 1.41 GiB and be killed by its cap.
    from elixir.hardware import load_profile
    from elixir.search import optimal

    monkeypatch.setattr(optimal.dev, "rss_bytes", lambda: 1 << 30)
    model = nn.Linear(8, 8)
    hw = load_profile("cpu-box")
    small, large = (optimal._process_bytes(model, hw, act) for act in (0, 4 << 30))
    if optimal.dev.is_accelerator(optimal.dev.default_device()):
        assert large == small
    else:
        assert large - small >= hw.heap_slack_per_activation_byte * (4 << 30) - (128 << 20)
        assert large - small >= 0.6 * (4 << 30)


def _meta_lora_llama(hidden: int, layers: int):
    """bench/capacity.py's LoRA model: a bf16 LLaMA (vocab 32000) built on meta, PEFT LoRA r=8 on
    every projection; with a batch of one 256-token sequence and the step function."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, vocab_size=32000,
                      max_position_embeddings=512, tie_word_embeddings=False)
    with torch.device("meta"):
        base = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).train()
    ids = torch.randint(0, cfg.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))

    def step_fn(m, b):
        m(input_ids=b["input_ids"], labels=b["input_ids"]).loss.backward()

    return model, ids, step_fn


def _lora_disk_step_peak(tmp: str, hidden: int, layers: int, cap: float) -> dict:
    """Capacity system (h) in small: PEFT LoRA r=8 on every projection of a bf16 LLaMA built on
    meta, planned by optimal_search under a one-pool RAM cap that puts every frozen chunk on disk,
    three steps of AdamW; the step's peak RSS (VmHWM, reset after the build) beside the plan's
    prediction, and the ledger's peaks beside the predicted terms."""
    from elixir import device as dev
    from elixir.search import optimal_search

    model, ids, step_fn = _meta_lora_llama(hidden, layers)
    budget = int(cap * 2**30)
    plan = optimal_search(model, 1, unified_dtype=torch.bfloat16, optimizer_type="AdamW", inp={"input_ids": ids},
                          step_fn=step_fn, device_memory=budget, host_memory=budget, disk=4 << 30)
    em = ElixirModule(model, plan, dtype=torch.bfloat16, offload_dir=tmp)
    opt = ElixirOptimizer(em, torch.optim.AdamW([p for p in em.parameters() if p.requires_grad], lr=1e-3))
    dev.release_free_host_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS: the training steps' peak only
    em.reset_peak_memory()
    losses, heap_free = [], []
    for _ in range(3):
        loss = em(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        heap_free.append(dev.host_allocator_stats().get("heap_free_bytes", 0))
    pred = plan.prediction
    L = em.ledger
    return {"peak": dev.peak_rss_bytes(), "predicted": pred.peak_device_bytes + pred.peak_host_bytes,
            "terms": plan.info["predicted_memory"], "losses": losses, "heap_free": heap_free,
            "frozen_where": {c.shard_placement.value for c in plan.frozen_chunks},
            "trainable_where": {(c.shard_placement.value, c.optim_placement.value) for c in plan.chunks},
            "blocks": plan.cache_blocks, "frozen_chunks": len(plan.frozen_chunks),
            "ledger": {"gathered": L.bytes("gathered", peak=True), "frozen_host": L.bytes("frozen_shard", "host", peak=True),
                       "frozen_device": L.bytes("frozen_shard", "device", peak=True), "frozen_now": L.bytes("frozen_shard")}}


@pytest.mark.dist
def test_lora_plan_with_the_base_on_disk_stays_under_its_predicted_peak(tmp_path):
    # issue 19: the 20.33B LoRA capacity run (hidden 6144, every frozen chunk on disk) peaked at
    # 11.24 GiB against 10.73 predicted. Its plan streams from disk, yet the runtime kept glibc's
    # heap as for a plan that does not (only trainable disk chunks counted): a 32 MiB mmap
    # threshold and no trim, so the few-MiB activation temporaries of large hidden sizes left holes
    # in the heap (2x the activations at hidden 6144, growing step after step), beyond the heap
    # slack the search counts. Here (hidden 4096, 1 layer) the old runtime peaked at 1.427 GiB against
    # 1.411 predicted; now the heap holds no slack after backward and the peak is the live bytes.
    got = run_distributed(_lora_disk_step_peak, 1, str(tmp_path), 4096, 1, 1.6, timeout=600, threads_per_rank=2)[0]
    assert got["frozen_where"] == {"disk"} and got["trainable_where"] == {("device", "device")}, got
    assert got["losses"][-1] < got["losses"][0], got
    assert got["peak"] <= got["predicted"], got
    assert max(got["heap_free"]) <= 64 << 20, got  # trimmed after each backward
    # the search's terms are what the ledger booked at its peak: the rCache full, one frozen
    # shard staged from disk at a time (the plan's only host bytes), nothing frozen resident
    t, led = got["terms"], got["ledger"]
    assert led["gathered"] == t["rcache"] > 0, got
    assert led["frozen_host"] == t["placed_host"] > 0 and led["frozen_device"] == led["frozen_now"] == 0, got



def test_predicted_peak_keeps_what_is_always_live_with_the_base_on_disk():
    # The one-pool timeline (cost_model.timeline_peak) took the frozen shards, which its total
    # already leaves out (they are inside placed_*, or on disk), off the bytes live at every
    # moment a second time: a LoRA plan at hidden 6144 with its base on disk was predicted
    # 0.90 GiB and peaked at 1.59 (its rCache and staged frozen shard alone are 1.10).
    from elixir.hardware import load_profile
    from elixir.search import DoesNotFitError, optimal_search

    model, ids, step_fn = _meta_lora_llama(1024, 2)
    kw = dict(hardware=load_profile("cpu-box"), unified_dtype=torch.bfloat16, optimizer_type="AdamW",
              inp={"input_ids": ids}, step_fn=step_fn, process_bytes=256 << 20, disk=4 << 30)
    try:  # the least one-pool budget that plans: the base goes to disk
        optimal_search(model, 1, device_memory=1, host_memory=1, **kw)
        raise AssertionError("a 1-byte budget fitted")
    except DoesNotFitError as e:
        need = e.needs.get("memory") or max(e.needs.get("host_memory", 0), e.needs.get("device_memory", 0))
    plan = optimal_search(model, 1, device_memory=need, host_memory=need, **kw)
    t = plan.info["predicted_memory"]
    always = t["process"] + t["rcache"] + t["placed_device"] + t["placed_host"] + t["buffers"] + t["replicated"]
    assert plan.prediction.peak_device_bytes + plan.prediction.peak_host_bytes >= always + t["activations"] // 2, t
    assert {c.shard_placement.value for c in plan.frozen_chunks} == {"disk"}, plan
