#!/usr/bin/env bash
# The real daemon's metrics as Prometheus sees them:
#   a muond on a temporary socket, --metrics-address 127.0.0.1:0, runs a job of one 64x128 float32
#   matrix for 3 steps (steps 0-1 over gRPC, step 2 over shared memory) plus one out-of-order step
#   (FAILED_PRECONDITION over gRPC); then
#   (a) the scrape holds the expected values: muond_steps_completed_total{muond_job="live"} 3,
#       muond_jobs 1, the job's momentum 32768 bytes, world size 1, no rank attached, transfer
#       bytes grpc in/out 65536 each and shm in/out 32768 each, one Step error FAILED_PRECONDITION,
#       build and device info;
#   (b) `promtool check metrics` on it exits 0 with no output at all;
#   (c) a real prometheus server scrapes it; its HTTP API reports the target up and
#       muond_steps_completed_total{muond_job="live"} = 3;
#       and the series of server/record/optimizer_metrics.h: Newton-Schulz time of shape class 64x128
#       (3 matrices), the orthogonality of step 0's update, the trainer-visible and wait times of
#       the 3 steps, nothing waiting, the pinned momentum;
#       and a QK-Clip job (muonctl step --max-logits): its heads clipped and largest logit;
#   (d) after `muonctl job delete`, the jobs' series are gone and muond_jobs is 0;
#   (e) SIGTERM: muond exits 0.
# Usage: muond_live_test.sh PATH/TO/muond PATH/TO/muonctl
# Exits 77 (ctest: skipped) when promtool or prometheus is not installed (deploy/install-deps.sh).
set -euo pipefail
MUOND=${1:?usage: muond_live_test.sh MUOND MUONCTL}
MUONCTL=${2:?usage: muond_live_test.sh MUOND MUONCTL}
for tool in promtool prometheus /usr/bin/python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP: $tool not installed (deploy/install-deps.sh installs it)"
    exit 77
  fi
done
# shellcheck source=tests/metrics/live_daemon.sh
. "$(dirname "$0")/live_daemon.sh"

start_daemon
echo "muond serving on $addr, metrics on $metrics"
create_job live 64 128
run_steps live 64 128 2 --transport grpc
write_grads "$tmp/live.g2.safetensors" 64 128 2
"$MUONCTL" step --job live --rank 0 --step 2 --grads "$tmp/live.g2.safetensors" \
  --out "$tmp/live.u2.safetensors" --token-file "$tmp/live.token" --transport shm >/dev/null ||
  fail "muonctl step live 2 --transport shm"
set +e
"$MUONCTL" step --job live --rank 0 --step 7 --grads "$tmp/live.g2.safetensors" \
  --out "$tmp/live.u7.safetensors" --token-file "$tmp/live.token" --transport grpc \
  >/dev/null 2>"$tmp/step7.err"
rc=$?
set -e
[ "$rc" -eq 9 ] || fail "out-of-order step: exit $rc (wanted 9, FAILED_PRECONDITION): $(cat "$tmp/step7.err")"

# QK-Clip (DESIGN.md 4e): 2 steps of a job whose head 0 is over the threshold each step, over
# gRPC (its 288 bytes of gradients in and of parameters out per step).
qk_job liveqk 2 --transport grpc

# muonctl step --max-logits refusals (exit 3, INVALID_ARGUMENT, nothing sent): no tensor for the
# pair's q, a tensor that is no pair's q, the wrong count, and any file on a job without qk_clip.
expect_refused() {
  local what=$1 phrase=$2
  shift 2
  set +e
  "$MUONCTL" step --rank 0 --token-file "$tmp/liveqk.token" --job liveqk --step 2 \
    --grads "$tmp/liveqk.g1.safetensors" --out "$tmp/refused.safetensors" --lr muon=0.01 "$@" \
    >/dev/null 2>"$tmp/refused.err"
  local rc=$?
  set -e
  [ "$rc" -eq 3 ] || fail "$what: exit $rc, wanted 3: $(cat "$tmp/refused.err")"
  grep -q "$phrase" "$tmp/refused.err" || fail "$what: no '$phrase' in: $(cat "$tmp/refused.err")"
}
write_tensors "$tmp/nologits.safetensors" "k:2:=1,2"
expect_refused "logits of another tensor" "tensor 'k' is not the q tensor" \
  --max-logits "$tmp/nologits.safetensors"
