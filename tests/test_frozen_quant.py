"""Quantised frozen weights (issue 33 item 3): a LoRA base stored NF4 or int8, dequantised at gather.

- the NF4 codec against torchao's ``to_nf4`` bit for bit (codes, scaler codes, factors, mean,
  dequantised values), and against QLoRA's definition (nearest of the 16 levels) without torchao;
  int8 against its definition; the bytes the footprint rule gives are the buffer's;
- the policy, the plan and the front ends take and record the format;
- a LoRA fine-tune on a quantised base matches plain torch + PEFT on the same dequantised base
  weights (computed here from the original weights and the plan's packing), at world size 1 and 2;
  the ledger books the quantised bytes, which the search predicts;
- load_pretrained quantises the base as it streams it in; checkpoints save adapters losslessly and
  the base dequantised, with a warning naming the precision change.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("peft")

from elixir import checkpoint  # noqa: E402
from elixir import distributed as edist  # noqa: E402
from elixir.chunk.quant import NF4_LEVELS, FrozenCodec  # noqa: E402
from elixir.plan import SearchResult  # noqa: E402
from elixir.plan.state_format import frozen_element_bytes, frozen_shard_bytes  # noqa: E402
from elixir.search import minimum_waste_search  # noqa: E402
from elixir.testing import run_distributed  # noqa: E402
from elixir.testing.reference import default_optimizer, train_reference, train_wrapped  # noqa: E402
from elixir.wrapper import ElixirModule, ElixirOptimizer  # noqa: E402
from elixir.wrapper.policies import MixedPrecisionPolicy, frozen_format  # noqa: E402
from tests.lora_cases import CASES  # noqa: E402

STEPS, BATCH = 3, 4


def _values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.02
    x[7 * 64 : 8 * 64] *= 40  # one block far larger than the rest (the scalers' spread)
    return x.to(dtype)


# ---- the codecs ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_is_torchao_bit_for_bit(dtype):
    nf4t = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    lv = torch.tensor(NF4_LEVELS, dtype=dtype)
    x = _values(16384 * 3, dtype)
    x[:16] = lv  # exact levels and the midpoints between them (ties) in a block whose absmax is 1
    x[16:31] = (lv[1:] + lv[:-1]) / 2
    x[31:64] = 0.5
    codec = FrozenCodec("nf4", x.numel(), dtype)
    buf = codec.encode(x)
    r, ref = codec.regions(buf), nf4t.to_nf4(x)
    assert torch.equal(r["codes"], ref.quantized_data)
    assert torch.equal(r["scalers"], ref.quantized_scalers)
    assert torch.equal(r["factors"], ref.quantization_factor)
    assert torch.equal(r["mean"][0], ref.scaler_mean)
    assert torch.equal(codec.decode(buf), ref.get_original_weight())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_codes_are_the_nearest_level_and_zero_blocks_stay_zero(dtype):
    """QLoRA's definition on a length with a partial block and a partial scaler group: each code
    the first nearest of the 16 levels to x / absmax (computed over every level), each value
    decoded as level x the block's dequantised absmax; an all-zero block decodes to zeros."""
    n = 64 * 300 + 17
    x = _values(n, dtype, seed=1)
    x[128:192] = 0
    codec = FrozenCodec("nf4", n, dtype)
    buf = codec.encode(x)
    pad = torch.zeros(codec.padded, dtype=dtype)
    pad[:n] = x
    blocks = pad.view(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scaled = (blocks / torch.where(absmax == 0, torch.ones_like(absmax), absmax)).view(-1)
    lv = torch.tensor(NF4_LEVELS, dtype=dtype)
    want = (scaled[:, None] - lv).abs().min(dim=1).indices
    packed = codec.regions(buf)["codes"]
    got = torch.stack([packed >> 4, packed & 15], dim=1).view(-1).long()
    assert torch.equal(got, want)
    scales = codec.block_scales(buf)
    assert torch.equal(codec.decode(buf), (lv[want].view(-1, 64) * scales[:, None]).view(-1)[:n])
    assert torch.equal(codec.decode(buf)[128:192], torch.zeros(64, dtype=dtype))
    assert (codec.decode(buf).float() - x.float()).abs().max() <= absmax.float().max() * 0.2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_nf4_dequantiser_is_the_torch_path_bit_for_bit(dtype):
    """csrc/nf4.cpp on every SIMD level this CPU runs against the torch path (use_native=False),
    on a length with several threads' worth of blocks and a partial last block."""
    from elixir._native import get_native

    native = get_native()
    if native is None or not hasattr(native, "nf4_decode"):
        pytest.skip("the native extension is not built")
    n = 64 * 3000 + 40
    codec = FrozenCodec("nf4", n, dtype)
    buf = codec.encode(_values(n, dtype, seed=3))
    codec.use_native = False
    want = codec.decode(buf)
    codec.use_native = True
    levels = {native.nf4_kernel_level(s) for s in ("scalar", "avx2", "avx512")}
    for simd in ("scalar", "avx2", "avx512"):
        assert torch.equal(codec.decode(buf, simd=simd), want), (simd, levels)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_nf4_quantiser_is_the_torch_path_bit_for_bit(dtype):
    """csrc/nf4.cpp's encoder against the torch path (use_native=False) on values that hit every
    level and the midpoints between levels (where the rounding of ``|x - level|`` decides), over
    several threads' worth of blocks, a zero block and a partial last block."""
    from elixir._native import get_native

    native = get_native()
    if native is None or not hasattr(native, "nf4_encode"):
        pytest.skip("the native extension is not built")
    n = 64 * 3000 + 40
    x = _values(n, dtype, seed=5)
    lv = torch.tensor(NF4_LEVELS)
    edges = torch.cat([lv, (lv[1:] + lv[:-1]) / 2])  # levels and midpoints, scaled by a block's absmax
    x[64 : 64 + len(edges)] = (edges * 0.5).to(dtype)
    x[64 + len(edges)] = 0.5
    x[640:704] = 0
    codec = FrozenCodec("nf4", n, dtype)
    got = codec.encode(x)
    codec.use_native = False
    assert torch.equal(got, codec.encode(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_is_its_definition(dtype):
    n = 64 * 50 + 5
    x = _values(n, dtype, seed=2)
    codec = FrozenCodec("int8", n, dtype)
    buf = codec.encode(x)
    xp = torch.zeros(codec.padded)
    xp[:n] = x.float()
    absmax = xp.view(-1, 64).abs().amax(dim=1)
    codes = (xp.view(-1, 64) / absmax[:, None] * 127).round().clamp(-127, 127)
    assert torch.equal(codec.regions(buf)["codes"].view(-1, 64).float(), codes)
    assert torch.equal(codec.decode(buf), (codes * (absmax / 127)[:, None]).view(-1)[:n].to(dtype))


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_footprint_bytes_are_the_buffers(fmt):
    for n in (64, 1000, 16384, 16384 * 5 + 64 * 3):
        for dtype, e in ((torch.bfloat16, 2), (torch.float32, 4)):
            assert FrozenCodec(fmt, n, dtype).nbytes == frozen_shard_bytes(fmt, n, e)
    big = 16384 * 64
    assert frozen_element_bytes(fmt, 2) == frozen_shard_bytes(fmt, big, 2) / big
    assert frozen_element_bytes(fmt, 2) < 1.1 and frozen_element_bytes(None, 2) == 2


# ---- policy, plan, front ends ------------------------------------------------------------------


def test_policy_plan_and_front_ends_take_the_format():
    from elixir.booster import GeminiPlugin
    from elixir.integrations.options import ElixirOptions

    with pytest.raises(ValueError, match="MixedPrecisionPolicy.frozen must be one of"):
        MixedPrecisionPolicy(frozen="nf5")
    plan = SearchResult(chunks=(), world_size=1, cache_blocks=0, frozen_format="nf4")
    assert SearchResult.from_json(plan.to_json()).frozen_format == "nf4"
    assert frozen_format(MixedPrecisionPolicy(), plan) == "nf4"  # the plan's
    assert frozen_format(MixedPrecisionPolicy(frozen="int8"), SearchResult((), 1, 0)) == "int8"  # the policy's
    with pytest.raises(ValueError, match="searched with frozen='nf4'"):
        frozen_format(MixedPrecisionPolicy(frozen="int8"), plan)
    assert ElixirOptions(placement_policy="cpu", frozen="nf4").frozen == "nf4"
    with pytest.raises(ValueError, match="elixir.frozen must be one of"):
        ElixirOptions(frozen="int4")
    assert GeminiPlugin(precision="fp32", frozen="int8").frozen_format == "int8"


# ---- the runtime ---------------------------------------------------------------------------


def _lora_case():
    return CASES["llama-lora"]


def dequantised_base(model, plan: SearchResult, fmt: str, dtype: torch.dtype, world: int) -> dict[str, torch.Tensor]:
    """The frozen weights as a run in ``fmt`` computes with them, from the original weights and
    the plan's packing: each chunk flattened, each rank's shard quantised and dequantised alone."""
    named = dict(model.named_parameters())
    out = {}
    for cp in plan.frozen_chunks:
        flat = torch.zeros(cp.chunk_size, dtype=dtype)
        spans, off = [], 0
        for name in cp.params:
            n = named[name].numel()
            flat[off : off + n] = named[name].detach().reshape(-1)
            spans.append((name, off, n))
            off += n
        per = cp.chunk_size // world
        codec = FrozenCodec(fmt, per, dtype)
        deq = torch.cat([codec.decode(codec.encode(flat[r * per : (r + 1) * per])) for r in range(world)])
        out.update({name: deq[o : o + n].view(named[name].shape) for name, o, n in spans})
    return out


def _train_quantised(fmt: str, tmp: str) -> dict:
    case, world, rank = _lora_case(), edist.get_world_size(), edist.get_rank()
    model = case.build()
    plan = minimum_waste_search(model, world)
    expected = dequantised_base(model, plan, fmt, torch.float32, world)
    em = ElixirModule(model, plan, mp_policy=MixedPrecisionPolicy(frozen=fmt))
    with pytest.warns(UserWarning, match=f"dequantised from {fmt} to float32"):
        sd = em.state_dict()
    base_exact = all(torch.equal(sd[k], v) for k, v in expected.items())
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    run = train_wrapped(case, em, opt, steps=STEPS, batch_size=BATCH)
    shards = [c.spec.shard_numel for c in em.frozen_chunks]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapters = {k: v for k, v in em.state_dict().items() if k not in expected}
    checkpoint.save(f"{tmp}/adapters", em, opt, frozen=False)  # lossless: no warning
    with pytest.warns(UserWarning, match=f"checkpoint holds the frozen weights dequantised from {fmt}"):
        checkpoint.save(f"{tmp}/full", em, opt)
    em2 = ElixirModule(case.build(), plan, mp_policy=MixedPrecisionPolicy(frozen=fmt))
    checkpoint.load(f"{tmp}/adapters", em2, ElixirOptimizer(em2, default_optimizer(
        [p for p in em2.parameters() if p.requires_grad])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd2 = em2.state_dict()
    return {"losses": run.losses, "base_exact": base_exact, "expected": expected if rank == 0 else None,
            "adapters": adapters, "resumed": all(torch.equal(sd2[k], v) for k, v in adapters.items()),
            "ledger": em.ledger.bytes("frozen_shard", peak=True), "report": em.memory_report()["frozen_shard_bytes"],
            "shards": shards, "sharded": all(c.spec.sharded for c in em.frozen_chunks)}


def _check_against_peft(got: dict, fmt: str) -> None:
    case = _lora_case()
    ref_model = case.build()
    with torch.no_grad():
        for n, p in ref_model.named_parameters():
            if n in got["expected"]:
                p.copy_(got["expected"][n])
    ref = train_reference(case, steps=STEPS, batch_size=BATCH, model=ref_model)
    assert got["base_exact"], "the state dict's frozen weights are not the base quantised and dequantised"
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    for k, v in got["adapters"].items():
        if k in ref.state_dict and v.is_floating_point():
            torch.testing.assert_close(v, ref.state_dict[k], rtol=1e-4, atol=1e-6, msg=k)
    assert got["resumed"], "the adapter-only checkpoint did not restore the adapters"
    assert got["sharded"] and got["shards"]
    want = sum(frozen_shard_bytes(fmt, n, 4) for n in got["shards"])
    assert got["ledger"] == got["report"] == want < sum(got["shards"]) * 4 * (0.2 if fmt == "nf4" else 0.3)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_lora_on_a_quantised_base_matches_peft_on_the_dequantised_base(fmt, tmp_path):
    _check_against_peft(_train_quantised(fmt, str(tmp_path)), fmt)


def _world2_worker(tmp: str) -> dict:
    return _train_quantised("nf4", tmp)


@pytest.mark.dist
def test_lora_on_an_nf4_base_at_world_size_2(tmp_path):
    """Each rank quantises its own shard; gathers all-gather the codes and dequantise them."""
    got = run_distributed(_world2_worker, 2, str(tmp_path), timeout=300)[0]
    _check_against_peft(got, "nf4")


def test_search_prices_the_quantised_base_as_the_runtime_books_it():
    from elixir.hardware import load_profile
    from elixir.search import optimal_search

    case = _lora_case()
    kw = dict(hardware=load_profile("cpu-box"), host_memory=1 << 30, device_memory=1 << 30,
              inp=case.make_batch(BATCH, 0), step_fn=case.step_fn, process_bytes=0)
    plain = optimal_search(case.build(), 1, **kw).info["predicted_memory"]["frozen_shards"]
    model = case.build()
    plan = optimal_search(model, 1, frozen="nf4", **kw)
    assert plan.frozen_format == "nf4"
    em = ElixirModule(model, plan)  # the plan's format, the policy left at its default
    opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
    train_wrapped(case, em, opt, steps=1, batch_size=BATCH)
    pred = plan.info["predicted_memory"]
    assert pred["frozen_shards"] == em.ledger.bytes("frozen_shard", peak=True) < plain / 3
    assert 0 < em.memory_report()["peak_gathered_bytes"] <= pred["rcache"]


def test_load_pretrained_quantises_the_base_as_it_streams(tmp_path):
    from elixir.checkpoint import load_pretrained
    from elixir.testing.zoo import build_model

    base = build_model("gpt2", seed=5)
    base.save_pretrained(tmp_path / "base")
    model = CASES["gpt2-lora"].build()
    plan = minimum_waste_search(model, 1)
    em = ElixirModule(model, plan, mp_policy=MixedPrecisionPolicy(frozen="nf4"))
    booked = em.ledger.bytes("frozen_shard")
    report = load_pretrained(str(tmp_path / "base"), em)
    assert not report.missing_keys and not report.unexpected_keys
    twin = CASES["gpt2-lora"].build()
    saved = base.state_dict()
    with torch.no_grad():  # the twin's base: the checkpoint's weights, under the PEFT names
        for n, p in twin.named_parameters():
            bk = n.removeprefix("base_model.model.").replace(".base_layer.", ".")
            if not p.requires_grad and bk in saved:
                p.copy_(saved[bk])
    expected = dequantised_base(twin, plan, "nf4", torch.float32, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = em.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in expected.items())
    assert em.ledger.bytes("frozen_shard") == booked  # the shards stay quantised, nothing else kept


def test_quantised_shards_on_the_host_and_on_disk_train_alike():
    """The quantised buffer is placed, pinned, staged from disk and copied like any frozen shard:
    the same losses with the frozen shards on the device, the host and disk; on disk nothing of
    them stays resident."""
    import dataclasses

    from elixir.plan import Placement

    case, runs = _lora_case(), {}
    for where in (Placement.DEVICE, Placement.HOST, Placement.DISK):
        model = case.build()
        plan = minimum_waste_search(model, 1)
        optim = Placement.DISK if where is Placement.DISK else Placement.DEVICE  # a disk shard's plan names disk
        frozen = tuple(dataclasses.replace(c, sharding=True, shard_placement=where, optim_placement=optim)
                       for c in plan.frozen_chunks)
        em = ElixirModule(model, dataclasses.replace(plan, frozen_chunks=frozen, cache_blocks=2),
                          mp_policy=MixedPrecisionPolicy(frozen="nf4"))
        if where is Placement.DISK:  # the file reserved is the quantised bytes, not the compute dtype's
            import os

            quantised = sum(frozen_shard_bytes("nf4", c.shard_size(1), 4) for c in frozen)
            size, regions = os.fstat(em.shard_store.location.file.fd).st_size, len(frozen)
            assert quantised <= size <= quantised + regions * 4096  # regions start page-aligned
        opt = ElixirOptimizer(em, default_optimizer([p for p in em.parameters() if p.requires_grad]))
        runs[where] = (train_wrapped(case, em, opt, steps=STEPS, batch_size=BATCH).losses, em.memory_report())
    assert runs[Placement.DEVICE][0] == runs[Placement.HOST][0] == runs[Placement.DISK][0]
    booked = runs[Placement.DEVICE][1]["frozen_shard_bytes"]
    assert booked > 0 and runs[Placement.HOST][1]["frozen_shard_host_bytes"] == booked
    assert runs[Placement.DISK][1]["frozen_shard_bytes"] == 0
