#!/usr/bin/env bash
# tests/soak/run.sh [--steps N] [--seed S] [--checkpoint-every K] [--muond PATH] [--keep]
# Two jobs x 4 ranks on one muond for N steps (default 300): one update-mode job over shared
# memory, one apply-mode job over gRPC, random shapes from a printed seed, background checkpoints,
# /metrics scraped every second. Passes when every rank's results and each job's final state equal
# the same job run alone in a fresh daemon bit for bit, the daemon's private memory grows <= 8 MiB
# and its descriptors not at all after warm-up, and its log holds no error (tests/soak/soak.py).
# Needs build/bin/muond and build/lib/libmuond_client.so (targets muond, muond_client_shared).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec /usr/bin/python3 "$here/soak.py" "$@"