write_tensors "$tmp/short.safetensors" "q:3:=1,2,3"
expect_refused "three values for two heads" "expected \[2\]" --max-logits "$tmp/short.safetensors"
write_tensors "$tmp/empty.safetensors" "other:1:=1"
expect_refused "no tensor for the pair" "'other' is not the q tensor" \
  --max-logits "$tmp/empty.safetensors"
expect_refused "no --max-logits" "set the step's max attention logits first"
set +e
"$MUONCTL" step --job live --rank 0 --step 3 --grads "$tmp/live.g2.safetensors" \
  --out "$tmp/refused.safetensors" --token-file "$tmp/live.token" \
  --max-logits "$tmp/liveqk.logits.safetensors" >/dev/null 2>"$tmp/refused.err"
rc=$?
set -e
[ "$rc" -eq 3 ] && grep -q "has no qk_clip pairs" "$tmp/refused.err" ||
  fail "--max-logits on a job without qk_clip: exit $rc: $(cat "$tmp/refused.err")"
echo "muonctl step --max-logits: 5 bad uses refused with exit 3, naming what is wrong"

# --- (a) values ----------------------------------------------------------------------------------
scrape "$tmp/scrape.txt"
"$PY" - "$tmp/scrape.txt" <<'PYEOF'
import re, sys
samples = {}
for line in open(sys.argv[1]):
    if line.startswith("#") or not line.strip():
        continue
    m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$', line.rstrip("\n"))
    assert m, f"unparsable line: {line!r}"
    samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
want = {
    'muond_steps_completed_total{muond_job="live"}': 3,
    'muond_jobs': 2,
    'muond_job_world_size{muond_job="live"}': 1,
    'muond_job_ranks_attached{muond_job="live"}': 0,
    'muond_job_next_step{muond_job="live"}': 3,
    'muond_job_fenced{muond_job="live"}': 0,
    'muond_job_momentum_bytes{muond_job="live"}': 64 * 128 * 4,
    # One copy of each job's state: the live job's momentum, and the QK-Clip job's two 8 x 6 and
    # two 4 x 6 tensors' masters and momentum.
    'muond_momentum_bytes': 64 * 128 * 4 + 2 * (8 + 4) * 6 * 4,
    'muond_ranks_attached': 0,
    'muond_shm_sessions': 0,
    'muond_compute_queue_depth': 0,
    'muond_transfer_bytes_total{direction="in",transport="grpc"}': 2 * 64 * 128 * 4 + 2 * 288,
    'muond_transfer_bytes_total{direction="out",transport="grpc"}': 2 * 64 * 128 * 4 + 2 * 288,
    'muond_transfer_bytes_total{direction="in",transport="shm"}': 64 * 128 * 4,
    'muond_transfer_bytes_total{direction="out",transport="shm"}': 64 * 128 * 4,
    'muond_rpc_errors_total{code="FAILED_PRECONDITION",rpc="Step"}': 1,
}
# The series no other optimizer has (server/record/optimizer_metrics.h). Every step's one matrix is
# one Newton-Schulz observation of its shape class; step 0 is a multiple of the default
# --orthogonality-every (100), so its one Muon matrix was measured; every step was timed as its
# trainer saw it (2 over gRPC, 1 over shared memory); nothing waits or is in use after the steps;
# the momentum is pinned (mlock), one copy: every step was sealed (all its data in) before its one
# matrix was computed, so it was updated in place and no step window buffer was needed; nothing
# else of the job is pinned.
ns = 'muond_newton_schulz_seconds_count{backend="cpu",dtype="float32",muond_job="live",shape="64x128"}'
want.update({
    ns: 3,
    'muond_orthogonality_checks_total{muond_job="live"}': 1,
    'muond_step_trainer_visible_seconds_count{muond_job="live"}': 3,
    'muond_step_trainer_wait_seconds_count{muond_job="live"}': 3,
    'muond_job_matrices_waiting{muond_job="live"}': 0,
    'muond_job_gather_in_use_bytes{muond_job="live"}': 0,
    'muond_job_pinned_bytes{kind="momentum",muond_job="live"}': 64 * 128 * 4,
    'muond_job_pinned_bytes{kind="masters",muond_job="live"}': 0,
    'muond_job_pinned_bytes{kind="moments",muond_job="live"}': 0,
    'muond_job_pinned_bytes{kind="session_regions",muond_job="live"}': 0,
    'muond_job_pinned_bytes{kind="staging",muond_job="live"}': 0,
    'muond_qk_clip_heads_clipped_total{muond_job="liveqk"}': 2,
    'muond_qk_max_logit{muond_job="liveqk"}': 50,
    'muond_steps_completed_total{muond_job="liveqk"}': 2,
})
bad = [f"{k} = {samples.get(k)!r}, wanted {v}" for k, v in want.items() if samples.get(k) != v]
orth = samples.get('muond_update_orthogonality{muond_job="live"}')
if orth is None or not 0 < orth < 0.5:
    bad.append(f"muond_update_orthogonality = {orth!r}, wanted in (0, 0.5)")
