"""NVMe offload in HybridAdam: the step's disk bandwidth against ``dd`` on the same directory, and
peak RSS with ``nvme_offload_fraction`` 0 and 1, each in its own process, same run.

    python bench/nvme_optimizer.py --dir /mnt/nvme/tmp            # 124M params (GPT-2 small's count)
    python bench/nvme_optimizer.py --numel 2000000 --steps 2      # smoke size

Per fraction, a child process builds ``--numel`` fp32 parameters (in ``--tensors`` tensors) with
fixed gradients, takes one warm-up step and times ``--steps`` steps of
``HybridAdam(nvme_offload_fraction=f, nvme_offload_dir=--dir)``. It reports the step time, the
bytes the step read and wrote, the moments kept on disk and its peak RSS (VmHWM, reset once the
parameters and gradients exist, so that the construction's temporaries do not set it).

Disk figures: ``dd`` writes ``--dd-mib`` MiB sequentially (8 MiB blocks, ``conv=fdatasync``) and
reads it back (``iflag=direct`` where the file system allows, so the page cache does not answer).
The step's bandwidth is its bytes moved over its time; *efficiency* is the time ``dd`` would need
for the same reads and writes over the step's time (target >= 80%). The optimizer's own I/O is buffered
(pread/pwrite through the page cache, no fsync); so that moments smaller than free memory still
give disk-bound figures, each timed step ends with an ``fdatasync`` of the file and a drop of its
cached pages (``POSIX_FADV_DONTNEED``), both counted in the step: its writes reach the disk and
the next step reads from the disk. ``--page-cache`` leaves both out (the optimizer as it runs;
efficiency can then exceed 100%). RSS: the saving of
fraction 1 over fraction 0 against the bytes offloaded (target >= 80%).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time


def _child(fraction: float, numel: int, tensors: int, steps: int, directory: str, bucket: int, disk_bound: bool) -> dict:
    import torch

    from elixir import device as dev
    from elixir.optim import HybridAdam

    torch.manual_seed(0)
    sizes = [numel // tensors] * tensors
    params = [torch.nn.Parameter(torch.randn(n) * 0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    # the peak from here on: parameters and gradients (the same in both runs) plus what the
    # optimizer holds; the construction's temporaries and malloc's holes would otherwise set it
    dev.release_free_host_memory()
    base_rss = dev.rss_bytes()
    reset_hwm = _reset_peak_rss()
    opt = HybridAdam(params, lr=1e-4, nvme_offload_fraction=fraction, nvme_offload_dir=directory, nvme_offload_bucket_numel=bucket)
    opt.step()  # warm-up: creates the state (and the file layout)
    store = opt.nvme.store if opt.nvme is not None else None
    read0, written0 = (store.bytes_read, store.bytes_written) if store else (0, 0)
    fd = store.location.file.fd if store is not None and disk_bound else None
    if fd is not None:
        _drain(fd)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
        if fd is not None:
            _drain(fd)  # counted: the step's writes reach the disk, and the next step reads from it
    dt = (time.perf_counter() - t0) / steps
    out = {"fraction": fraction, "step_s": dt, "peak_rss": dev.peak_rss_bytes(), "base_rss": base_rss,
           "peak_from_base": reset_hwm}
    if store is not None:
        r = store.report()
        out.update(
            moved_per_step=(r["bytes_read"] + r["bytes_written"] - read0 - written0) / steps,
            read_per_step=(r["bytes_read"] - read0) / steps,
            written_per_step=(r["bytes_written"] - written0) / steps,
            offloaded=opt.nvme.offloaded_bytes,
            peak_staged=r["peak_staged_bytes"],
        )
    return out


def _drain(fd: int) -> None:
    """Write the file's dirty pages to the disk and drop its cached pages, so that the next reads
    come from the disk: a disk-bound step even where the moments would fit in the page cache."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _reset_peak_rss() -> bool:
    """Set VmHWM to the current RSS (Linux: ``/proc/self/clear_refs``); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _dd_rate(text: str) -> float:
    """Bytes per second from dd's summary line ('N bytes ... copied, T s, ...')."""
    m = re.search(r"(\d+) bytes.*copied, ([\d.]+) s", text)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {text!r}")
    return int(m.group(1)) / float(m.group(2))


