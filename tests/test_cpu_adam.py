"""The native CPU Adam kernel against torch: every SIMD variant the CPU has, sizes with and without
tails, both modes, weight decay on and off, fp32/fp16/bf16 gradients, fp16/bf16 parameter copies,
special values, and the thread split."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from elixir.optim import functional as F

pytestmark = pytest.mark.skipif(not F.kernel_available(), reason="native extension not built")

SIZES = [1, 7, 15, 16, 17, 1_000_003]
BIG = 2**24 + 5
LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8


def levels() -> list[str]:
    return list(F.get_native().adam_kernel_levels())


class GradStream:
    """Cheap, deterministic, varied gradients: combinations of a few random tensors."""

    def __init__(self, n: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.pool = [torch.randn(n, generator=gen) for _ in range(5)]

    def __call__(self, step: int) -> torch.Tensor:
        return self.pool[step % 5] * (1 + 0.1 * (step % 7))


def torch_fused_step(p, g32, m, v, step, *, adamw, wd, bias_correction=True):
    fn = torch._fused_adamw_ if adamw else torch._fused_adam_
    fn([p], [g32], [m], [v], [], [torch.tensor(float(step))], lr=LR, beta1=BETA1, beta2=BETA2,
       weight_decay=wd, eps=EPS, amsgrad=False, maximize=False)  # fmt: skip


def ours(p, g, m, v, step, *, adamw, wd, level, div_scale=1.0, out=None, bias_correction=True):
    with F._simd_override(level):
        F.adam_step(p, g, m, v, step=step, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=wd,
                    adamw_mode=adamw, bias_correction=bias_correction, div_scale=div_scale, out_lowp=out)  # fmt: skip


def bulk(n: int) -> int:
    """Elements torch's fused kernel computes in its vector loop (the rest is its scalar tail)."""
    return n - n % 16


