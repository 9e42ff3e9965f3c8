#!/usr/bin/env bash
# Configures and builds muond into build/ (Ninja, ccache when present). Extra arguments go to cmake
# at configure time. Used by quickstart.sh and tests/run.sh.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
jobs="${MUOND_BUILD_JOBS:-$(nproc)}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build build -j "$jobs"
