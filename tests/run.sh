#!/usr/bin/env bash
# Runs every test: installs what is missing, builds (with tests and benchmarks), runs ctest
# (unit, integration and Python tests), then the ASan + UBSan lane and the fuzzers.
# Run as root on a fresh Debian 12 machine. This is what CI runs (.ci/run).
#   tests/run.sh                      by default, in this order, each lane timed:
#                                     1. install (deploy/install-deps.sh)
#                                     2. build/ (deploy/build.sh, tests, benchmarks, test hooks)
#                                     3. ctest in build/, every test, -j MUOND_TEST_JOBS (2);
#                                        bf16 cases run on the CPU's own path and again on the
#                                        emulated one (--cpu-isa avx2: the *_emulated entries of
#                                        Newton-Schulz, device conformance, the OpenCL kernels and
#                                        the Python bf16 tests)
#                                     4. the ASan + UBSan lane (tests/sanitize/run.sh address: its
#                                        own build in build-asan/, -O1 -g1, then the unit,
#                                        integration, shared-memory, hostile and fuzz-replay
#                                        suites under it); MUOND_SANITIZE_LANE=0 leaves it out
#                                     5. every fuzz target for MUOND_FUZZ_SECONDS (30) s, 2 at a
#                                        time (build-fuzz/, tests/fuzz/run.sh)
#                                     MUOND_EXTRA_LANES=0 stops after lane 3.
#   tests/run.sh --sanitize address   only the ASan + UBSan lane (build-asan/)
#   tests/run.sh --sanitize thread    only the TSan lane (build-tsan/): job engine, shared memory,
#                                     checkpoints (not in the default run)
# Each lane runs even when an earlier one failed; the exit status is non-zero if any failed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

case "${1:-}" in
  "") ;;
  --sanitize)
    case "${2:-}" in
      address | thread) ;;
      *) echo "tests/run.sh: --sanitize takes address or thread" >&2; exit 2 ;;
    esac
    deploy/install-deps.sh
    exec tests/sanitize/run.sh "$2"
    ;;
  *) echo "usage: tests/run.sh [--sanitize address|thread]" >&2; exit 2 ;;
esac

lane() {  # lane NAME COMMAND...: runs a lane, records its time and outcome
  local name="$1" start=$SECONDS rc=0
  shift
  echo "=== tests/run.sh: $name"
  "$@" || rc=$?
  times+=("$name: $((SECONDS - start)) s, exit $rc")
  [ "$rc" -eq 0 ] || status=1
}

status=0
times=()
lane install deploy/install-deps.sh
lane build deploy/build.sh -DMUOND_BUILD_TESTS=ON -DMUOND_BUILD_BENCHMARKS=ON -DMUOND_TEST_HOOKS=ON
lane ctest ctest --test-dir build --output-on-failure --timeout 600 -j "${MUOND_TEST_JOBS:-2}"
if [ "${MUOND_EXTRA_LANES:-1}" != 0 ]; then
  if [ "${MUOND_SANITIZE_LANE:-1}" != 0 ]; then
    lane "asan+ubsan" tests/sanitize/run.sh address
  fi
  lane fuzz tests/fuzz/run.sh "${MUOND_FUZZ_SECONDS:-30}"
fi
echo "=== tests/run.sh: lanes"
printf '  %s\n' "${times[@]}"
exit "$status"
