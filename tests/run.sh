#!/usr/bin/env bash
# Runs every test: installs what is missing, builds (with tests and benchmarks), runs ctest
# (unit, integration and Python tests), then the sanitizer lane and the fuzzers. Run as root on a
# fresh Debian 12 machine. This is what CI runs (.ci/run).
#   tests/run.sh                      the normal build and suite (build/); then every fuzz
#                                     target for MUOND_FUZZ_SECONDS (default 60) s (build-fuzz/,
#                                     tests/fuzz/run.sh). MUOND_SANITIZE_LANE=1 adds the unit and
#                                     integration suites under ASan + UBSan (build-asan/,
#                                     tests/sanitize/run.sh address) after the suite; it is not
#                                     on by default yet: a from-scratch sanitizer build of every
#                                     suite does not fit CI's time on a 2-core machine beside the
#                                     rest. MUOND_EXTRA_LANES=0 stops after the normal suite.
#   tests/run.sh --sanitize address   only the ASan + UBSan lane (build-asan/)
#   tests/run.sh --sanitize thread    only the TSan lane (build-tsan/): job engine, shared memory,
#                                     checkpoints
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
  if [ "${MUOND_SANITIZE_LANE:-0}" = 1 ]; then
    lane "asan+ubsan" tests/sanitize/run.sh address
  fi
  lane fuzz tests/fuzz/run.sh "${MUOND_FUZZ_SECONDS:-60}"
fi
echo "=== tests/run.sh: lanes"
printf '  %s\n' "${times[@]}"
exit "$status"
