# Shared by the live-daemon tests (sourced, not run): starts a real muond in a temporary directory
# with its metrics endpoint on a kernel-chosen port, and helpers to drive it with muonctl.
# Requires: $MUOND, $MUONCTL set; defines $tmp, $addr, $metrics, start_daemon, stop_daemon,
# create_job, write_grads, fail. Cleanup (daemon, prometheus, temp dir) runs on exit.
PY=/usr/bin/python3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/muond-live.XXXXXX")
daemon_pid=""
prom_pid=""
cleanup() {
  local rc=$?
  for pid in $prom_pid $daemon_pid; do kill "$pid" 2>/dev/null || true; done
  for pid in $prom_pid $daemon_pid; do wait "$pid" 2>/dev/null || true; done
  if [ "$rc" -ne 0 ]; then
    [ -f "$tmp/muond.log" ] && { echo "--- muond log (tail) ---"; tail -n 20 "$tmp/muond.log"; }
    [ -f "$tmp/prometheus.log" ] && { echo "--- prometheus log (tail) ---"; tail -n 20 "$tmp/prometheus.log"; }
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

addr="unix://$tmp/muond.sock"
export MUOND_ADDRESS="$addr"
unset MUOND_JOB_TOKEN MUOND_METRICS_ADDRESS

# Starts muond; waits (bounded) until its log names the metrics port and `muonctl health` answers.
start_daemon() {
  : >"$tmp/muond.log"
  "$MUOND" --listen "$addr" --state-dir "$tmp/state" --threads 1 \
    --metrics-address 127.0.0.1:0 "$@" >>"$tmp/muond.log" 2>&1 &
  daemon_pid=$!
  local port=""
  for _ in $(seq 300); do
    port=$(sed -n 's#.*metrics on http://127\.0\.0\.1:\([0-9]*\)/metrics.*#\1#p' "$tmp/muond.log")
    if [ -n "$port" ] && "$MUONCTL" health >/dev/null 2>&1; then break; fi
    kill -0 "$daemon_pid" 2>/dev/null || fail "muond exited: $(cat "$tmp/muond.log")"
    sleep 0.1
  done
  [ -n "$port" ] || fail "muond logged no metrics port"
  "$MUONCTL" health >/dev/null || fail "muond does not serve"
  metrics="127.0.0.1:$port"
  export MUOND_METRICS_ADDRESS="$metrics"
}

# SIGTERM; the daemon must exit 0.
stop_daemon() {
  kill -TERM "$daemon_pid"
  local rc=0
  wait "$daemon_pid" || rc=$?
  daemon_pid=""
  [ "$rc" -eq 0 ] || fail "muond exited with $rc after SIGTERM"
}

# create_job ID ROWS COLS: one float32 matrix "w"; the token goes to $tmp/ID.token.
create_job() {
  printf '{"job_id": "%s", "matrices": [{"name": "w", "shape": [%d, %d]}]}\n' "$1" "$2" "$3" \
    >"$tmp/$1.json"
  "$MUONCTL" job create --spec "$tmp/$1.json" --token-file "$tmp/$1.token" >/dev/null ||
    fail "muonctl job create $1"
}

# write_grads FILE ROWS COLS SEED: a safetensors file with a float32 tensor "w" of random values.
write_grads() {
  "$PY" - "$@" <<'PYEOF'
import json, random, struct, sys
path, rows, cols, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
data = struct.pack(f"<{rows * cols}f", *(rng.uniform(-1, 1) for _ in range(rows * cols)))
header = json.dumps({"w": {"dtype": "F32", "shape": [rows, cols],
                           "data_offsets": [0, len(data)]}}).encode()
header += b" " * (-len(header) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + data)
PYEOF
}

# run_steps ID ROWS COLS N [muonctl step options]: steps 0..N-1 of rank 0.
run_steps() {
  local id=$1 rows=$2 cols=$3 n=$4
  shift 4
  for t in $(seq 0 $((n - 1))); do
    write_grads "$tmp/$id.g$t.safetensors" "$rows" "$cols" "$t"
    "$MUONCTL" step --job "$id" --rank 0 --step "$t" --grads "$tmp/$id.g$t.safetensors" \
      --out "$tmp/$id.u$t.safetensors" --token-file "$tmp/$id.token" "$@" >/dev/null ||
      fail "muonctl step $id $t"
  done
}

# scrape FILE: GET /metrics into FILE (200 and the 0.0.4 content type).
scrape() {
  "$PY" - "$metrics" "$1" <<'PYEOF'
import sys, urllib.request
target, out = sys.argv[1], sys.argv[2]
with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as r:
    ctype = r.headers.get("Content-Type")
    if r.status != 200 or ctype != "text/plain; version=0.0.4; charset=utf-8":
        sys.exit(f"unexpected response: {r.status} {ctype!r}")
    open(out, "wb").write(r.read())
PYEOF
}

# Starts Debian's prometheus on a free loopback port (prom_port) scraping $1 every second, its
# config checked by promtool first; prom_pid is stopped on exit with the daemon.
start_prometheus() {
  prom_port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  cat >"$tmp/prometheus.yml" <<PROMEOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: muond
    static_configs:
      - targets: ["$1"]
PROMEOF
  promtool check config "$tmp/prometheus.yml" >"$tmp/check_config.out" 2>&1 ||
    { cat "$tmp/check_config.out"; fail "promtool check config"; }
  prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
    --web.listen-address="127.0.0.1:$prom_port" --log.level=warn >"$tmp/prometheus.log" 2>&1 &
  prom_pid=$!
}

# write_tensors FILE NAME:D0xD1:SEED ... : a safetensors file of float32 tensors of random values
# (NAME:D0:=V1,V2,...: a 1-D tensor of the given values instead).
write_tensors() {
  "$PY" - "$@" <<'PYEOF'
import json, random, struct, sys
path, header, blobs, at = sys.argv[1], {}, [], 0
for spec in sys.argv[2:]:
    name, shape, how = spec.split(":", 2)
    dims = [int(d) for d in shape.split("x")]
    n = 1
    for d in dims:
        n *= d
    if how.startswith("="):
        values = [float(v) for v in how[1:].split(",")]
    else:
        rng = random.Random(int(how))
        values = [rng.uniform(-1, 1) for _ in range(n)]
    blob = struct.pack(f"<{n}f", *values)
    header[name] = {"dtype": "F32", "shape": dims, "data_offsets": [at, at + len(blob)]}
    blobs.append(blob)
    at += len(blob)
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
PYEOF
}

# qk_job ID STEPS [muonctl step options]: an apply-mode job with QK-Clip (DESIGN.md 4e): a query projection "q" of 2
# heads of dim 4 and a key projection "k" of 1 head over input 6, threshold 10; its weights
# uploaded and STEPS steps of rank 0, each with max logits 50 (clipped) and 3 (not).
qk_job() {
  local id=$1 n=$2
  shift 2
  cat >"$tmp/$id.json" <<QKEOF
{"job_id": "$id", "mode": "apply", "tensors": [{"name": "q", "shape": [8, 6]},
 {"name": "k", "shape": [4, 6]}], "groups": [{"name": "muon", "lr": 0.01}],
 "qk_clip": {"threshold": 10, "pairs": [{"q": "q", "k": "k", "q_heads": 2, "kv_heads": 1,
 "head_dim": 4}]}}
QKEOF
  "$MUONCTL" job create --spec "$tmp/$id.json" --token-file "$tmp/$id.token" >/dev/null ||
    fail "muonctl job create $id (qk_clip)"
  write_tensors "$tmp/$id.params.safetensors" q:8x6:1 k:4x6:2
  "$MUONCTL" params init --job "$id" --rank 0 --params "$tmp/$id.params.safetensors" \
    --token-file "$tmp/$id.token" >/dev/null || fail "muonctl params init $id"
  write_tensors "$tmp/$id.logits.safetensors" "q:2:=50,3"
  for t in $(seq 0 $((n - 1))); do
    write_tensors "$tmp/$id.g$t.safetensors" "q:8x6:$((10 + t))" "k:4x6:$((20 + t))"
    "$MUONCTL" step --job "$id" --rank 0 --step "$t" --grads "$tmp/$id.g$t.safetensors" \
      --out "$tmp/$id.u$t.safetensors" --token-file "$tmp/$id.token" --lr muon=0.01 \
      --max-logits "$tmp/$id.logits.safetensors" "$@" >/dev/null || fail "muonctl step $id $t"
  done
}
