#!/usr/bin/env bash
# Set everything up and run the test suite. Extra arguments go to pytest.
set -euo pipefail
ELIXIR_EXTRAS=dev,hf source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
set +e
python -m pytest -m "not slow" --timeout=900 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
