"""Measure this machine into a :class:`~elixir.hardware.profile.HardwareProfile` (``elixir hwprofile``).

Each resource is timed alone: copies, collectives (over the current process group, or over local
ranks spawned with :func:`elixir.launch.run_distributed`), the optimizer, matmuls, elementwise ops,
the per-op overhead and the disk. :mod:`elixir.profiling.calibrate` then times them together under
the runtime.
"""

from __future__ import annotations

import mmap
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from elixir import device as dev
from elixir import distributed as edist
from elixir.chunk.quant import FrozenCodec
from elixir.hardware.profile import STEP_MEMORY_FIELDS, BandwidthCurve, HardwareProfile, MiB
from elixir.launch import run_distributed
from elixir.lowp_gemm import widened_gemms
from elixir.optim import CPUAdam, HybridAdam
from elixir.plan.state_format import FROZEN_FORMATS, MASTER_FORMATS, MOMENT_FORMATS, master_torch_dtype

# ---------------------------------------------------------------------------------------------
# measurement


@dataclass(frozen=True)
class MeasureOptions:
    """What :func:`measure` times and how long it may take.

    Attributes:
        sizes: message sizes (bytes) for copy and collective curves.
        repeats: timed repetitions per point (the median is kept).
        optimizer_params: parameters in the timed optimizer update.
        disk_bytes: file size for the disk test (0 skips it).
        matmul_n: side of the square matmul timed per dtype.
        matmul_sides, elementwise_sizes: points of the per-op matmul and elementwise curves.
        skinny_widths, skinny_pool_bytes: the square weights (by width) of the skinny products
            that measure ``matmul_bytes_curve``, and the memory their weights are cycled through
            (more than the caches hold, as a training step's weights are).
        train_widths: widths of the reference transformer stacks timed for ``train_flops``.
        decode_elements: elements of the frozen shard each quantised format's decode is timed on.
        offload_dir: where the disk test writes (a temporary file, removed after).
    """

    sizes: tuple[int, ...] = (256 * 1024, 1 * MiB, 8 * MiB, 64 * MiB, 256 * MiB)
    repeats: int = 3
    optimizer_params: int = 32 * 1024 * 1024
    disk_bytes: int = 512 * MiB
    matmul_n: int = 2048
    train_widths: tuple[int, ...] = (128, 256, 512)
    matmul_sides: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    elementwise_sizes: tuple[int, ...] = (4 * 1024, 64 * 1024, 1 * MiB, 16 * MiB, 64 * MiB)
    skinny_widths: tuple[int, ...] = (64, 256, 1024, 2048)
    skinny_pool_bytes: int = 128 * MiB
    decode_elements: int = 16 * MiB
    offload_dir: str = tempfile.gettempdir()

    @classmethod
    def quick(cls, offload_dir: Optional[str] = None) -> MeasureOptions:
        return cls(
            sizes=(256 * 1024, 1 * MiB, 16 * MiB, 64 * MiB), repeats=2, optimizer_params=8 * 1024 * 1024,
            disk_bytes=128 * MiB, matmul_n=1024, train_widths=(128, 256),
            offload_dir=offload_dir or tempfile.gettempdir(),
        )

    @classmethod
    def tiny(cls, offload_dir: Optional[str] = None) -> MeasureOptions:
        """For tests: seconds, not minutes."""
        return cls(
            sizes=(64 * 1024, 1 * MiB), repeats=1, optimizer_params=64 * 1024, disk_bytes=4 * MiB,
            matmul_n=128, train_widths=(64,), matmul_sides=(32, 64), elementwise_sizes=(4096, 65536),
            skinny_widths=(32, 64), skinny_pool_bytes=1 * MiB, decode_elements=64 * 1024,
            offload_dir=offload_dir or tempfile.gettempdir(),
        )


