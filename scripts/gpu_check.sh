#!/usr/bin/env bash
# The GPU check: one call of at most 6 minutes on a GPU machine (no network needed). Every step
# writes under OUT as it goes, so a call cut short still leaves what finished.
#
#   scripts/gpu_check.sh OUT          # main mode (<= 360 s)
#   scripts/gpu_check.sh OUT bench    # bench mode (<= 360 s)
#   scripts/gpu_check.sh --print-budget
#
# Main mode, in order:
#   1. env     environment (env.txt) and a 10-line probe (probe.txt): CUDA matmul, exact-size
#              pinned memory, a side stream, the native extension
#   2. smoke   scripts/gpu_smoke.py: GPT-2 and LLaMA in bf16 across HH/DH/HK/DD placements,
#              HybridAdam with fused_step on and off, a world-1 plan that gathers, HH and DH again
#              under TORCH_CUDA_SANITIZER=1 (smoke.jsonl, smoke_sanitizer.jsonl)
#   3. tests   the CUDA test matrix, one case per test, the quick stream test first, then host and
#              disk cases (cuda_tests.xml junit, cuda_tests.log)
#   4. ckpt    the checkpoint round trips (ckpt_tests.xml, ckpt_tests.log)
#   5. adam    the HybridAdam part of the bench (gpu_bench.json / .md)
#   6. slack   what is left (graces of killed steps, a build of the extension on a mismatch)
# Bench mode: env, then bench/gpu.py's step part at 0.7B (elixir, plain torch, FSDP2, FSDP2 with
# CPU offload) and one capacity rung under a 24 GiB cap (gpu_bench.json / .md), every system with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
#
# Every step runs under `timeout -s INT` (pytest then still writes its junit file), with the
# planned seconds of --print-budget, or less when the call is running late. summary.txt gets a
# line per step (and the tails that matter).
#
# The native extension is not rebuilt here: build it on the development machine
# (`python setup.py build_ext --inplace`) and carry `elixir/_C*.so` in the working tree. It is
# pybind11 over raw buffers (no torch ABI), but the .so is tied to the Python minor version: the
# GPU machine's Python is 3.12, so a cpython-311 .so does not load there. On such a mismatch the
# script builds the extension in place there, once, under `timeout 120` (log: build.log; it takes
# from the slack); if that fails, elixir runs without it (pure-torch host Adam, a warning) and
# summary.txt says so. ELIXIR_GPU_CHECK_BUILD=0 skips the build (fall back at once).
#
# Exit codes: 0 every step ran (read summary.txt: failures are listed, they do not stop later
# steps), 2 bad usage, 3 no GPU (stopped at the first CUDA step, after env), 4 elixir cannot be
# imported.
#
# Environment: PYTHON (default /opt/torch/.venv/bin/python when present, else python3);
# ELIXIR_GPU_CHECK_ALLOW_CPU=1 rehearses either mode on a machine without a GPU (tiny bench sizes).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOTAL=360
GRACE=5  # seconds a step gets after SIGINT before SIGKILL
# planned seconds per step: "mode step seconds"
PLAN="main env 20
main smoke 90
main tests 120
main ckpt 40
main adam 40
main slack 50
bench env 20
bench step 170
bench capacity 130
bench slack 40"

print_budget() {
  echo "$PLAN" | while read -r mode step s; do echo "$mode $step $s s"; done
  for mode in main bench; do
    echo "$PLAN" | awk -v m="$mode" '$1 == m { t += $3 } END { print m " total " t " s" }'
  done
}

usage() { echo "usage: $0 OUT [main|bench] | $0 --print-budget" >&2; exit 2; }
[ $# -ge 1 ] || usage
if [ "$1" = "--print-budget" ]; then print_budget; exit 0; fi
OUT=$1
MODE=${2:-main}
case "$MODE" in main|bench) ;; *) usage ;; esac
planned() { echo "$PLAN" | awk -v m="$MODE" -v s="$1" '$1 == m && $2 == s { print $3 }'; }

