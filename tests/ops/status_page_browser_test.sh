#!/usr/bin/env bash
# The status page in a real browser: a muond runs a job (steps over gRPC and shared memory, a
# checkpoint, and more steps still running in the background) while Debian's chromium, headless,
# loads http://METRICS/ and runs its script; the DOM after the page's own refreshes must show
#   - body data-errors="0" (no script error, console error, blocked load or failed fetch) and
#     data-refreshes >= 1, and no console error in chromium's log;
#   - a job row for the job, its phase bars (one rect per phase per step kept, including
#     newton_schulz) and its step-time line;
#   - the optimizer's own series in the job's card: Newton-Schulz time by shape class, the
#     orthogonality of step 0's update, the trainer's view of a step, pipeline and pinned memory;
#   - a QK-Clip job's heads clipped and largest logit;
#   - no job token anywhere (the DOM and /api/v1/status).
# Saves the screenshot and the DOM under OUT_DIR (status_page.png, status_page.dom.html).
# Usage: status_page_browser_test.sh MUOND MUONCTL OUT_DIR
# Exits 77 (ctest: skipped) when chromium is not installed (deploy/install-deps.sh).
set -euo pipefail
MUOND=${1:?usage: status_page_browser_test.sh MUOND MUONCTL OUT_DIR}
MUONCTL=${2:?usage: status_page_browser_test.sh MUOND MUONCTL OUT_DIR}
OUT=${3:?usage: status_page_browser_test.sh MUOND MUONCTL OUT_DIR}
for tool in chromium /usr/bin/python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP: $tool not installed (deploy/install-deps.sh installs it)"
    exit 77
  fi
done
# shellcheck source=tests/metrics/live_daemon.sh
. "$(dirname "$0")/../metrics/live_daemon.sh"
mkdir -p "$OUT"
stepper_pid=""
stop_stepper() {
  if [ -n "$stepper_pid" ]; then
    kill "$stepper_pid" 2>/dev/null || true
    wait "$stepper_pid" 2>/dev/null || true
    stepper_pid=""
  fi
}
trap 'rc=$?; stop_stepper; (exit $rc); cleanup' EXIT

start_daemon
qk_job browserqk 2  # QK-Clip: 2 steps, head 0 over the threshold in each
create_job browser 96 256
run_steps browser 96 256 6 --transport grpc
"$MUONCTL" checkpoint save --job browser --token-file "$tmp/browser.token" >/dev/null 2>&1 ||
  fail "muonctl checkpoint save"
# More steps while the browser looks, alternating transports.
write_grads "$tmp/g.safetensors" 96 256 7
(
  t=6
  while :; do
    transport=grpc
    [ $((t % 2)) -eq 0 ] && transport=shm
    "$MUONCTL" step --job browser --rank 0 --step "$t" --grads "$tmp/g.safetensors" \
      --out "$tmp/u.safetensors" --token-file "$tmp/browser.token" --transport "$transport" \
      >/dev/null 2>&1 || exit 0
    t=$((t + 1))
  done
) &
stepper_pid=$!

chrome() {
  # --virtual-time-budget lets the page's fetches and at least one timer-driven refresh run
  # before the dump or the picture.
  timeout 120 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --enable-logging=stderr --v=0 --virtual-time-budget=5000 "$@" 2>>"$tmp/chromium.log"
}
chrome --dump-dom "http://$metrics/" >"$OUT/status_page.dom.html" || fail "chromium --dump-dom"
chrome --window-size=1280,1100 --screenshot="$OUT/status_page.png" "http://$metrics/" ||
  fail "chromium --screenshot"
"$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' \
  "http://$metrics/api/v1/status" >"$tmp/status.json"
stop_stepper

"$PY" - "$OUT/status_page.dom.html" "$tmp/status.json" "$tmp/browser.token" "$tmp/chromium.log" \
  "$OUT/status_page.png" <<'PYEOF'
import json, re, sys
dom, status, token = open(sys.argv[1]).read(), open(sys.argv[2]).read(), open(sys.argv[3]).read().strip()
log, png = open(sys.argv[4], errors="replace").read(), open(sys.argv[5], "rb").read()
bad = []
body = re.search(r"<body([^>]*)>", dom)
attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1))) if body else {}
if attrs.get("data-errors") != "0":
    err = re.search(r'<div id="error"[^>]*>(.*?)</div>', dom, re.S)
    bad.append(f"data-errors={attrs.get('data-errors')!r}: {err.group(1) if err else '?'}")
if int(attrs.get("data-refreshes", "0")) < 1:
    bad.append(f"data-refreshes={attrs.get('data-refreshes')!r}: the page never drew the status")
if not re.search(r'<tr class="job-row" data-job="browser">', dom):
    bad.append("no job row for job 'browser'")
