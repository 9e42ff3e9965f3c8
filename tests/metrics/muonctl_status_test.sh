#!/usr/bin/env bash
# `muonctl status [--json]` and `muonctl top` against a real muond that has run 2 steps of a job
# "st" (one 64x128 float32 matrix):
#   (a) status --json is valid JSON with the daemon's backend cpu, version and device from the
#       metrics endpoint, queue depth 0, no metrics error, and the job: world size 1, 0 ranks
#       attached (rank 0 listed, detached), next step 2, 2 steps completed, 0 refused/aborted, not
#       fenced, no step in flight, 32768 bytes of momentum, the default gather budget, the
#       checkpoint age key present (null: no checkpoint metric yet);
#   (b) the text form names the backend and lists the job;
#   (c) with --metrics-address off the jobs are still listed (backend "cpu" from the job's), the
#       daemon-wide fields are null and metrics_error says why;
#   (d) top --iterations 2 --interval 0.2 prints exactly 2 frames (1/2, 2/2), each with the job's
#       row; the step rate is "-" in the first frame and 0.00 in the second (no step between);
#       top --iterations -1 fails with exit 3 (INVALID_ARGUMENT).
# Usage: muonctl_status_test.sh PATH/TO/muond PATH/TO/muonctl
set -euo pipefail
MUOND=${1:?usage: muonctl_status_test.sh MUOND MUONCTL}
MUONCTL=${2:?usage: muonctl_status_test.sh MUOND MUONCTL}
# shellcheck source=tests/metrics/live_daemon.sh
. "$(dirname "$0")/live_daemon.sh"

start_daemon
create_job st 64 128
run_steps st 64 128 2 --transport grpc

# --- (a) status --json -------------------------------------------------------------------------
"$MUONCTL" status --json >"$tmp/status.json" || fail "muonctl status --json"
"$PY" - "$tmp/status.json" "$addr" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
d = s["daemon"]
bad = []
def want(what, got, expected):
    if got != expected:
        bad.append(f"{what} = {got!r}, wanted {expected!r}")
want("address", s["address"], sys.argv[2])
want("metrics_error", s["metrics_error"], None)
want("daemon.backend", d["backend"], "cpu")
for key in ("version", "device"):
    if not isinstance(d[key], str) or not d[key]:
        bad.append(f"daemon.{key} = {d[key]!r}")
want("daemon.compute_queue_depth", d["compute_queue_depth"], 0)
want("daemon.momentum_bytes", d["momentum_bytes"], 32768)
want("jobs", len(s["jobs"]), 1)
j = s["jobs"][0]
if not j.get("backend", "").startswith("cpu"):  # "cpu" or "cpu (auto: why)"
    bad.append(f"jobs[0].backend = {j.get('backend')!r}")
for k, v in {"job_id": "st", "world_size": 1, "ranks_attached": 0,
             "next_step": 2, "steps_completed": 2, "steps_refused": 0, "steps_aborted": 0,
             "fenced": False, "step_in_flight": None, "momentum_bytes": 32768,
             "gather_budget_bytes": 1 << 30, "matrices": 1,
             "ranks": [{"rank": 0, "attached": False, "in_step": False,
                        "finished_pushing": False}]}.items():
    want(f"jobs[0].{k}", j.get(k), v)
if "last_checkpoint_age_seconds" not in j:
    bad.append("jobs[0].last_checkpoint_age_seconds missing")
if bad:
    sys.exit("FAIL: status --json: " + "; ".join(bad))
print(f"status --json: {len(json.dumps(s))} bytes, daemon {d['version']} {d['backend']} "
      f"({d['device']}), job st: 2 steps")
PYEOF

# --- (b) text --------------------------------------------------------------------------------------
"$MUONCTL" status >"$tmp/status.txt" || fail "muonctl status"
grep -q '^backend: cpu ' "$tmp/status.txt" || fail "status text: no backend line: $(cat "$tmp/status.txt")"
grep -Eq '^st +1 +0 +2 +2 +0 +0 +no ' "$tmp/status.txt" ||
  fail "status text: no row for job st: $(cat "$tmp/status.txt")"
echo "status (text): backend and job row present"

# --- (c) without the metrics endpoint -----------------------------------------------------------
"$MUONCTL" status --json --metrics-address off >"$tmp/status_off.json" ||
  fail "muonctl status --json --metrics-address off"
"$PY" - "$tmp/status_off.json" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
d = s["daemon"]
assert d["backend"] == "cpu", d
assert d["version"] is None and d["compute_queue_depth"] is None, d
assert isinstance(s["metrics_error"], str) and "off" in s["metrics_error"], s["metrics_error"]
assert [j["job_id"] for j in s["jobs"]] == ["st"], s["jobs"]
print("status --json --metrics-address off: jobs listed, daemon-wide fields null")
PYEOF

# --- (d) top ----------------------------------------------------------------------------------------
"$MUONCTL" top --iterations 2 --interval 0.2 >"$tmp/top.txt" || fail "muonctl top"
"$PY" - "$tmp/top.txt" <<'PYEOF'
import sys
text = open(sys.argv[1]).read()
frames = [f for f in text.split("muond top - ")[1:]]
assert len(frames) == 2, f"{len(frames)} frames:\n{text}"
rates = []
for n, frame in enumerate(frames, 1):
    assert f"{n}/2)" in frame.splitlines()[0], frame
    rows = [l.split() for l in frame.splitlines() if l.startswith("st ")]
    assert len(rows) == 1, frame
    row = rows[0]
    assert row[1] == "0/1" and row[2] == "2", row   # ranks attached/world, next step
    rates.append(row[3])
assert rates == ["-", "0.00"], rates
print(f"top: 2 frames, step rates {rates}")
PYEOF
set +e
"$MUONCTL" top --iterations -1 >/dev/null 2>"$tmp/top_bad.err"
rc=$?
set -e
[ "$rc" -eq 3 ] || fail "top --iterations -1: exit $rc, wanted 3: $(cat "$tmp/top_bad.err")"

stop_daemon
echo "PASS"