mkdir -p "$OUT" || { echo "cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
START=$(date +%s)
END=$(( START + TOTAL - $(planned slack) ))
elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[gpu_check +$(elapsed)s] $*" | tee -a "$OUT/summary.txt"; }
echo "=== gpu_check $MODE, $(date -u '+%Y-%m-%d %H:%M:%S UTC') ===" >> "$OUT/summary.txt"  # calls append

if [ -z "${PYTHON:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python ]; then PYTHON=/opt/torch/.venv/bin/python; else PYTHON=python3; fi
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# the CUDA tests' ranks start as fresh interpreters here, as they did when this check was sized: the
# CPU suite forks them from a preloaded server (tests/conftest.py), not yet tried with NCCL
export ELIXIR_TEST_SPAWN="${ELIXIR_TEST_SPAWN:-1}"
say "elixir at $ROOT, mode $MODE, python $PYTHON, output in $OUT, PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF"

# run_step NAME LOG CMD...: CMD under `timeout -s INT` for the step's planned seconds (less when
# late); its output goes to OUT/LOG; the outcome goes to summary.txt. Returns CMD's exit code.
run_step() {
  local name=$1 log=$2; shift 2
  local want left limit rc t0
  want=$(planned "$name")
  left=$(( END - $(date +%s) ))
  limit=$(( want < left ? want : left ))
  if [ "$limit" -lt 5 ]; then say "$name: SKIPPED (out of time: ${left}s left of the call's budget)"; return 124; fi
  say "$name: up to ${limit}s (planned ${want}s; log: $log)"
  t0=$(date +%s)
  timeout -s INT -k "$GRACE" "$limit" "$@" > "$OUT/$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then say "$name: ok in $(( $(date +%s) - t0 ))s"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ] || [ $rc -eq 130 ]; then say "$name: TIMED OUT after ${limit}s (partial output kept)"
  else say "$name: FAILED (exit $rc) in $(( $(date +%s) - t0 ))s"; fi
  return $rc
}

# 1. environment and the probe
if ! "$PYTHON" -c "import elixir" 2>> "$OUT/summary.txt"; then say "ERROR: elixir cannot be imported"; exit 4; fi
NATIVE_OK=$("$PYTHON" -c "from elixir import _native; print(int(_native.get_native() is not None))" 2>/dev/null || echo 0)
if [ "$NATIVE_OK" != 1 ]; then
  PYVER=$("$PYTHON" -c "import sys; print(f'cpython-{sys.version_info[0]}{sys.version_info[1]}')")
  say "native extension: none for $PYVER here (carried: $(cd elixir && ls _C*.so 2>/dev/null | tr '\n' ' '))"
  if [ "${ELIXIR_GPU_CHECK_BUILD:-1}" = 1 ] && timeout 120 "$PYTHON" setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1 \
     && [ "$("$PYTHON" -c "from elixir import _native; print(int(_native.get_native() is not None))" 2>/dev/null)" = 1 ]; then
    say "native extension: built in place for $PYVER (build.log)"
  else
    say "WARNING: native extension unavailable; elixir falls back to pure torch for the host Adam (build.log)"
  fi
fi
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
print("cpus", os.cpu_count(), "PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
for mod in ("transformers", "accelerate", "lightning", "safetensors", "pytest", "pybind11"):
    try:
        print(mod, getattr(__import__(mod), "__version__", "?"))
    except Exception as e:
        print(mod, "MISSING", type(e).__name__)
import elixir
from elixir import _native
print("elixir", elixir.__version__, "at", os.path.dirname(elixir.__file__))
print("native extension", "loaded" if _native.get_native() is not None else "missing (torch fallback)")
PY
cat "$OUT/env.txt"

# the first CUDA step: stop here, clearly, on a machine without a GPU
TINY=()
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)"; then
  if [ "${ELIXIR_GPU_CHECK_ALLOW_CPU:-0}" = "1" ]; then
    say "no GPU; ELIXIR_GPU_CHECK_ALLOW_CPU=1: rehearsing on CPU (tiny bench sizes; the CUDA tests skip)"
    TINY=(--tiny)
  else
    say "NO GPU: torch.cuda.is_available() is False here. Stopped at the first CUDA step: the probe, smoke, CUDA tests and bench did not run. Exit code 3."
    exit 3
  fi
fi
run_step env probe.txt "$PYTHON" - <<'PY'
import time, torch
from elixir import device as dev, _native
d = dev.default_device(); t0 = time.perf_counter(); print("device", dev.describe(d))
a = torch.randn(2048, 2048, device=d, dtype=torch.bfloat16); print("matmul bf16 ok", float((a @ a).float().abs().mean()) > 0)
h = dev.empty_host((1 << 20,), torch.float32); h.fill_(1.0); print("exact-size pinned", h.is_pinned() if d.type == "cuda" else "n/a (cpu)", dev.pinned_bytes())
s = dev.new_stream(d); e = dev.new_event(d)
with dev.use_stream(s): x = h.to(d, non_blocking=True); e.record(s)
dev.current_stream(d).wait_event(e); print("side stream h2d ok", float(x.sum()) == float(1 << 20))
print("native extension", "loaded" if _native.get_native() is not None else "MISSING (torch fallback)")
dev.synchronize(d); print(f"probe {time.perf_counter() - t0:.2f}s, max_memory_allocated {dev.max_memory_allocated(d)}")
PY
cat "$OUT/probe.txt" >> "$OUT/summary.txt"

if [ "$MODE" = main ]; then
  # 2. the smoke cases (one JSON line each, written as they end)
  ALLOW=(); [ ${#TINY[@]} -gt 0 ] && ALLOW=(--allow-cpu)
  run_step smoke smoke.log "$PYTHON" scripts/gpu_smoke.py --out "$OUT" ${ALLOW[@]+"${ALLOW[@]}"}
  grep -h '"summary"' "$OUT/smoke.jsonl" >> "$OUT/summary.txt" 2>/dev/null || say "smoke: no summary line (cut short; finished cases are in smoke.jsonl)"
  grep -E "^\[smoke\].*(FAILED|ERROR)" "$OUT/smoke.log" >> "$OUT/summary.txt" || true

  # 3. the CUDA test matrix, one case per test (the checkpoint round trips are step 4)
  run_step tests cuda_tests.log "$PYTHON" -m pytest -m cuda -v -rA -p no:cacheprovider tests/test_cuda.py \
    -k "not checkpoint" --junitxml="$OUT/cuda_tests.xml"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_tests.log" | tail -n 30 >> "$OUT/summary.txt" || true

  # 4. the checkpoint round trips
  run_step ckpt ckpt_tests.log "$PYTHON" -m pytest -m cuda -v -rA -p no:cacheprovider tests/test_cuda.py \
    -k "checkpoint" --junitxml="$OUT/ckpt_tests.xml"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/ckpt_tests.log" | tail -n 10 >> "$OUT/summary.txt" || true

  # 5. the Adam part of the bench
  run_step adam bench_adam.log "$PYTHON" bench/gpu.py --out "$OUT" --parts adam --budget-s "$(( $(planned adam) - 5 ))" \
    ${TINY[@]+"${TINY[@]}"}
  grep -A3 "HybridAdam" "$OUT/gpu_bench.md" >> "$OUT/summary.txt" 2>/dev/null || true
else
  # bench mode: step time at 0.7B, then one capacity rung under the 24 GiB cap (elixir plans with
  # the hardware profile a main-mode call measured into OUT, else the shipped H100 one)
  HW=(); [ -f "$OUT/hw.json" ] && HW=(--hardware "$OUT/hw.json")
  run_step step bench_step.log "$PYTHON" bench/gpu.py --out "$OUT" --name gpu_bench_step --parts step --size 0.7B \
    --batch 4 --seq 1024 --steps 3 --systems elixir plain fsdp2 fsdp2-offload ${HW[@]+"${HW[@]}"} \
    --budget-s "$(( $(planned step) - 10 ))" ${TINY[@]+"${TINY[@]}"}
  run_step capacity bench_capacity.log "$PYTHON" bench/gpu.py --out "$OUT" --name gpu_bench_capacity --parts capacity \
    --cap-gib 24 --cap-sizes plain=1.1B fsdp2-offload=3.4B elixir=6.7B --trial-max-s 110 ${HW[@]+"${HW[@]}"} \
    --budget-s "$(( $(planned capacity) - 10 ))" ${TINY[@]+"${TINY[@]}"}
  for f in gpu_bench_step gpu_bench_capacity; do [ -f "$OUT/$f.md" ] && cat "$OUT/$f.md" >> "$OUT/summary.txt"; done
fi
say "done in $(elapsed)s (budget ${TOTAL}s)"
exit 0