def assert_matches_fused(ours_t: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise equal on torch's vector part; its scalar tail rounds v differently (<= 1 ulp)."""
    k = bulk(ours_t.numel())
    assert torch.equal(ours_t[:k], ref[:k]), f"bulk differs: max {(ours_t[:k] - ref[:k]).abs().max()}"
    torch.testing.assert_close(ours_t, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("adamw,wd", [(True, 0.0), (True, 0.05), (False, 0.0), (False, 0.05)])
def test_fp32_100_steps_vs_torch(adamw, wd):
    """fp32: bitwise equal to torch's fused kernel (bulk), 1e-6 relative to torch.optim Adam/AdamW."""
    lvls = levels()
    for n in SIZES:
        grads = GradStream(n, seed=n)
        p0 = torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
        loop = torch.nn.Parameter(p0.clone())  # torch.optim's default (for-loop) path
        opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([loop], lr=LR, betas=(BETA1, BETA2), eps=EPS,
                                                                 weight_decay=wd)  # fmt: skip
        fp, fm, fv = p0.clone(), torch.zeros(n), torch.zeros(n)
        # The scalar variant runs the same per-element code as every tail; at 1M it is covered by
        # the (shorter) mixed-precision test, to keep this one fast.
        run = [lvl for lvl in lvls if n < 10**6 or lvl != "scalar"]
        mine = {lvl: (p0.clone(), torch.zeros(n), torch.zeros(n)) for lvl in run}
        for step in range(1, 101):
            g = grads(step)
            loop.grad = g.clone()
            opt.step()
            torch_fused_step(fp, g.clone(), fm, fv, step, adamw=adamw, wd=wd)
            for lvl, (p, m, v) in mine.items():
                ours(p, g, m, v, step, adamw=adamw, wd=wd, level=lvl)
        for lvl, (p, m, v) in mine.items():
            assert_matches_fused(p, fp)
            assert_matches_fused(m, fm)
            assert_matches_fused(v, fv)
            # 1e-6 relative (params are O(1); the absolute floor covers those near zero).
            torch.testing.assert_close(p, loop.detach(), rtol=1e-6, atol=1e-6, msg=f"{lvl} n={n}")
            assert (p - loop.detach()).abs().max() <= 1e-6 * loop.detach().abs().max()


def cast_ref_step(p, grad, m, v, step, *, adamw, wd, div_scale, out_dtype):
    """torch reference doing the casts explicitly: fp32 grad / div_scale, fused step, cast out."""
    g32 = grad.float() / div_scale
    torch_fused_step(p, g32, m, v, step, adamw=adamw, wd=wd)
    return None if out_dtype is None else p.to(out_dtype)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_precision_vs_explicit_casts(grad_dtype):
    """Low-precision grads in, div_scale, fp16/bf16 param copy out, against explicit torch casts."""
    lvls = levels()
    configs = itertools.cycle([(True, 0.05), (False, 0.0), (False, 0.05), (True, 0.0)])
    for n in SIZES:
        steps = 100 if n < 1000 else 10
        for out_dtype in (None, torch.float16, torch.bfloat16):
            adamw, wd = next(configs)
            div_scale = 1024.0 / 0.7  # a loss scale combined with a clip coefficient
            grads = GradStream(n, seed=n + 7)
            p0 = torch.randn(n, generator=torch.Generator().manual_seed(n + 2))
            rp, rm, rv = p0.clone(), torch.zeros(n), torch.zeros(n)
            mine = {lvl: (p0.clone(), torch.zeros(n), torch.zeros(n)) for lvl in lvls}
            outs = {lvl: None if out_dtype is None else torch.empty(n, dtype=out_dtype) for lvl in lvls}
            for step in range(1, steps + 1):
                grad = (grads(step) * 1024.0).to(grad_dtype)
                ref_out = cast_ref_step(rp, grad, rm, rv, step, adamw=adamw, wd=wd, div_scale=div_scale,
                                        out_dtype=out_dtype)  # fmt: skip
                for lvl, (p, m, v) in mine.items():
                    ours(p, grad, m, v, step, adamw=adamw, wd=wd, level=lvl, div_scale=div_scale, out=outs[lvl])
            for lvl, (p, m, v) in mine.items():
                assert_matches_fused(p, rp)
                assert_matches_fused(m, rm)
                assert_matches_fused(v, rv)
                if out_dtype is not None:
                    out = outs[lvl]
                    assert torch.equal(out, p.to(out_dtype)), f"{lvl}: copy is not p rounded to nearest even"
                    k = bulk(n)
                    assert torch.equal(out[:k], ref_out[:k])
                    torch.testing.assert_close(out.float(), ref_out.float())  # dtype tolerance


def test_big_size_few_steps():
    """2^24 + 5 elements (several thread shares, a tail): fp32 and bf16-in/bf16-out, 3 steps."""
    n = BIG
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(n, generator=gen)
    g32 = torch.randn(n, generator=gen)
    for grad_dtype, out_dtype, lvl in [(torch.float32, None, ""), (torch.bfloat16, torch.bfloat16, "")]:
        grad = g32.to(grad_dtype)
        rp, rm, rv = p0.clone(), torch.zeros(n), torch.zeros(n)
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        for step in range(1, 4):
            cast_ref_step(rp, grad, rm, rv, step, adamw=True, wd=0.01, div_scale=2.0, out_dtype=None)
            ours(p, grad, m, v, step, adamw=True, wd=0.01, level=lvl, div_scale=2.0, out=out)
        assert_matches_fused(p, rp)
        assert_matches_fused(v, rv)
        if out is not None:
            assert torch.equal(out, p.to(out_dtype))
        del rp, rm, rv, p, m, v, out


def test_thread_split_and_multi_span_are_exact():
    """Any thread count and any split into spans give bitwise the same result."""
    native = F.get_native()
    sizes = [100_003, 17, 1, 65_536 + 3, 250_000]
    gen = torch.Generator().manual_seed(3)
    base = [(torch.randn(k, generator=gen), torch.randn(k, generator=gen).bfloat16()) for k in sizes]
    results = []
    for threads in (1, 2, 3, 7):
        ps = [(p.clone(), torch.zeros(len(p)), torch.zeros(len(p)), torch.empty(len(p), dtype=torch.float16))
              for p, _ in base]  # fmt: skip
        spans = [(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), o.data_ptr(), p.numel())
                 for (p, m, v, o), (_, g) in zip(ps, base)]  # fmt: skip
        for step in (1, 2):
            native.adam_update(spans, 2, 1, step, LR, BETA1, BETA2, EPS, 0.01, True, True, 3.0, threads, "")
        results.append(torch.cat([torch.cat([p, m, v, o.float()]) for p, m, v, o in ps]))
    # One tensor at a time through the public API must agree too.
    single = []
    for p, g in base:
        p, m, v, o = p.clone(), torch.zeros(len(p)), torch.zeros(len(p)), torch.empty(len(p), dtype=torch.float16)
        for step in (1, 2):
            F.adam_step(p, g, m, v, step=step, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.01,
                        div_scale=3.0, out_lowp=o)  # fmt: skip
        single.append(torch.cat([p, m, v, o.float()]))
    results.append(torch.cat(single))
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_lowp_copy_at_any_alignment():
    """The copy is streamed (non-temporal) in long ranges after peeling to 32-byte alignment."""
    n = 300_001
    gen = torch.Generator().manual_seed(8)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    results = []
    for lvl in levels():
        for offset in (0, 1, 5, 15):
            for dtype in (torch.bfloat16, torch.float16):
                out = torch.empty(n + offset, dtype=dtype)[offset:]
                p = p0.clone()
                ours(p, g, torch.zeros(n), torch.zeros(n), 1, adamw=True, wd=0.01, level=lvl, out=out)
                assert torch.equal(out, p.to(dtype)), (lvl, offset, dtype)
                results.append(p)
    assert all(torch.equal(r, results[0]) for r in results)


def test_kernel_releases_the_gil():
    """Python threads keep running while a long kernel call is in flight."""
    import threading
    import time

    n = 8_000_000
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    window: list[tuple[float, float]] = []
    started = threading.Event()

    def work() -> None:
        started.set()
        for step in (1, 2, 3):
            t0 = time.perf_counter()
            F.adam_step(p, g, m, v, step=step, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0)
            window.append((t0, time.perf_counter()))

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    ticks = []
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    inside = [t for t in ticks for a, b in window if a + 1e-3 < t < b - 1e-3]
    assert inside, "no Python progress during a kernel call: the GIL was held"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_one_openmp_runtime_shared_with_torch():
    """The kernel's OpenMP regions run on torch's libgomp, not a second runtime with its own pool."""
    n = 1 << 20
    p, g, m, v = (torch.zeros(n) for _ in range(4))
    F.get_native().adam_update([(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0, n)], 0, 3, 1, LR,
                               BETA1, BETA2, EPS, 0.0, True, True, 1.0, 2, "")  # fmt: skip
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) <= 1, runtimes


