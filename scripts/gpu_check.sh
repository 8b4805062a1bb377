#!/usr/bin/env bash
# One command for a GPU machine (no network needed): install elixir into the Python that has the
# CUDA torch, print the environment, run the `cuda` tests, run the GPU bench. Every result goes
# under OUTDIR.
#
#   scripts/gpu_check.sh OUTDIR [MODE]
#
# MODE (each fits the 10-minute limit of one call):
#   all       (default) install, environment, cuda tests (at most 200 s), then the bench's hardware
#             profile, HybridAdam overlap and step-time parts in the time left (under ~9.5 min)
#   tests     install, environment, cuda tests only
#   bench     install, environment, the whole bench (hardware profile, Adam overlap, step time,
#             capacity; 540 s)
#   capacity  install, environment, the bench's capacity part alone (540 s; plans with OUTDIR/hw.json
#             when an earlier call left one there), written to gpu_capacity.json / .md
#
# Files in OUTDIR: env.txt, install.log, cuda_tests.log, cuda_tests.xml (junit), gpu_bench.json,
# gpu_bench.md, hw.json, logs/ (one log per bench trial), summary.txt.
# Suggested on a fresh GPU machine: `gpu_check.sh OUT` then `gpu_check.sh OUT capacity`.
#
# Exit codes: 0 done (read summary.txt for test failures and the bench's figures; a failing test
# does not stop the bench), 2 bad usage, 3 no GPU: torch here sees no CUDA device, so nothing after
# the environment check ran, 4 elixir cannot be imported even from the source tree.
#
# Environment: PYTHON (default /opt/torch/.venv/bin/python when present, else python3);
# ELIXIR_GPU_CHECK_INSTALL=0 skips the pip install (uses the source tree on PYTHONPATH);
# ELIXIR_GPU_CHECK_ALLOW_CPU=1 rehearses the whole script on a machine without a GPU (tiny bench).
set -uo pipefail

usage() { echo "usage: $0 OUTDIR [all|tests|bench|capacity]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1
MODE=${2:-all}
case "$MODE" in all|tests|bench|capacity) ;; *) usage ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT" || { echo "cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[gpu_check +$(elapsed)s] $*" | tee -a "$OUT/summary.txt"; }
echo "=== gpu_check $MODE, $(date -u '+%Y-%m-%d %H:%M:%S UTC') ===" >> "$OUT/summary.txt"  # calls append

if [ -z "${PYTHON:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python ]; then PYTHON=/opt/torch/.venv/bin/python; else PYTHON=python3; fi
fi
cd "$ROOT"
say "elixir at $ROOT, mode $MODE, python $PYTHON, output in $OUT"

# 1. install (no network: no dependencies, no build isolation; the C++ extension is optional)
if [ "${ELIXIR_GPU_CHECK_INSTALL:-1}" = "0" ]; then
  say "install skipped (ELIXIR_GPU_CHECK_INSTALL=0); would run: $PYTHON -m pip install --no-deps --no-build-isolation -e ."
else
  if "$PYTHON" -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
    say "installed: pip install --no-deps --no-build-isolation -e . (log: install.log)"
  else
    say "WARNING: pip install failed (see install.log); using the source tree on PYTHONPATH instead"
    if "$PYTHON" setup.py build_ext --inplace >> "$OUT/install.log" 2>&1; then
      say "built the native extension in place (setup.py build_ext --inplace)"
    else
      say "WARNING: the native extension did not build either; elixir falls back to pure torch"
    fi
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import elixir" 2>> "$OUT/summary.txt"; then
  say "ERROR: elixir cannot be imported"
  exit 4
fi

# 2. the environment
"$PYTHON" - > "$OUT/env.txt" 2>&1 <<'PY'
import os, platform, sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("platform", platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")
print("cpus", os.cpu_count())
for mod in ("transformers", "accelerate", "lightning", "safetensors", "pytest", "pybind11", "rich", "scipy", "networkx"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "MISSING", type(e).__name__)
import elixir
from elixir import _native
print("elixir", elixir.__version__, "at", os.path.dirname(elixir.__file__))
print("native extension", "loaded" if _native.get_native() is not None else "missing (torch fallback)")
PY
cat "$OUT/env.txt"

# 3. the first CUDA step: stop here, clearly, on a machine without a GPU
TINY=()
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)"; then
  if [ "${ELIXIR_GPU_CHECK_ALLOW_CPU:-0}" = "1" ]; then
    say "no GPU; ELIXIR_GPU_CHECK_ALLOW_CPU=1: going on at tiny sizes on CPU (a rehearsal of this script)"
    TINY=(--tiny)
  else
    say "NO GPU: torch.cuda.is_available() is False here. The cuda tests and the GPU bench did not run. Exit code 3."
    exit 3
  fi
fi

# 4. the cuda tests
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  say "cuda tests (at most 200 s; log: cuda_tests.log, junit: cuda_tests.xml)"
  timeout -k 10 200 "$PYTHON" -m pytest -m cuda -v -rA -p no:cacheprovider tests/test_cuda.py \
    --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/cuda_tests.log"
  if [ $rc -eq 0 ]; then say "cuda tests: passed"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then say "cuda tests: TIMED OUT after 200 s (partial log in cuda_tests.log)"
  else say "cuda tests: FAILED (pytest exit $rc; see cuda_tests.log)"; fi
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/cuda_tests.log" >> "$OUT/summary.txt" || true
fi

# 5. the bench
BENCH=()
case "$MODE" in
  all) left=$(( 560 - $(elapsed) )); BENCH=(--parts hw adam step --budget-s "$left") ;;
  bench) BENCH=(--budget-s 540) ;;
  capacity)
    BENCH=(--parts capacity --budget-s 540 --name gpu_capacity)
    [ -f "$OUT/hw.json" ] && BENCH+=(--hardware "$OUT/hw.json") ;;
esac
if [ ${#BENCH[@]} -gt 0 ]; then
  say "bench: bench/gpu.py --out $OUT ${BENCH[*]}"
  "$PYTHON" bench/gpu.py --out "$OUT" "${BENCH[@]}" ${TINY[@]+"${TINY[@]}"}
  say "bench exit code $?"
  NAME=gpu_bench; [ "$MODE" = capacity ] && NAME=gpu_capacity
  [ -f "$OUT/$NAME.md" ] && cat "$OUT/$NAME.md" >> "$OUT/summary.txt" && say "tables in $NAME.md"
fi
say "done"
exit 0