# The browser job's card (the page also has the QK-Clip job's).
start = dom.find('<section class="card job-card" data-job="browser">')
end = dom.find('<section', start + 1)
card = dom[start:end if end > 0 else len(dom)] if start >= 0 else ""
bars = re.search(r'<svg class="phase-bars"[^>]*data-steps="(\d+)"', card)
rects = re.findall(r'<rect class="phase phase-([a-z_]+)"', card)
steps = int(bars.group(1)) if bars else 0
if steps < 6:
    bad.append(f"phase bars of {steps} steps, expected at least 6")
if len(rects) != 6 * steps:
    bad.append(f"{len(rects)} phase rects for {steps} steps of 6 phases")
if "newton_schulz" not in rects:
    bad.append("no newton_schulz phase rect")
# The CPU math path (server/optim/cpu_isa.h) as a fact of the daemon, as the JSON has it.
cpu_math = json.loads(status)["daemon"].get("cpu_math", "")
if not re.match(r"(amx|avx512|avx2|baseline) \(bf16 (native|emulated)", cpu_math):
    bad.append(f"JSON: daemon.cpu_math = {cpu_math!r}")
elif "CPU math" not in dom or cpu_math.split(" (")[0] + " (bf16" not in dom:
    bad.append("the page shows no CPU math fact")
if not re.search(r'<svg class="step-time".*?<polyline points="[^"]+"', dom, re.S):
    bad.append("no step-time line")
console = [l for l in log.splitlines() if "CONSOLE" in l and re.search(r"error|uncaught|refused", l, re.I)]
if console:
    bad.append("console errors: " + " | ".join(console[:3]))
if not token or token in dom or token in status:
    bad.append("the job token appears in the page or the JSON (or no token was read)")
if not png.startswith(b"\x89PNG") or len(png) < 10000:
    bad.append(f"screenshot is not a picture ({len(png)} bytes)")
s = json.loads(status)
job = next((j for j in s["jobs"] if j["id"] == "browser"), None)
if job is None or job["checkpoint"] is None or job["checkpoint"]["step"] != 6:
    bad.append(f"JSON: job checkpoint {job and job['checkpoint']}, expected step 6")
# The optimizer's own series in the job's card: the Newton-Schulz table has the job's one shape
# class (96x256) with a time per matrix; step 0 (a multiple of --orthogonality-every 100) was
# sampled; the trainer's view and the pinned momentum are facts; the JSON agrees.
opt = (job or {}).get("optimizer") or {}
shapes = opt.get("newton_schulz") or []
if [t.get("shape") for t in shapes] != ["96x256"] or not shapes[0].get("matrices"):
    bad.append(f"JSON: optimizer.newton_schulz {shapes!r}, expected one class 96x256 with matrices")
if not re.search(r'<tr class="ns-shape" data-shape="96x256"><td>96x256</td><td>1</td><td>[0-9.]+ ?[mµu]?s</td>', dom):
    bad.append("no Newton-Schulz row for shape 96x256 with its time per matrix")
orth = opt.get("orthogonality") or {}
if orth.get("step") != 0 or not 0 < orth.get("value", -1) < 0.5:
    bad.append(f"JSON: optimizer.orthogonality {orth!r}, expected step 0 with a value in (0, 0.5)")
elif f"{orth['value']:.4f} at step 0" not in dom:
    bad.append("the page shows no orthogonality fact")
if not (opt.get("trainer") or {}).get("visible_seconds"):
    bad.append(f"JSON: optimizer.trainer {opt.get('trainer')!r}")
elif "first gradient to last update" not in dom:
    bad.append("the page shows no trainer view")
# One copy of the momentum, pinned (the steps were sealed before computing: updated in place).
if (opt.get("pinned_bytes") or {}).get("momentum") != 96 * 256 * 4:
    bad.append(f"JSON: optimizer.pinned_bytes {opt.get('pinned_bytes')!r}, momentum 96x256 fp32")
elif "matrices waiting for the device" not in dom or "momentum 96" not in dom:
    bad.append("the page shows no pipeline or pinned fact")
qk = next((j for j in s["jobs"] if j["id"] == "browserqk"), {}).get("optimizer", {}).get("qk_clip")
if not qk or qk.get("heads_clipped") != 2 or qk.get("max_logit") != 50:
    bad.append(f"JSON: browserqk optimizer.qk_clip {qk!r}, expected 2 heads clipped, max logit 50")
elif "1 attention pairs at threshold 10: 2 query heads clipped; newest largest logit 50.00" not in dom:
    bad.append("the page shows no QK-Clip fact for job browserqk")
if bad:
    sys.exit("FAIL:\n  " + "\n  ".join(bad))
print(f"optimizer: shape 96x256 {shapes[0]['matrices']} matrices, orthogonality {orth['value']:.4f} "
      f"at step 0, trainer view {opt['trainer']}")
print(f"DOM: data-errors 0, {attrs['data-refreshes']} refreshes, job row, {steps} steps x 6 phase rects, "
      f"step-time line; no token; screenshot {len(png)} bytes")
PYEOF
stop_daemon
echo "screenshot: $OUT/status_page.png"
echo "PASS"
