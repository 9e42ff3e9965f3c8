#!/usr/bin/env bash
# The metrics endpoint as Prometheus sees it.
#   (a) a live scrape of metrics_demo passes `promtool check metrics` with no output at all
#       (promtool exits 0 even with some lint warnings printed; any output fails this test);
#   (b) a real prometheus server scrapes it every second; its HTTP API reports the target up and
#       returns the demo's counter value.
# Usage: promtool_test.sh PATH/TO/metrics_demo
# Exits 77 (ctest: skipped) when promtool or prometheus is not installed (deploy/install-deps.sh).
set -euo pipefail

demo=${1:?usage: promtool_test.sh PATH/TO/metrics_demo}
PY=/usr/bin/python3
for tool in promtool prometheus "$PY"; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP: $tool not installed (deploy/install-deps.sh installs it)"
    exit 77
  fi
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/muond-promtool.XXXXXX")
demo_pid=""
prom_pid=""
cleanup() {
  local rc=$?
  for pid in $prom_pid $demo_pid; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in $prom_pid $demo_pid; do
    wait "$pid" 2>/dev/null || true
  done
  if [ "$rc" -ne 0 ] && [ -f "$tmp/prometheus.log" ]; then
    echo "--- prometheus log (tail) ---"
    tail -n 20 "$tmp/prometheus.log"
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# --- start the demo endpoint -------------------------------------------------------------------
# The files exist before the demo starts, so the loop below never reads a missing one.
: >"$tmp/demo.out"
: >"$tmp/demo.err"
"$demo" 127.0.0.1:0 >>"$tmp/demo.out" 2>>"$tmp/demo.err" &
demo_pid=$!
port=""
for _ in $(seq 100); do
  port=$(sed -n 's/^port=\([0-9]*\)$/\1/p' "$tmp/demo.out" || true)
  [ -n "$port" ] && break
  kill -0 "$demo_pid" 2>/dev/null || fail "metrics_demo exited: $(cat "$tmp/demo.err")"
  sleep 0.05
done
[ -n "$port" ] || fail "metrics_demo printed no port"
target="127.0.0.1:$port"
echo "metrics_demo serving on $target"

# --- (a) promtool on a live scrape -------------------------------------------------------------
"$PY" - "$target" "$tmp/scrape.txt" <<'EOF'
import sys, urllib.request
target, out = sys.argv[1], sys.argv[2]
with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as r:
    ctype = r.headers.get("Content-Type")
    if r.status != 200 or ctype != "text/plain; version=0.0.4; charset=utf-8":
        sys.exit(f"unexpected response: {r.status} {ctype!r}")
    open(out, "wb").write(r.read())
EOF
lines=$(wc -l <"$tmp/scrape.txt")
[ "$lines" -gt 50 ] || fail "scrape has only $lines lines"
set +e
promtool check metrics <"$tmp/scrape.txt" >"$tmp/promtool.out" 2>&1
promtool_rc=$?
set -e
if [ "$promtool_rc" -ne 0 ] || [ -s "$tmp/promtool.out" ]; then
  cat "$tmp/promtool.out"
  fail "promtool check metrics: exit $promtool_rc, $(wc -l <"$tmp/promtool.out") lines of output"
fi
echo "promtool check metrics: exit 0, no output ($lines lines scraped)"

# --- (b) a real prometheus server --------------------------------------------------------------
prom_port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"$tmp/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: muond
    static_configs:
      - targets: ["$target"]
EOF
promtool check config "$tmp/prometheus.yml" >"$tmp/check_config.out" 2>&1 ||
  { cat "$tmp/check_config.out"; fail "promtool check config"; }
prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
  --web.listen-address="127.0.0.1:$prom_port" --log.level=warn >"$tmp/prometheus.log" 2>&1 &
prom_pid=$!

# Waits (15 s at most) until the target is up and the counter has the demo's value. The demo's
# `job` label is stored as `exported_job`: Prometheus keeps its own `job` (the scrape job) and
# renames a scraped label that collides with it.
"$PY" - "$prom_port" "$target" <<'EOF'
import json, sys, time, urllib.parse, urllib.request
prom, target = sys.argv[1], sys.argv[2]
def api(path):
    with urllib.request.urlopen(f"http://127.0.0.1:{prom}{path}", timeout=2) as r:
        return json.load(r)
query = 'muond_steps_completed_total{exported_job="demo"}'
deadline = time.time() + 15
health = value = None
while time.time() < deadline:
    try:
        targets = api("/api/v1/targets")["data"]["activeTargets"]
        health = [t["health"] for t in targets if t["labels"].get("instance") == target]
        if health == ["up"]:
            result = api("/api/v1/query?query=" + urllib.parse.quote(query))["data"]["result"]
            if result:
                value = result[0]["value"][1]
                labels = result[0]["metric"]
                break
    except OSError:
        pass  # Not listening yet.
    time.sleep(0.2)
if health != ["up"]:
    sys.exit(f"FAIL: target {target} health {health} after 15 s")
if value != "42":
    sys.exit(f"FAIL: {query} = {value!r}, expected \"42\"")
print(f"prometheus: target {target} health up; {query} = {value} (labels {labels})")
EOF
echo "PASS"