def test_bandwidth_probe_touches_what_the_update_touches():
    """The benchmark's roofline probe reads p g m v and writes p m v (here: adds g to each)."""
    n = 70_001
    p, g, m, v = (torch.randn(n) for _ in range(4))
    want = (p + g, m + g, v + g)
    F.get_native().adam_bandwidth_probe([(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0, n)], 2)
    for got, w in zip((p, m, v), want):
        assert torch.equal(got, w)


def special_values(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    inf, nan = float("inf"), float("nan")
    # Spread specials over the vector part and the tail.
    for i, (pv, gv) in enumerate([(1.0, nan), (1.0, inf), (1.0, -inf), (nan, 1.0), (inf, 1.0), (-inf, 0.5),
                                  (1.0, 1e30), (1.0, 1e-30), (0.0, 0.0), (-0.0, -0.0), (1e-40, 1e-41),
                                  (3e38, 3e38), (1.0, -1e-45)]):  # fmt: skip
        for j in (i, n - 1 - i):
            p[j], g[j] = pv, gv
    return p, g


@pytest.mark.parametrize("adamw,wd", [(True, 0.1), (False, 0.1), (True, 0.0)])
def test_nan_inf_propagate_like_torch(adamw, wd):
    n = 16 * 4 + 13
    gen = torch.Generator().manual_seed(5)
    p0, g0 = special_values(n, gen)
    for lvl in levels():
        rp, rm, rv = p0.clone(), torch.zeros(n), torch.zeros(n)
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2):
            torch_fused_step(rp, g0.clone(), rm, rv, step, adamw=adamw, wd=wd)
            ours(p, g0, m, v, step, adamw=adamw, wd=wd, level=lvl, out=out)
        for a, b in ((p, rp), (m, rm), (v, rv)):
            assert torch.equal(a.isnan(), b.isnan()), lvl
            assert torch.equal(a.isinf(), b.isinf()), lvl
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-30, equal_nan=True)
        assert torch.equal(out.isnan(), p.isnan()) and torch.equal(out[~p.isnan()], p[~p.isnan()].bfloat16())