def _median_time(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return max(times[(len(times) - 1) // 2], 1e-9)  # lower median


def _once(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    """Seconds of one call of ``fn``, the device synchronised before and after."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return max(time.perf_counter() - t0, 1e-9)


def _sync(device: torch.device) -> Callable[[], None]:
    return lambda: dev.synchronize(device)


def measure_copy_curve(
    sizes: tuple[int, ...], src: str, dst: str, pinned: bool, device: torch.device, repeats: int
) -> BandwidthCurve:
    """Copy bandwidth from ``src`` to ``dst`` ("host" or "device"); on CPU-only both are RAM (memcpy)."""
    def alloc(where: str, n: int) -> torch.Tensor:
        if where == "host" or device.type == "cpu":
            return dev.empty_host((n // 4,), torch.float32, pin=pinned)
        return torch.empty(n // 4, dtype=torch.float32, device=device)

    bws = []
    for n in sizes:
        a, b = alloc(src, n), alloc(dst, n)
        a.fill_(1)
        nb = dev.non_blocking_ok(a, b.device)
        t = _median_time(lambda a=a, b=b, nb=nb: b.copy_(a, non_blocking=nb), repeats, _sync(device))
        bws.append(a.numel() * 4 / t)
        del a, b
    return BandwidthCurve(tuple(sizes), tuple(bws))


def measure_first_touch(nbytes: int = 64 * MiB, repeats: int = 5) -> float:
    """Bytes per second at which fresh host memory is faulted in on its first write: a new tensor
    of ``nbytes`` (above malloc's largest mmap threshold, so mapped afresh each time) filled, less
    the same fill of one reused tensor."""
    n = nbytes // 4
    reused = torch.empty(n)
    reused.fill_(0)
    fresh = _median_time(lambda: torch.empty(n).fill_(0), repeats, lambda: None)
    again = _median_time(lambda: reused.fill_(0), repeats, lambda: None)
    return nbytes / max(fresh - again, 1e-9)


#: Least timed decodes per (format, dtype) in :func:`measure_frozen_decode` (milliseconds each).
DECODE_ROUNDS = 7
#: The compute dtypes a quantised frozen shard is timed decoding into.
DECODE_DTYPES = (torch.bfloat16, torch.float32)


def measure_frozen_decode(numel: int, device: torch.device, repeats: int) -> dict[str, dict[str, float]]:
    """Per quantised frozen format and compute dtype name, the elements per second at which
    :meth:`~elixir.chunk.quant.FrozenCodec.decode` (the runtime's decode: the native NF4 kernel
    on a CPU where built, else the torch path) dequantises a shard of ``numel`` normal values
    on ``device`` into one reused payload (its first touch is priced apart), on the threads
    torch has (the runtime's); the median of at least :data:`DECODE_ROUNDS` timings after a
    warm-up (:attr:`~elixir.hardware.HardwareProfile.frozen_decode_elements_per_s`)."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(numel, generator=gen)
    out: dict[str, dict[str, float]] = {}
    for fmt in (f for f in FROZEN_FORMATS if f is not None):
        for dtype in DECODE_DTYPES:
            codec = FrozenCodec(fmt, numel, dtype)
            buf = codec.encode(values.to(device=device, dtype=dtype))
            payload = torch.empty(numel, dtype=dtype, device=device)
            t = _median_time(lambda c=codec, b=buf, p=payload: c.decode(b, out=p), max(DECODE_ROUNDS, repeats),
                             _sync(device))
            out.setdefault(fmt, {})[str(dtype).split(".")[-1]] = numel / t
    return out


def measure_collectives(sizes: tuple[int, ...], repeats: int, group=None) -> dict:
    """All-gather and reduce-scatter bus bandwidth at each full-message size, across the current
    world (call on every rank; needs an initialised process group of 2+ ranks)."""
    world = edist.get_world_size(group)
    if world < 2:
        raise ValueError("collective bandwidth needs 2+ ranks (run under torchrun or run_distributed)")
    d = dev.default_device()
    ag, rs, ar = [], [], []
    for n in sizes:
        n = max(world * 4, n // (world * 4) * world * 4)  # whole fp32 elements, divisible by world
        full = torch.ones(n // 4, dtype=torch.float32, device=d)
        shard = torch.ones(n // 4 // world, dtype=torch.float32, device=d)

        def timed(fn: Callable[[], Any]) -> float:
            """Median seconds of ``fn`` alone: the ranks line up at a barrier before each run, and
            the barrier is not timed (at small sizes it would cost as much as the collective)."""
            fn()  # warm-up
            times = []
            for _ in range(max(3, repeats + 2)):
                dev.synchronize(d)
                edist.barrier(group)
                t0 = time.perf_counter()
                fn()
                dev.synchronize(d)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        t_ag = timed(lambda f=full, s=shard: edist.all_gather_into(f, s, group))
        t_rs = timed(lambda f=full, s=shard: edist.reduce_scatter_into(s, f, group))
        t_ar = timed(lambda f=full: edist.all_reduce(f, group))
        # The slowest rank sets the pace.
        t_ag = max(edist.all_gather_object(t_ag, group))
        t_rs = max(edist.all_gather_object(t_rs, group))
        t_ar = max(edist.all_gather_object(t_ar, group))
        busbytes = n * (world - 1) / world
        ag.append(busbytes / t_ag)
        rs.append(busbytes / t_rs)
        ar.append(2 * busbytes / t_ar)
    return {
        "sizes": tuple(sizes),
        "all_gather": tuple(ag),
        "reduce_scatter": tuple(rs),
        "all_reduce": tuple(ar),
        "world": world,
        "backend": torch.distributed.get_backend(group),
    }


def _collectives_worker(sizes: tuple[int, ...], repeats: int) -> dict:
    return measure_collectives(sizes, repeats)


def _fp32_adam(n_params: int, device: torch.device) -> tuple[torch.optim.Optimizer, str]:
    """An fp32 Adam over one flat of ``n_params`` on ``device`` with its gradient set, and its
    name: elixir's native CPU Adam on CPU when present, otherwise torch's fused AdamW (or
    foreach where fused is unavailable)."""
    p = torch.zeros(n_params, dtype=torch.float32, device=device, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    if device.type == "cpu":
        try:  # the native kernel, where it is available
            return CPUAdam([p], lr=1e-3), "elixir.optim.CPUAdam"
        except Exception:
            pass
    try:
        return torch.optim.AdamW([p], lr=1e-3, fused=True), "torch.optim.AdamW(fused=True)"
    except (RuntimeError, TypeError):
        return torch.optim.AdamW([p], lr=1e-3, foreach=True), "torch.optim.AdamW(foreach=True)"


def measure_optimizer(n_params: int, device: torch.device, repeats: int) -> tuple[float, str]:
    """fp32 Adam update throughput (params/s) on ``device`` (the implementation :func:`_fp32_adam`
    chooses, named in the result)."""
    opt, impl = _fp32_adam(n_params, device)
    t = _median_time(opt.step, repeats, _sync(device))
    return n_params / t, impl


#: Least rounds per format in :func:`measure_optimizer_formats` (a step is tens of ms: cheap).
FORMAT_ROUNDS = 9
#: The low-precision state formats ``hwprofile`` times (every (master, moments) pair but fp32/fp32).
LOWBIT_FORMATS = tuple((m, v) for m in MASTER_FORMATS for v in MOMENT_FORMATS if (m, v) != ("fp32", "fp32"))


def measure_optimizer_formats(n_params: int, device: torch.device, repeats: int,
                              formats: tuple[tuple[str, str], ...] = LOWBIT_FORMATS) -> dict[str, float]:
    """Per state format ``"master/moments"``, the Adam step's seconds per parameter over the fp32
    step's on ``device`` (:attr:`~elixir.hardware.HardwareProfile.optimizer_format_ratio`): one
    flat of ``n_params``, fp32 gradients, the fp32 step of :func:`measure_optimizer` against
    ``HybridAdam(master=..., moments=...)`` (the native kernel on a CPU, its torch path on an
    accelerator), both warmed up, then timed back to back in at least :data:`FORMAT_ROUNDS`
    rounds, alternating which goes first; the median of the per-round ratios (a drift in the load
    hits both alike). Gradients are fp32 (the master's dtype on a torch without ``grad_dtype``)."""
    fp32, _ = _fp32_adam(n_params, device)
    sync = _sync(device)
    out = {}
    for master, moments in formats:
        p = torch.zeros(n_params, dtype=master_torch_dtype(master), device=device, requires_grad=True)
        gdt = p.dtype
        if p.dtype != torch.float32 and hasattr(p, "grad_dtype"):  # torch >= 2.10
            p.grad_dtype, gdt = None, torch.float32  # fp32 gradients into a bf16 master, as the runtime's shards
        p.grad = torch.full((n_params,), 1e-3, dtype=gdt, device=device)
        low = HybridAdam([p], lr=1e-3, master=master, moments=moments)
        ratios = []
        for r in range(max(FORMAT_ROUNDS, repeats) + 1):
            pair = [_once(o.step, sync) for o in ((fp32, low) if r % 2 else (low, fp32))]
            if r:  # the first round is the warm-up (state allocated, pages faulted in)
                ratios.append(pair[1] / pair[0] if r % 2 else pair[0] / pair[1])
        out[f"{master}/{moments}"] = sorted(ratios)[(len(ratios) - 1) // 2]
        del low, p
    return out


def measure_matmul(n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` matrix product in ``dtype`` on ``device`` (the median of ``repeats`` timings)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    with widened_gemms(dtype, device):  # as the runtime computes it (elixir.lowp_gemm)
        t = _median_time(lambda: torch.mm(a, b), repeats, _sync(device))
    return 2.0 * n**3 / t


def measure_train_flops(widths: tuple[int, ...], dtype: torch.dtype, device: torch.device, repeats: int,
                        layers: int = 2, batch: int = 2, seq: int = 128) -> BandwidthCurve:
    """Training throughput of a reference pre-norm transformer stack (GELU MLP, 64-wide heads) at
    each width: FLOPs counted as ``6 * 12 d^2 * layers * tokens`` (the cost model's rule), divided
    by the measured forward+backward time."""
    flops, rates = [], []
    for d in sorted(widths):
        torch.manual_seed(0)
        stack = nn.Sequential(*[
            nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers)
        ]).to(device=device, dtype=dtype)
        x = torch.randn(batch, seq, d, device=device, dtype=dtype)

        def step(stack=stack, x=x) -> None:
            stack(x).float().pow(2).mean().backward()

        with widened_gemms(dtype, device):
            t = _median_time(step, repeats, _sync(device))
        f = 6.0 * 12 * d * d * layers * batch * seq
        flops.append(int(f))
        rates.append(f / t)
    return BandwidthCurve(tuple(flops), tuple(rates))


def _per_call(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, min_s: float = 2e-3) -> float:
    """Median seconds per call of ``fn``, looping enough calls per sample that each takes ``min_s``."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    calls = max(1, min(10_000, int(min_s / max(time.perf_counter() - t0, 1e-7))))

    def many() -> None:
        for _ in range(calls):
            fn()

    return _median_time(many, max(3, repeats), sync) / calls


def measure_matmul_curve(dtype: torch.dtype, device: torch.device, repeats: int,
                         sides: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)) -> BandwidthCurve:
    """Matmul throughput (FLOP/s) by FLOPs per matmul, on square ``n x n`` products, with the
    fixed cost of one op (a 1x1 product) taken out."""
    sync = _sync(device)
    one = torch.ones(1, 1, device=device, dtype=dtype)
    floor = _per_call(lambda: torch.mm(one, one), sync, repeats)
    flops, rates = [], []
    for n in sides:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        with widened_gemms(dtype, device):  # as the runtime computes it (elixir.lowp_gemm)
            t = _per_call(lambda a=a, b=b: torch.mm(a, b), sync, repeats)
        f = 2.0 * n**3
        flops.append(int(f))
        rates.append(f / max(t - floor, t * 0.05))
    return BandwidthCurve(tuple(flops), tuple(rates))


SKINNY_ROWS = 8
"""Rows of the skinny products behind ``matmul_bytes_curve``: a batch of 1 x seq 8, the shape at
which issue 35's regret grid found matmuls running at 5-25 GFLOP/s against a square curve's 66-75."""


def measure_matmul_bytes_curve(dtype: torch.dtype, device: torch.device, repeats: int, flops_curve: BandwidthCurve,
                               widths: tuple[int, ...] = (64, 256, 1024, 2048),
                               pool_bytes: int = 128 * MiB) -> BandwidthCurve:
    """The rate (bytes/s) at which a matmul moves its operands beyond its FLOPs' time on
    ``flops_curve`` (:attr:`HardwareProfile.matmul_bytes_curve`), by the bytes of one matmul.

    Per width ``n``: :data:`SKINNY_ROWS` rows times an ``n x n`` weight (the forward's shape) and
    the weight-gradient's shape (``n x rows`` times ``rows x n``, a fresh weight-sized output),
    the weights cycled through ``pool_bytes`` so each is read cold, as in a training step. The
    time beyond a 1x1 product's and the FLOPs' time, over the operands' bytes, is the rate."""
    sync = _sync(device)
    one = torch.ones(1, 1, device=device, dtype=dtype)
    floor = _per_call(lambda: torch.mm(one, one), sync, repeats)
    rows, moved, rates = SKINNY_ROWS, [], []
    for n in widths:
        nbytes = (2 * rows * n + n * n) * dtype.itemsize
        count = max(2, pool_bytes // (n * n * dtype.itemsize))
        weights = [torch.randn(n, n, device=device).to(dtype) for _ in range(count)]
        grads = [torch.randn(rows, n, device=device).to(dtype) for _ in range(min(count, 64))]
        x = torch.randn(rows, n, device=device).to(dtype)
        xt = x.t().contiguous()

        def sweep(weights=weights, grads=grads, x=x, xt=xt) -> None:
            for i, w in enumerate(weights):
                torch.mm(x, w)
                torch.mm(xt, grads[i % len(grads)])

        with widened_gemms(dtype, device):
            t = _median_time(sweep, max(3, repeats), sync) / (2 * count)
        spare = t - floor - flops_curve.time(2.0 * rows * n * n)
        moved.append(int(nbytes))
        rates.append(nbytes / max(spare, t * 0.05))
        del weights, grads
    return BandwidthCurve(tuple(moved), tuple(rates))


def measure_elementwise_curve(device: torch.device, repeats: int,
                              sizes: tuple[int, ...] = (4 * 1024, 64 * 1024, 1 * MiB, 16 * MiB, 64 * MiB)) -> BandwidthCurve:
    """Bandwidth of a memory-bound op (``a + b`` into a new tensor: reads two, writes one) by the
    bytes it moves, with the fixed cost of one op (on one element) taken out."""
    sync = _sync(device)
    one = torch.ones(1, device=device)
    floor = _per_call(lambda: one + one, sync, repeats)
    moved, rates = [], []
    for n in sizes:
        a = torch.ones(n // 4, device=device)
        b = torch.ones(n // 4, device=device)
        t = _per_call(lambda a=a, b=b: a + b, sync, repeats)
        moved.append(3 * n)
        rates.append(3 * n / max(t - floor, t * 0.05))
    return BandwidthCurve(tuple(moved), tuple(rates))


def measure_op_overhead(device: torch.device, repeats: int, length: int = 200) -> float:
    """Seconds per dispatched op (forward and backward ops alike) in a training step, from a chain
    of ``length`` multiplications of a one-element tensor, forward and backward. Ops are counted at
    the dispatcher, as the tracer counts them."""
    x = torch.ones(1, device=device, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(length):
            y = y * 1.0001
        y.sum().backward()
        x.grad = None

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        step()
    t = _median_time(step, max(3, repeats), _sync(device))
    return t / max(1, _Count.n)


def measure_disk(path: str, nbytes: int, block: int = 8 * MiB) -> tuple[float, float]:
    """Sequential write (with fsync) and read bandwidth of a file in ``path``.

    Uses O_DIRECT where the file system allows it, so the page cache does not flatter the read;
    otherwise drops the file's cached pages with posix_fadvise before reading.
    """
    os.makedirs(path, exist_ok=True)
    fname = os.path.join(path, f".elixir-hwprofile-{os.getpid()}.bin")
    nbytes = max(block, nbytes // block * block)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (block // 4096))
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        except OSError:
            direct = 0
            fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        try:
            for _ in range(nbytes // block):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        t_write = time.perf_counter() - t0
        flags = os.O_RDONLY | direct
        fd = os.open(fname, flags)
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        try:
            while os.readv(fd, [buf]) > 0:
                pass
        finally:
            os.close(fd)
        t_read = time.perf_counter() - t0
    finally:
        buf.close()
        if os.path.exists(fname):
            os.unlink(fname)
    return nbytes / max(t_read, 1e-9), nbytes / max(t_write, 1e-9)


def measure(
    options: Optional[MeasureOptions] = None,
    *,
    collective_world: int = 1,
    name: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> HardwareProfile:
    """Measure this machine into a :class:`HardwareProfile`.

    Collectives are measured across the current process group when one of 2+ ranks is initialised
    (under torchrun: every rank calls this; rank 0 then measures the rest alone while the others
    wait, and every rank gets the profile); otherwise, when ``collective_world >= 2``, over
    ``collective_world`` local ranks spawned for the purpose; otherwise they are left unmeasured
    (a world-1 plan needs none).
    """
    o = options or MeasureOptions()
    say = progress or (lambda s: None)
    say("collectives")
    col = None
    if edist.get_world_size() >= 2:
        col = measure_collectives(o.sizes, o.repeats)
        prof = _measure_local(o, col, name, say) if edist.get_rank() == 0 else None
        return edist.broadcast_object(prof, 0)
    if collective_world >= 2:
        backend = local_backend(collective_world)
        if backend is None:
            say(f"collectives skipped: {collective_world} ranks need as many GPUs for NCCL, "
                f"this machine has {torch.cuda.device_count()}")
        else:
            col = run_distributed(_collectives_worker, collective_world, o.sizes, o.repeats, timeout=600,
                                  backend=backend)[0]
    return _measure_local(o, col, name, say)


def local_backend(ranks: int) -> Optional[str]:
    """The backend for ``ranks`` local ranks spawned to measure this machine: NCCL with one GPU per
    rank where CUDA is present (None when there are fewer GPUs than ranks), gloo on CPU."""
    if not torch.cuda.is_available():
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= ranks else None


def _measure_local(o: MeasureOptions, col: Optional[dict], name: Optional[str],
                   say: Callable[[str], None]) -> HardwareProfile:
    """This machine's profile, measured here, with ``col`` the collectives measured (None: none)."""
    d = dev.default_device()
    dev.keep_host_memory()  # measure host memory as elixir's runtime uses it (freed blocks reused)
    cpu_only = d.type == "cpu"
    host = platform.node() or "unknown"
    src: dict[str, str] = {"*": f"measured by `elixir hwprofile` on {host} ({dev.describe(d)})"}
    curves = _measure_copies(o, d, src, say)
    collectives = _collective_fields(col, host, src)
    optimizer = _measure_optimizers(o, d, src, say)
    compute = _measure_compute(o, d, src, say)
    disk = _measure_disk_fields(o, src, say)
    say("frozen shard decode")
    decode = measure_frozen_decode(o.decode_elements, d, o.repeats)
    src["frozen_decode_elements_per_s"] = (
        f"measured: each quantised frozen format's decode of {o.decode_elements} elements into a reused payload "
        f"({'the native NF4 kernel where built, ' if cpu_only else ''}the runtime's FrozenCodec.decode, "
        f"{torch.get_num_threads()} threads), median of {max(DECODE_ROUNDS, o.repeats)}")
    for f in STEP_MEMORY_FIELDS:  # a training run's figures, not one resource's: the measured defaults
        src[f] = "not measured by hwprofile: the default, measured on the CPU box (see HardwareProfile)"
    return HardwareProfile(
        name=name or ("cpu-" + host if cpu_only else host),
        device_type=d.type,
        device_name=dev.describe(d),
        devices_per_node=max(1, torch.cuda.device_count()) if not cpu_only else 1,
        device_memory_bytes=dev.device_capacity(d),
        host_memory_bytes=dev.host_capacity(),
        compute_threads=1 if cpu_only else 0,
        cores=os.cpu_count() or 1,
        overlap=not cpu_only,
        measured=True,
        source=src,
        host=host,
        created=time.strftime("%Y-%m-%d"),
        notes="",
        **collectives,
        **optimizer,
        **compute,
        **disk,
        **curves,
        frozen_decode_elements_per_s=decode,
    )


def _measure_copies(o: MeasureOptions, d: torch.device, src: dict[str, str],
                    say: Callable[[str], None]) -> dict[str, BandwidthCurve]:
    """The host<->device and device copy curves, by HardwareProfile field; their sources into ``src``."""
    cpu_only = d.type == "cpu"
    label = "memcpy in host RAM (no accelerator: host and device are the same memory)" if cpu_only else "measured"
    say("host<->device copies")
    curves = {}
    for key, s, t, pinned in (
        ("h2d_pinned", "host", "device", True),
        ("h2d_pageable", "host", "device", False),
        ("d2h_pinned", "device", "host", True),
        ("d2h_pageable", "device", "host", False),
        ("device_copy", "device", "device", False),
    ):
        if cpu_only and key in ("h2d_pageable", "d2h_pinned", "d2h_pageable"):
            curves[key] = curves["h2d_pinned"]  # one memcpy curve stands for all directions
        else:
            curves[key] = measure_copy_curve(o.sizes, s, t, pinned, d, o.repeats)
        src[key] = label if key != "device_copy" else ("memcpy in RAM" if cpu_only else "measured")
    return curves


def _collective_fields(col: Optional[dict], host: str, src: dict[str, str]) -> dict[str, Any]:
    """The HardwareProfile fields of the collectives measured (``col``; None: not measured)."""
    ag = rs = arc = None
    world, backend = 0, ""
    if col is not None:
        ag = BandwidthCurve(col["sizes"], col["all_gather"])
        rs = BandwidthCurve(col["sizes"], col["reduce_scatter"])
        arc = BandwidthCurve(col["sizes"], col["all_reduce"]) if "all_reduce" in col else None
        world, backend = col["world"], col["backend"]
        src["all_gather"] = src["reduce_scatter"] = src["all_reduce"] = (
            f"measured: {backend}, {world} ranks on {host}, bus bandwidth")
    return dict(all_gather=ag, reduce_scatter=rs, all_reduce=arc if col is not None else None,
                collective_world=world, collective_backend=backend)


def _measure_optimizers(o: MeasureOptions, d: torch.device, src: dict[str, str],
                        say: Callable[[str], None]) -> dict[str, Any]:
    """The optimizer step's rate and implementation on the host and the device, by HardwareProfile field."""
    say("optimizer")
    opt_rate, opt_impl = {}, {}
    opt_rate["host"], opt_impl["host"] = measure_optimizer(o.optimizer_params, torch.device("cpu"), o.repeats)
    if d.type == "cpu":
        opt_rate["device"], opt_impl["device"] = opt_rate["host"], opt_impl["host"]
    else:
        opt_rate["device"], opt_impl["device"] = measure_optimizer(o.optimizer_params, d, o.repeats)
    src["optimizer_params_per_s"] = f"measured: fp32 Adam over {o.optimizer_params} params ({opt_impl})"
    say("optimizer state formats")
    ratio = {"host": measure_optimizer_formats(o.optimizer_params, torch.device("cpu"), o.repeats)}
    ratio["device"] = ratio["host"] if d.type == "cpu" else measure_optimizer_formats(o.optimizer_params, d, o.repeats)
    src["optimizer_format_ratio"] = (f"measured: each low-precision state format's Adam step over the fp32 one's, "
                                     f"{o.optimizer_params} params, fp32 gradients, interleaved rounds "
                                     "(elixir hwprofile's own timing of each format)")
    return dict(optimizer_params_per_s=opt_rate, optimizer_impl=opt_impl, optimizer_format_ratio=ratio)


def _measure_compute(o: MeasureOptions, d: torch.device, src: dict[str, str],
                     say: Callable[[str], None]) -> dict[str, Any]:
    """Matmul, training, per-op and first-touch figures, by HardwareProfile field."""
    cpu_only = d.type == "cpu"
    say("matmul")
    # On a CPU-only machine compute is timed on one thread and scaled by the cores each rank gets
    # (see per_rank): one-thread figures do not depend on how busy the other cores are.
    saved_threads = torch.get_num_threads()
    if cpu_only:
        torch.set_num_threads(1)
    try:
        flops = {}
        for dt in (torch.float32, torch.bfloat16) + (() if cpu_only else (torch.float16,)):
            flops[str(dt).split(".")[-1]] = measure_matmul(o.matmul_n, dt, d, o.repeats)
        say("training throughput")
        train = {name: measure_train_flops(o.train_widths, getattr(torch, name), d, o.repeats)
                 for name in ("float32", "bfloat16")}
        say("per-op costs")
        mm_curve = {name: measure_matmul_curve(getattr(torch, name), d, o.repeats, o.matmul_sides)
                    for name in ("float32", "bfloat16") + (() if cpu_only else ("float16",))}
        mb_curve = {name: measure_matmul_bytes_curve(getattr(torch, name), d, o.repeats, curve, o.skinny_widths,
                                                     o.skinny_pool_bytes)
                    for name, curve in mm_curve.items()}
        ew_curve = measure_elementwise_curve(d, o.repeats, o.elementwise_sizes)
        op_overhead = measure_op_overhead(d, o.repeats)
        first_touch = measure_first_touch(repeats=o.repeats) if cpu_only else 0.0
    finally:
        torch.set_num_threads(saved_threads)
    one = " on 1 thread (scaled by the cores per rank)" if cpu_only else ""
    src["matmul_flops"] = f"measured: {o.matmul_n}x{o.matmul_n} torch.mm{one}"
    src["train_flops"] = (f"measured: 2-layer pre-norm transformer stacks of widths {list(o.train_widths)}, "
                          f"batch 2, seq 128, forward+backward{one}")
    src["matmul_curve"] = (f"measured: square torch.mm {min(o.matmul_sides)} to {max(o.matmul_sides)} wide, "
                           f"less a 1x1 product's time{one}")
    src["matmul_bytes_curve"] = (f"measured: {SKINNY_ROWS}-row products against cold square weights "
                                 f"{min(o.skinny_widths)} to {max(o.skinny_widths)} wide (forward and "
                                 f"weight-gradient shapes), time beyond the FLOPs' on matmul_curve{one}")
    src["elementwise"] = (f"measured: a + b into a new tensor, {min(o.elementwise_sizes)} to {max(o.elementwise_sizes)} "
                          f"bytes each, less a 1-element op's time{one}")
    src["op_overhead_s"] = "measured: a chain of 200 one-element multiplications, forward and backward, per dispatched op"
    src["first_touch_bytes_per_s"] = ("measured: a new 64 MiB tensor filled, less a reused one's fill (page faults)"
                                      if cpu_only else "not measured: an accelerator's caching allocator reuses blocks")
    return dict(matmul_flops=flops, train_flops=train, matmul_curve=mm_curve, matmul_bytes_curve=mb_curve,
                elementwise=ew_curve,
                op_overhead_s=op_overhead, first_touch_bytes_per_s=first_touch)


def _measure_disk_fields(o: MeasureOptions, src: dict[str, str], say: Callable[[str], None]) -> dict[str, Any]:
    """Disk read and write bandwidth in ``o.offload_dir`` and its free bytes, by HardwareProfile field."""
    say("disk")
    if o.disk_bytes > 0:
        rd, wr = measure_disk(o.offload_dir, o.disk_bytes)
        src["disk_read_bytes_per_s"] = src["disk_write_bytes_per_s"] = (
            f"measured: {o.disk_bytes >> 20} MiB sequential in {o.offload_dir} (fsync; O_DIRECT where allowed)"
        )
    else:
        rd = wr = 1.0
        src["disk_read_bytes_per_s"] = src["disk_write_bytes_per_s"] = "not measured (placeholder 1 B/s)"
    free_disk = shutil.disk_usage(o.offload_dir).free if os.path.isdir(o.offload_dir) else 0
    return dict(disk_bytes=free_disk, disk_read_bytes_per_s=rd, disk_write_bytes_per_s=wr)
