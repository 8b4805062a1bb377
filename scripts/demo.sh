#!/usr/bin/env bash
# Set everything up and run the main job: `elixir demo` on 2 local ranks. Extra arguments go to it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
exec elixir demo "$@"
