#!/usr/bin/env bash
# Create (or reuse) the virtualenv and install elixir into it, editable, with the native extension.
# Sourced by scripts/demo.sh and scripts/test.sh. Set ELIXIR_VENV to use another venv (for example
# one that already holds your CUDA build of torch: a torch already present is never replaced).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ELIXIR_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${ELIXIR_EXTRAS:-hf}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[elixir] creating virtualenv $VENV" >&2
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pip_q() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  # The pinned CPU wheel: an unpinned `torch` would pull a multi-GB CUDA build.
  echo "[elixir] installing torch==2.13.0 (CPU)" >&2
  pip_q "torch==2.13.0"
fi
stamp="$VENV/.elixir-installed-$EXTRAS"
if [ ! -f "$stamp" ] || [ "$ROOT/setup.py" -nt "$stamp" ] || [ -n "$(find "$ROOT/csrc" -newer "$stamp" -print -quit)" ]; then
  echo "[elixir] installing elixir[$EXTRAS] (editable, builds the native extension)" >&2
  pip_q setuptools wheel pybind11
  # The distribution was called "elixir" before it took the free name elixir-train: an editable
  # install of this tree under the old name would shadow the new one, so it goes first.
  if "$VPY" -m pip show elixir 2>/dev/null | grep -qx "Editable project location: $ROOT"; then
    "$VPY" -m pip uninstall -q -y elixir
  fi
  pip_q --no-build-isolation -e "$ROOT[$EXTRAS]"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