def dd_bandwidth(directory: str, mib: int) -> dict:
    path = os.path.join(directory, f"elixir-dd-{os.getpid()}.bin")
    try:
        w = subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={max(1, mib // 8)}", "conv=fdatasync"],
            capture_output=True, text=True, check=True,
        )
        r = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"], capture_output=True, text=True)
        direct = r.returncode == 0
        if not direct:  # tmpfs and others refuse O_DIRECT
            r = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M"], capture_output=True, text=True, check=True)
        return {"write": _dd_rate(w.stderr), "read": _dd_rate(r.stderr), "read_direct": direct}
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=124_000_000)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket", type=int, default=4 << 20, help="nvme_offload_bucket_numel")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--dd-mib", type=int, default=1024)
    ap.add_argument("--page-cache", action="store_true",
                    help="let the page cache answer (no fdatasync and cache drop after each step): the "
                         "optimizer as it runs, but with moments smaller than free memory not disk-bound")
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="elixir-nvme-bench-")
    if args.child is not None:
        print(json.dumps(_child(args.child, args.numel, args.tensors, args.steps, directory, args.bucket, not args.page_cache)))
        return

    from rich.console import Console
    from rich.table import Table

    os.makedirs(directory, exist_ok=True)
    dd = dd_bandwidth(directory, args.dd_mib)
    runs = {}
    for f in (0.0, 1.0):
        cmd = [sys.executable, __file__, "--child", str(f), "--numel", str(args.numel), "--tensors", str(args.tensors),
               "--steps", str(args.steps), "--bucket", str(args.bucket), "--dir", directory] + (["--page-cache"] if args.page_cache else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        runs[f] = json.loads(out.stdout.strip().splitlines()[-1])
    mem, disk = runs[0.0], runs[1.0]
    ideal = disk["read_per_step"] / dd["read"] + disk["written_per_step"] / dd["write"]
    mib = 2**20
    t = Table(title=f"HybridAdam NVMe offload: {args.numel / 1e6:.0f}M fp32 params, dir {directory}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("dd sequential write (fdatasync)", f"{dd['write'] / mib:.0f} MiB/s")
    t.add_row(f"dd sequential read ({'O_DIRECT' if dd['read_direct'] else 'buffered'})", f"{dd['read'] / mib:.0f} MiB/s")
    t.add_row("step time, fraction 0", f"{mem['step_s']:.3f} s")
    t.add_row("step time, fraction 1", f"{disk['step_s']:.3f} s")
    t.add_row("step disk bytes/s (read+write)", f"{disk['moved_per_step'] / disk['step_s'] / mib:.0f} MiB/s")
    t.add_row("efficiency vs dd (dd time for the same bytes / step time)", f"{100 * ideal / disk['step_s']:.0f}%")
    t.add_row("moments on disk", f"{disk['offloaded'] / mib:.0f} MiB")
    since = "since parameters and gradients existed" if mem["peak_from_base"] and disk["peak_from_base"] else "whole process"
    t.add_row(f"peak RSS, fraction 0 ({since})", f"{mem['peak_rss'] / mib:.0f} MiB")
    t.add_row(f"peak RSS, fraction 1 ({since})", f"{disk['peak_rss'] / mib:.0f} MiB")
    saved = mem["peak_rss"] - disk["peak_rss"]
    t.add_row("RSS saved / bytes offloaded (target >= 80%)", f"{100 * saved / disk['offloaded']:.0f}%")
    Console().print(t)
    print(json.dumps({"dd": dd, "runs": {str(k): v for k, v in runs.items()}}))


if __name__ == "__main__":
    main()
