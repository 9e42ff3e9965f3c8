#!/usr/bin/env bash
# Progress of long operations in muonctl against a live daemon whose checkpoint writes are slowed
# down (MUOND_TEST_CHECKPOINT_FAULT=delay:MS, a test-hooks build; without hooks the save is fast
# and only its final line is required). A job of 16 matrices of 256 x 256 (4 MiB of momentum):
#   - checkpoint save, load, job create --restore-from, export (an apply-mode job) with stderr not
#     a terminal: every progress line is the plain form
#       progress: WHAT: DONE/TOTAL bytes (P%), RATE, T left | done in T
#     the bytes never go down, the last line is 100.0% of the state bytes with "done in";
#     the save shows more than one line when the writes are slowed;
#   - checkpoint save on a terminal (util-linux `script` gives it a pty): the bar is redrawn in
#     place with '\r' and ends at 100.0%;
#   - stdout keeps the commands' usual one-line results.
# Usage: progress_test.sh MUOND MUONCTL
set -euo pipefail
MUOND=${1:?usage: progress_test.sh MUOND MUONCTL}
MUONCTL=${2:?usage: progress_test.sh MUOND MUONCTL}
if [ ! -x /usr/bin/python3 ]; then echo "SKIP: /usr/bin/python3 not installed"; exit 77; fi
# shellcheck source=tests/metrics/live_daemon.sh
. "$(dirname "$0")/../metrics/live_daemon.sh"

export MUOND_TEST_CHECKPOINT_FAULT=delay:100
start_daemon
hooks=0
grep -q "checkpoint fault injection armed" "$tmp/muond.log" && hooks=1
total=$((16 * 256 * 256 * 4))
"$PY" -c 'import json; print(json.dumps({"job_id": "big", "matrices":
  [{"name": "w%d" % i, "shape": [256, 256]} for i in range(16)]}))' >"$tmp/big.json"
"$MUONCTL" job create --spec "$tmp/big.json" --token-file "$tmp/big.token" >/dev/null ||
  fail "job create big"

# check_lines FILE WHAT TOTAL MIN_LINES: the plain progress lines of FILE.
check_lines() {
  "$PY" - "$@" <<'PYEOF'
import re, sys
path, what, total, min_lines = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lines = [l for l in open(path).read().split("\n") if l]
pat = re.compile(r"^progress: (.+): (\d+)/(\d+) bytes \((\d+\.\d)%\), (\d+(\.\d)? (B|KiB|MiB|GiB|TiB)/s|-), "
                 r"(\d+:\d\d(:\d\d)? left|done in \d+:\d\d(:\d\d)?)$")
done_seen, last = [], None
for l in lines:
    m = pat.match(l)
    if not m:
        sys.exit(f"FAIL: {path}: not a plain progress line: {l!r}")
    if m.group(1) != what or int(m.group(3)) != total:
        sys.exit(f"FAIL: {path}: {l!r}: expected {what!r} of {total} bytes")
    done_seen.append(int(m.group(2)))
    last = m
if len(lines) < min_lines:
    sys.exit(f"FAIL: {path}: {len(lines)} progress lines, expected at least {min_lines}: {lines}")
if done_seen != sorted(done_seen):
    sys.exit(f"FAIL: {path}: bytes went down: {done_seen}")
if done_seen[-1] != total or last.group(4) != "100.0" or not last.group(8).startswith("done in"):
    sys.exit(f"FAIL: {path}: the last line is not 100% done: {lines[-1]!r}")
print(f"{what}: {len(lines)} lines, {done_seen[:-1]} then {total} bytes, 100.0% done")
PYEOF
}

"$MUONCTL" checkpoint save --job big --token-file "$tmp/big.token" >"$tmp/save.out" 2>"$tmp/save.err" ||
  fail "checkpoint save: $(cat "$tmp/save.err")"