ns_sum = samples.get(ns.replace("_count", "_sum"))
visible = samples.get('muond_step_trainer_visible_seconds_sum{muond_job="live"}')
wait = samples.get('muond_step_trainer_wait_seconds_sum{muond_job="live"}')
if not (ns_sum and ns_sum > 0):
    bad.append(f"Newton-Schulz seconds sum {ns_sum!r}, wanted > 0")
if not (visible and wait is not None and 0 <= wait <= visible):
    bad.append(f"trainer visible {visible!r} s, wait {wait!r} s: wanted 0 <= wait <= visible")
for prefix in ('muond_build_info{backend="', 'muond_device_info{backend="',
               'muond_steps_refused_total{muond_job="live"}',
               'muond_steps_aborted_total{muond_job="live"}',
               'muond_job_gather_budget_bytes{muond_job="live"}', 'muond_memlock_limit_bytes'):
    if not any(k.startswith(prefix) for k in samples):
        bad.append(f"no sample {prefix}...")
if bad:
    sys.exit("FAIL: " + "; ".join(bad))
print(f"scrape: {len(samples)} samples, all {len(want)} expected values present")
PYEOF

# --- (b) promtool ----------------------------------------------------------------------------------
set +e
promtool check metrics <"$tmp/scrape.txt" >"$tmp/promtool.out" 2>&1
promtool_rc=$?
set -e
if [ "$promtool_rc" -ne 0 ] || [ -s "$tmp/promtool.out" ]; then
  cat "$tmp/promtool.out"
  fail "promtool check metrics: exit $promtool_rc, $(wc -l <"$tmp/promtool.out") lines of output"
fi
echo "promtool check metrics: exit 0, no output ($(wc -l <"$tmp/scrape.txt") lines scraped)"

# --- (c) a real prometheus server -------------------------------------------------------------
start_prometheus "$metrics"
"$PY" - "$prom_port" "$metrics" <<'PYEOF'
import json, sys, time, urllib.parse, urllib.request
prom, target = sys.argv[1], sys.argv[2]
def api(path):
    with urllib.request.urlopen(f"http://127.0.0.1:{prom}{path}", timeout=2) as r:
        return json.load(r)
query = 'muond_steps_completed_total{muond_job="live"}'
deadline = time.time() + 30
health = value = labels = None
while time.time() < deadline:
    try:
        targets = api("/api/v1/targets")["data"]["activeTargets"]
        health = [t["health"] for t in targets if t["labels"].get("instance") == target]
        if health == ["up"]:
            result = api("/api/v1/query?query=" + urllib.parse.quote(query))["data"]["result"]
            if result:
                value, labels = result[0]["value"][1], result[0]["metric"]
                break
    except OSError:
        pass  # not listening yet
    time.sleep(0.2)
if health != ["up"]:
    sys.exit(f"FAIL: target {target} health {health} after 30 s")
if value != "3":
    sys.exit(f"FAIL: {query} = {value!r}, expected \"3\"")
print(f"prometheus: target {target} health up; {query} = {value} (labels {labels})")
PYEOF
kill "$prom_pid"
wait "$prom_pid" 2>/dev/null || true
prom_pid=""

# --- (d) a deleted job's series go -----------------------------------------------------------
"$MUONCTL" job delete --job live --token-file "$tmp/live.token" >/dev/null || fail "job delete"
"$MUONCTL" job delete --job liveqk --token-file "$tmp/liveqk.token" >/dev/null ||
  fail "job delete liveqk"
scrape "$tmp/after.txt"
if grep -Eq 'muond_job="live(qk)?"' "$tmp/after.txt"; then
  grep 'muond_job="live"' "$tmp/after.txt" | head -5
  fail "series of the deleted job are still exported"
fi
grep -qx 'muond_jobs 0' "$tmp/after.txt" || fail "muond_jobs is not 0 after the delete"
grep -qx 'muond_steps_completed_total{muond_job="live"} 3' "$tmp/scrape.txt" || fail "first scrape changed?"
echo "after job delete: no muond_job=\"live\" series, muond_jobs 0"

# --- (e) clean stop -------------------------------------------------------------------------------
stop_daemon
echo "PASS"
