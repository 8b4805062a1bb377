#!/usr/bin/env bash
# Set everything up and run the test suite. Extra arguments go to pytest.
set -euo pipefail
ELIXIR_EXTRAS=dev,hf source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
set +e
# Two pytest workers, one test file each at a time (module fixtures launch once): on the 2-core box
# the suite's processes spend much of their time importing, starting ranks and waiting on gloo, so
# two files side by side take 541 s where one after another takes 691 s (2026-11-28, 707 tests).
# ELIXIR_TEST_WORKERS=0 runs in this process only; more workers need more cores and memory.
workers="${ELIXIR_TEST_WORKERS:-2}"
python -m pytest -m "not slow" --timeout=900 -n "$workers" --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