def test_conversions_bitwise_like_torch():
    """Every fp16/bf16 gradient bit pattern loads exactly; the fp16/bf16 copy rounds like .to()."""
    # Loading: with beta1 = 0, m becomes the fp32 gradient itself after one step.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        grad = bits.view(dtype)
        n = grad.numel()
        finite = grad.float().isfinite()
        for lvl in levels():
            m = torch.zeros(n)
            with F._simd_override(lvl):
                F.adam_step(torch.zeros(n), grad, m, torch.zeros(n), step=1, lr=LR, beta1=0.0, beta2=BETA2,
                            eps=EPS, weight_decay=0.0)  # fmt: skip
            assert torch.equal(m[finite], grad.float()[finite]), (lvl, dtype)
            assert m[~finite].isnan().all()
    # Rounding: with lr = 0 the parameter is unchanged, so the copy is exactly p.to(dtype).
    gen = torch.Generator().manual_seed(9)
    raw = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000, 0x33000000, 0x33000001,
                          0x387FE000, 0x38800000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x3F808000, 0x3F818000,
                          0x3F800001, 0x7FC00000, 0x7F800001], dtype=torch.int64).to(torch.int32)  # fmt: skip
    p = torch.cat([raw, edges, -edges.view(torch.float32).abs().view(torch.int32)]).view(torch.float32)
    n = p.numel()
    for out_dtype in (torch.float16, torch.bfloat16):
        want = p.to(out_dtype)
        for lvl in levels():
            q = p.clone()
            out = torch.empty(n, dtype=out_dtype)
            with F._simd_override(lvl):
                F.adam_step(q, torch.zeros(n), torch.zeros(n), torch.ones(n), step=1, lr=0.0, beta1=BETA1,
                            beta2=BETA2, eps=EPS, weight_decay=0.0, out_lowp=out)  # fmt: skip
            nan = want.isnan()
            assert torch.equal(out.isnan(), nan), (lvl, out_dtype)
            assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16)), (lvl, out_dtype)