grep -q "^saved job big generation 1 at step 0" "$tmp/save.out" || fail "save stdout: $(cat "$tmp/save.out")"
check_lines "$tmp/save.err" "save job big" "$total" $((hooks + 1)) || fail "save progress"

"$MUONCTL" checkpoint load --job big --token-file "$tmp/big.token" >"$tmp/load.out" 2>"$tmp/load.err" ||
  fail "checkpoint load: $(cat "$tmp/load.err")"
grep -q "^loaded job big generation 1" "$tmp/load.out" || fail "load stdout: $(cat "$tmp/load.out")"
check_lines "$tmp/load.err" "load job big" "$total" 1 || fail "load progress"

sed 's/"big"/"big2"/' "$tmp/big.json" >"$tmp/big2.json"
MUOND_JOB_TOKEN=$(cat "$tmp/big.token") "$MUONCTL" job create --spec "$tmp/big2.json" \
  --token-file "$tmp/big2.token" --restore-from big >"$tmp/restore.out" 2>"$tmp/restore.err" ||
  fail "job create --restore-from: $(cat "$tmp/restore.err")"
grep -q "^created job big2" "$tmp/restore.out" || fail "restore stdout: $(cat "$tmp/restore.out")"
check_lines "$tmp/restore.err" "restore job big2 from big" "$total" 1 || fail "restore progress"

# Export: an apply-mode job initialized from a file.
write_grads "$tmp/init.safetensors" 512 512 1
printf '{"job_id": "ex", "mode": "apply", "init_from": "%s", "groups": [{"name": "g", "lr": 0.01, "weight_decay": 0.0}],
  "tensors": [{"name": "w", "shape": [512, 512], "dtype": "float32", "param_dtype": "float32",
  "optimizer": "muon", "group": "g"}]}\n' "$tmp/init.safetensors" >"$tmp/ex.json"
"$MUONCTL" job create --spec "$tmp/ex.json" --token-file "$tmp/ex.token" >/dev/null 2>"$tmp/ex.err" ||
  fail "job create ex: $(cat "$tmp/ex.err")"
"$MUONCTL" export --job ex --token-file "$tmp/ex.token" --out "$tmp/ex.safetensors" \
  >"$tmp/export.out" 2>"$tmp/export.err" || fail "export: $(cat "$tmp/export.err")"
grep -q "^exported job ex at step 0" "$tmp/export.out" || fail "export stdout: $(cat "$tmp/export.out")"
check_lines "$tmp/export.err" "export job ex" $((512 * 512 * 4)) 1 || fail "export progress"

# On a terminal.
if command -v script >/dev/null; then
  script -qec "'$MUONCTL' checkpoint save --job big --token-file '$tmp/big.token'" /dev/null \
    >"$tmp/tty.out" 2>&1 || fail "checkpoint save on a pty: $(cat "$tmp/tty.out")"
  "$PY" - "$tmp/tty.out" "$hooks" <<'PYEOF'
import re, sys
out, hooks = open(sys.argv[1], "rb").read().decode(errors="replace"), int(sys.argv[2])
draws = re.findall(r"\r(save job big  \[[#-]{20}\] +\d+\.\d%[^\r\n]*)", out)
if not draws:
    sys.exit(f"FAIL: no bar drawn on the terminal: {out!r}")
if hooks and len(draws) < 2:
    sys.exit(f"FAIL: the bar was drawn {len(draws)} time(s) during a slowed save: {out!r}")
if not draws[-1].startswith("save job big  [" + "#" * 20 + "]  100.0%"):
    sys.exit(f"FAIL: the last bar is not full: {draws[-1]!r}")
if "saved job big generation 2" not in out:
    sys.exit(f"FAIL: no result line: {out!r}")
print(f"terminal: {len(draws)} draws, last {draws[-1].split(chr(27))[0]!r}")
PYEOF
else
  echo "no util-linux script: terminal form not checked"
fi
stop_daemon
echo "PASS"
