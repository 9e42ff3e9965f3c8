#!/usr/bin/env bash
# Builds muond and its test suites with a sanitizer into a build directory of its own and runs
# them; any sanitizer report, from a test or from a daemon a test started, fails the run.
#   tests/sanitize/run.sh address   ASan + UBSan (build-asan/): the unit and integration suites.
#                                   In CI's run (tests/run.sh) by default (MUOND_SANITIZE_LANE=0: not).
#   tests/sanitize/run.sh thread    TSan (build-tsan/): the job engine, shared-memory and
#                                   checkpoint suites. Not in the default run.
# Compiled with gcc at -O1 -g1 (LibTorch, gRPC and OpenBLAS are Debian's, uninstrumented): -g1
# keeps the line tables stack traces need and halves the compile time of LibTorch-heavy files
# against -g (muon_float64_test.cc under ASan: 31 s of CPU against 66 s). The GPU backends are
# off, benchmarks and the Python tests are not built or run. Suppressions, each with its reason:
# tests/sanitize/{lsan,tsan,ubsan}.supp. Reports land in <build dir>/sanitizer-logs/ (UBSan's as
# report.ubsan.<pid>, see ubsan_log_path.cc).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
kind="${1:-}"
case "$kind" in
  address) dir=build-asan ;;
  thread) dir=build-tsan ;;
  *) echo "usage: tests/sanitize/run.sh address|thread" >&2; exit 2 ;;
esac
jobs="${MUOND_BUILD_JOBS:-$(nproc)}"
supp="$root/tests/sanitize"

# ASan: every target of the build (no benchmarks; the GPU backends off), so that a new suite is in
# the lane as soon as it is in ctest; ctest then runs a selection. TSan: the targets its suites need.
targets=(all)
if [ "$kind" = address ]; then
  # The unit and integration suites (and the fuzz corpora replayed); not the tests in Python
  # (python_, multinode_, soak., chaos.: an uninstrumented interpreter cannot load the sanitized
  # client library), the deployment, metrics and ops scripts, or the GPU tests.
  select=(-E '^(python_|multinode_|soak\.|chaos\.|ops\.|cuda_|device_direct_copy|device_level_zero|level_zero|metrics\.|deploy\.|DaemonNotifyTest|SdNotifyTest)')
else
  # The job engine (momentum commit, multi-rank steps, faults, pipeline, apply mode), the
  # shared-memory data plane and the checkpoint store.
  select=(-R '^((Devices/)?(MomentumCommitTest|ApplyCommitTest)|MomentumStoreSnapshotTest|checkpoint_unit_tests|integration\.(MultiRank|Fault|Pipeline|Checkpoint|Trajectory)|apply\.|shm\.Shm(Transport|Hostile|Fault))')
  # Only the executables these suites run (the daemons and rank processes come with them).
  targets=(muond_tsan_absl_sync server_unit_tests checkpoint_unit_tests integration_tests apply_tests
           shm_tests)
fi

cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DMUOND_SANITIZE="$kind" -DMUOND_BUILD_TESTS=ON -DMUOND_BUILD_BENCHMARKS=OFF \
  -DMUOND_TEST_HOOKS=ON -DMUOND_WITH_CUDA=OFF -DMUOND_WITH_LEVEL_ZERO=OFF >/dev/null
cmake --build "$dir" -j "$jobs" --target "${targets[@]}"

logs="$root/$dir/sanitizer-logs"
rm -rf "$logs"
mkdir -p "$logs"
# log_path: every process (tests and the daemons they start) writes its reports to a file of its
# own, so a daemon's report is not lost in its captured stderr.
common="log_path=$logs/report:print_stacktrace=1:strip_path_prefix=$root/"
export UBSAN_OPTIONS="$common:halt_on_error=1:suppressions=$supp/ubsan.supp"
# quarantine_size_mb=0: freed memory goes back at once, as the memory tests expect (a deleted
# job's momentum must leave the daemon's RSS). The price: a use after free is caught only until
# the memory is reused.
export ASAN_OPTIONS="$common:detect_leaks=1:check_initialization_order=1:detect_stack_use_after_return=0:quarantine_size_mb=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export TSAN_OPTIONS="$common:halt_on_error=0:second_deadlock_stack=1:suppressions=$supp/tsan.supp:report_signal_unsafe=0"
if [ "$kind" = thread ]; then
  # Debian's Abseil is not built with TSan: this library tells TSan what its mutexes, condition
  # variables and notifications order (tests/sanitize/tsan_absl_sync.cc).
  export LD_PRELOAD="$root/$dir/lib/libmuond_tsan_absl_sync.so"
  # Debian's libgomp is not built with TSan: the fork and join of a parallel region (its barriers)
  # are invisible, so every access a worker makes looks unordered against the master's before and
  # after the region. OpenMP regions (muond's elementwise passes, Newton-Schulz task pools,
  # LibTorch's kernels) therefore run on one thread in this lane; what TSan checks is muond's own
  # threads and their synchronization. The passes' results do not depend on the thread count
  # (muon_math_tests checks that bit for bit with several threads).
  export OMP_THREAD_LIMIT=1
fi

status=0
ctest --test-dir "$dir" --output-on-failure --timeout 900 -j "${MUOND_TEST_JOBS:-2}" "${select[@]}" || status=$?
reports=$(find "$logs" -type f | sort)
if [ -n "$reports" ]; then
  echo "sanitize: $(echo "$reports" | wc -l) sanitizer report file(s) in $logs:" >&2
  for f in $reports; do echo "--- $f" >&2; head -60 "$f" >&2; done
  status=1
fi
if [ "$status" -eq 0 ]; then echo "sanitize: $kind lane passed, no reports"; fi
exit "$status"