def test_bias_correction_off_matches_formula():
    """bias_correction=False: step size lr, no sqrt(bc2); the torch path computes the same."""
    n = 4099
    grads = GradStream(n, seed=11)
    p0 = torch.randn(n)
    a = (p0.clone(), torch.zeros(n), torch.zeros(n))
    b = (p0.clone(), torch.zeros(n), torch.zeros(n))
    for step in range(1, 21):
        g = grads(step).bfloat16()
        ours(*a[:1], g, *a[1:], step, adamw=False, wd=0.05, level="", div_scale=2.0, bias_correction=False)
        F._torch_adam([b[0]], [g], [b[1]], [b[2]], [None], step=step, lr=LR, beta1=BETA1, beta2=BETA2,
                      eps=EPS, weight_decay=0.05, adamw_mode=False, bias_correction=False, div_scale=2.0)  # fmt: skip
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    # And it really differs from the bias-corrected update.
    c = (p0.clone(), torch.zeros(n), torch.zeros(n))
    ours(c[0], grads(1).bfloat16(), c[1], c[2], 1, adamw=False, wd=0.05, level="", div_scale=2.0)
    d = (p0.clone(), torch.zeros(n), torch.zeros(n))
    ours(d[0], grads(1).bfloat16(), d[1], d[2], 1, adamw=False, wd=0.05, level="", div_scale=2.0,
         bias_correction=False)  # fmt: skip
    assert not torch.equal(c[0], d[0])


def test_torch_path_matches_kernel():
    """The path accelerators, non-contiguous tensors and no-extension runs take, on CPU tensors."""
    n = 1000
    grads = GradStream(n, seed=4)
    p0 = torch.randn(n)
    for adamw, wd, gdt, odt in [(True, 0.01, torch.bfloat16, torch.bfloat16), (False, 0.1, torch.float16, None),
                                (True, 0.0, torch.float32, torch.float16)]:  # fmt: skip
        a = [p0.clone(), torch.zeros(n), torch.zeros(n), None if odt is None else torch.empty(n, dtype=odt)]
        b = [p0.clone(), torch.zeros(n), torch.zeros(n), None if odt is None else torch.empty(n, dtype=odt)]
        for step in range(1, 31):
            g = grads(step).to(gdt)
            ours(a[0], g, a[1], a[2], step, adamw=adamw, wd=wd, level="", div_scale=1.5, out=a[3])
            F._torch_adam([b[0]], [g], [b[1]], [b[2]], [b[3]], step=step, lr=LR, beta1=BETA1, beta2=BETA2,
                          eps=EPS, weight_decay=wd, adamw_mode=adamw, bias_correction=True, div_scale=1.5)  # fmt: skip
        for x, y in zip(a, b):
            if x is not None:
                assert_matches_fused(x.float(), y.float())


def test_non_contiguous_takes_torch_path_with_same_result():
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(64, 48, generator=gen)
    g = torch.randn(64, 48, generator=gen)
    a = [p0.clone(), torch.zeros(64, 48), torch.zeros(64, 48)]
    b = [p0.t().contiguous().t(), torch.zeros(48, 64).t(), torch.zeros(48, 64).t()]  # transposed layouts
    assert not b[0].is_contiguous()
    for step in (1, 2, 3):
        for t in (a, b):
            F.adam_step(t[0], g, t[1], t[2], step=step, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.1)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_argument_errors_are_clear():
    p, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    kw = dict(step=1, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0)
    with pytest.raises(TypeError, match="grad dtype"):
        F.adam_step(p, torch.zeros(8, dtype=torch.float64), m, v, **kw)
    with pytest.raises(ValueError, match="8 elements"):
        F.adam_step(p, torch.zeros(9), m, v, **kw)
    with pytest.raises(TypeError, match="out_lowp dtype"):
        F.adam_step(p, torch.zeros(8), m, v, out_lowp=torch.zeros(8), **kw)
    with pytest.raises(ValueError, match="step must be >= 1"):
        F.adam_step(p, torch.zeros(8), m, v, **{**kw, "step": 0})
    with pytest.raises(ValueError, match="div_scale"):
        F.adam_step(p, torch.zeros(8), m, v, div_scale=0.0, **kw)
    with pytest.raises(ValueError, match="unknown SIMD level"):
        F.get_native().adam_kernel_level("sse9")
