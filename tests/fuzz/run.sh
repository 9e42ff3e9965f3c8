#!/usr/bin/env bash
# Builds every fuzz target (tests/fuzz/*.cc, listed in tests/fuzz/CMakeLists.txt) with clang-14's
# libFuzzer + ASan + UBSan into build-fuzz/ and runs each for SECONDS (default 60), MUOND_FUZZ_JOBS
# at a time (default 2). Each target starts from its seed corpus (tests/fuzz/corpus/<target>/,
# read only) plus what earlier runs here found (build-fuzz/corpus/<target>/), with its dictionary
# when there is one (tests/fuzz/<target>.dict). Prints per target: executions, coverage (cov:
# edges, ft: features) and the crash inputs this run saved (artifacts=; inputs kept there from
# earlier runs are not counted again); logs in build-fuzz/logs/. A crash fails the run; its input is
# saved under build-fuzz/artifacts/<target>/: fix the defect and add the input to
# tests/fuzz/regressions/<target>/, which the normal build replays (ctest fuzz.replay.<target>).
#   tests/fuzz/run.sh [SECONDS] [TARGET...]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
seconds="${1:-60}"
shift || true
out="$root/build-fuzz"
cxx="${MUOND_FUZZ_CXX:-clang++-14}"
cc="${MUOND_FUZZ_CC:-clang-14}"

cmake -S tests/fuzz -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=None -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
cmake --build "$out" -j "${MUOND_BUILD_JOBS:-$(nproc)}"

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < tests/fuzz/targets.txt
fi

run_one() {
  local t="$1"
  mkdir -p "$out/corpus/$t" "$out/artifacts/$t" "$out/logs"
  touch "$out/logs/$t.start"  # artifacts newer than this are this run's
  local dict=()
  [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
  # -timeout: an input that takes 25 s is a hang; -rss_limit_mb: the daemon's parsers must not
  # need more memory than this for any input.
  "$out/fuzz_$t" -max_total_time="$seconds" -print_final_stats=1 -timeout=25 -rss_limit_mb=2048 \
    -artifact_prefix="$out/artifacts/$t/" "${dict[@]}" "$out/corpus/$t" "tests/fuzz/corpus/$t" \
    >"$out/logs/$t.log" 2>&1 && echo 0 >"$out/logs/$t.rc" || echo $? >"$out/logs/$t.rc"
}

summary() {
  local t="$1" rc="$2" log="$out/logs/$1.log"
  local execs cov ft crashes
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  crashes=$(find "$out/artifacts/$t" -type f -newer "$out/logs/$t.start" | wc -l)
  printf '%-18s rc=%-3s executions=%-10s cov=%-6s ft=%-6s artifacts=%s\n' "$t" "$rc" \
    "${execs:-?}" "${cov:-?}" "${ft:-?}" "$crashes"
}

jobs="${MUOND_FUZZ_JOBS:-2}"
failed=0
for t in "${targets[@]}"; do
  [ -x "$out/fuzz_$t" ] || { echo "fuzz: no target $t" >&2; exit 2; }
  rm -f "$out/logs/$t.rc"
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  run_one "$t" &
done
wait
echo "fuzz: ${#targets[@]} targets, ${seconds} s each"
for t in "${targets[@]}"; do
  rc=$(cat "$out/logs/$t.rc" 2>/dev/null || echo '?')
  summary "$t" "$rc"
  if [ "$rc" != 0 ]; then
    failed=1
    echo "fuzz: $t failed (log $out/logs/$t.log):" >&2
    grep -m1 -A25 -E '^==[0-9]+==ERROR|FUZZ_CHECK|runtime error|^SUMMARY' "$out/logs/$t.log" >&2 || tail -30 "$out/logs/$t.log" >&2
  fi
done
exit "$failed"
