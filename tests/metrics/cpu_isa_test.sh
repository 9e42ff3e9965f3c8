#!/usr/bin/env bash
# `muond --cpu-isa` (server/optim/cpu_isa.h) against a real daemon:
#   (a) an unknown ISA name, and an ISA wider than this CPU has (amx, where the CPU lacks AMX):
#       muond exits 2 before serving, its one-line error naming --cpu-isa and the value;
#   (b) --cpu-isa avx2 (on any AVX2 machine: the emulated bf16 path): the start-up log says
#       "cpu math avx2 (bf16 emulated" and AdamW's avx2 path; two bf16 steps of a 96 x 160 matrix
#       succeed; muonctl job show says "cpu_isa: avx2 (bf16 emulated"; muond_build_info carries
#       cpu_isa="avx2" and cpu_bf16="emulated" in a scrape promtool accepts; the status JSON's
#       daemon.cpu_math starts with "avx2 (bf16 emulated";
#   (c) the default (auto): the same three places agree on the probed path, one of
#       amx/avx512/avx2/baseline with native or emulated bf16.
# Usage: cpu_isa_test.sh PATH/TO/muond PATH/TO/muonctl
set -euo pipefail
MUOND=${1:?usage: cpu_isa_test.sh MUOND MUONCTL}
MUONCTL=${2:?usage: cpu_isa_test.sh MUOND MUONCTL}
# shellcheck source=tests/metrics/live_daemon.sh
. "$(dirname "$0")/live_daemon.sh"

grep -qw avx2 /proc/cpuinfo || { echo "SKIP: this CPU has no AVX2"; exit 77; }

# --- (a) refused before serving ----------------------------------------------------------------
refused() {  # refused VALUE WORDS...: muond --cpu-isa VALUE exits 2 naming the flag and the words
  local value=$1 rc=0
  shift
  "$MUOND" --listen "unix://$tmp/refused.sock" --state-dir "$tmp/refused" --cpu-isa "$value" \
    --metrics-address off >"$tmp/refused.out" 2>&1 || rc=$?
  [ "$rc" -eq 2 ] || fail "--cpu-isa $value: exit $rc, wanted 2: $(cat "$tmp/refused.out")"
  grep -q -- "--cpu-isa" "$tmp/refused.out" || fail "--cpu-isa $value: $(cat "$tmp/refused.out")"
  for w in "$@"; do
    grep -qF -- "$w" "$tmp/refused.out" || fail "--cpu-isa $value: no '$w' in: $(cat "$tmp/refused.out")"
  done
  [ ! -e "$tmp/refused.sock" ] || fail "--cpu-isa $value: the socket was created"
  echo "refused --cpu-isa $value: $(tail -n 1 "$tmp/refused.out")"
}
refused avx1024 avx1024 "auto, avx2, avx512 or amx"
refused "" "auto, avx2, avx512 or amx"
if ! grep -qw amx_bf16 /proc/cpuinfo; then refused amx "this CPU has at most"; fi

# --- (b) and (c) --------------------------------------------------------------------------------
bf16_job() {  # bf16_job ID: a job of one bf16-compute matrix, 2 steps over gRPC
  printf '{"job_id": "%s", "muon": {"compute_dtype": "bfloat16"}, "matrices": [{"name": "w", "shape": [96, 160]}]}\n' \
    "$1" >"$tmp/$1.json"
  "$MUONCTL" job create --spec "$tmp/$1.json" --token-file "$tmp/$1.token" >/dev/null ||
    fail "muonctl job create $1"
  run_steps "$1" 96 160 2 --transport grpc
}

check_path() {  # check_path ID ISA BF16: the log, job show, metrics and status JSON agree
  local id=$1 isa=$2 bf16=$3
  grep -q "cpu math $isa (bf16 $bf16" "$tmp/muond.log" || fail "log: $(grep 'cpu math' "$tmp/muond.log")"
  "$MUONCTL" job show --job "$id" --token-file "$tmp/$id.token" >"$tmp/show.txt" || fail "job show"
  grep -q "^cpu_isa: $isa (bf16 $bf16" "$tmp/show.txt" || fail "job show: $(cat "$tmp/show.txt")"
  scrape "$tmp/metrics.txt"
  promtool check metrics <"$tmp/metrics.txt" >"$tmp/promtool.out" 2>&1 ||
    { cat "$tmp/promtool.out"; fail "promtool check metrics"; }
  grep '^muond_build_info{' "$tmp/metrics.txt" | grep -q "cpu_isa=\"$isa\"" ||
    fail "build_info: $(grep '^muond_build_info' "$tmp/metrics.txt")"
  grep '^muond_build_info{' "$tmp/metrics.txt" | grep -q "cpu_bf16=\"$bf16\"" ||
    fail "build_info: $(grep '^muond_build_info' "$tmp/metrics.txt")"
  "$PY" - "$metrics" "$isa (bf16 $bf16" <<'PYEOF' || fail "status JSON"
import json, sys, urllib.request
with urllib.request.urlopen(f"http://{sys.argv[1]}/api/v1/status", timeout=5) as r:
    d = json.load(r)["daemon"]
if not d.get("cpu_math", "").startswith(sys.argv[2]):
    sys.exit(f"daemon.cpu_math = {d.get('cpu_math')!r}, wanted {sys.argv[2]!r}...")
PYEOF
  echo "$id: $(grep '^cpu_isa:' "$tmp/show.txt")"
  echo "$id: $(grep '^muond_build_info{' "$tmp/metrics.txt")"
}

start_daemon --cpu-isa avx2
grep -q "AdamW avx2" "$tmp/muond.log" || fail "log: no AdamW avx2: $(grep 'cpu math' "$tmp/muond.log")"
bf16_job forced
check_path forced avx2 emulated
stop_daemon

rm -rf "$tmp/state"
start_daemon
bf16_job auto
line=$(grep -o 'cpu math [a-z0-9]* (bf16 [a-z]*' "$tmp/muond.log" | head -n 1)
isa=$(echo "$line" | awk '{print $3}')
bf16=$(echo "$line" | awk '{print $5}')
case "$isa/$bf16" in
  amx/native | avx512/native | avx512/emulated | avx2/emulated | baseline/emulated) ;;
  *) fail "auto path '$isa/$bf16' ($line)" ;;
esac
check_path auto "$isa" "$bf16"
stop_daemon
echo "PASS: cpu_isa_test"
