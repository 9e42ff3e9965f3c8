#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts muond with its defaults, trains a small
# character-level GPT through it (client/examples/train_tiny_gpt.py: two torch.distributed ranks,
# ZeRO-2 partition, shared memory) next to the same training with an in-process Muon, prints the
# per-step losses of both and their largest difference, writes a plot of the two loss curves and
# then the same in apply mode (bf16 parameters; masters and all optimizer state in the daemon; the
# reference steps from the trainer's parameters each step, and each step's loss difference is held
# to a bound on what bf16 rounding explains, which fails the run when exceeded), and stops the
# daemon. Run as root on Debian 12 (as another user it needs the packages already
# installed and XDG_RUNTIME_DIR set). MUOND_QUICKSTART_STEPS (default 40) and
# MUOND_QUICKSTART_PLOT (default build/tiny_gpt_loss.png) change the run. The build and both
# trainings show their progress (deploy/quickstart_progress.py: a bar on a terminal, plain lines
# otherwise), and the run ends with a one-screen summary: where the daemon listened, its status
# page, the steps and the loss parity of both modes.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

deploy/install-deps.sh
progress=(/usr/bin/python3 "$root/deploy/quickstart_progress.py")
echo "== building (deploy/build.sh)"
deploy/build.sh 2>&1 | "${progress[@]}" build

log="$(mktemp /tmp/muond-quickstart.XXXXXX.log)"
echo "== starting build/bin/muond with its defaults (log: $log)"
build/bin/muond >"$log" 2>&1 &
pid=$!
stop() {
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    wait "$pid" && echo "== muond stopped (exit 0)" || echo "== muond exited with status $?"
  fi
}
trap stop EXIT

for _ in $(seq 1 100); do
  if build/bin/muonctl health >/dev/null 2>&1; then break; fi
  if ! kill -0 "$pid" 2>/dev/null; then cat "$log"; echo "muond failed to start" >&2; exit 1; fi
  sleep 0.1
done
echo "== muonctl health: $(build/bin/muonctl health)"
head -n 3 "$log"

steps="${MUOND_QUICKSTART_STEPS:-40}"
plot="${MUOND_QUICKSTART_PLOT:-$root/build/tiny_gpt_loss.png}"
train_log="${log%.log}.train.log"
apply_log="${log%.log}.apply.log"
echo "== training a tiny GPT for $steps steps through muond (2 ranks) and with an in-process Muon"
MUOND_CLIENT_LIB="$root/build/lib/libmuond_client.so" /usr/bin/python3 -u \
  client/examples/train_tiny_gpt.py --steps "$steps" --plot "$plot" 2>&1 |
  "${progress[@]}" train --steps "$steps" --label "training (update mode)" --log "$train_log"
echo "== the loss curves (muond vs in-process Muon) are in $plot"
echo "== the same in apply mode: full optimizer offload, bf16 parameters in the trainer, fp32 masters,"
echo "   momentum and AdamW state in muond; each step's loss difference against the reference,"
echo "   stepped from the same parameters, within the bound bf16 rounding explains"
MUOND_CLIENT_LIB="$root/build/lib/libmuond_client.so" /usr/bin/python3 -u \
  client/examples/train_tiny_gpt.py --steps "$steps" --mode apply --param-dtype bfloat16 \
  --job-id tiny-gpt-apply --muonctl "$root/build/bin/muonctl" --plot "${plot%.png}_apply.png" \
  2>&1 | "${progress[@]}" train --steps "$steps" --label "training (apply mode)" --log "$apply_log"
# Where the daemon listened and whether its status page answered, read before it stops.
listen=$(sed -n 's/.*muond [^ ]* serving on \([^;]*\);.*/\1/p' "$log" | head -n 1)
page=$(sed -n 's#.*status page \(http://[^ ]*\).*#\1#p' "$log" | head -n 1)
page_check=$(/usr/bin/python3 - "$page" <<'PYEOF' 2>&1 || true
import json, sys, urllib.request
url = sys.argv[1]
with urllib.request.urlopen(url, timeout=5) as r:
    html = r.read()
with urllib.request.urlopen(url + "api/v1/status", timeout=5) as r:
    status = json.load(r)
print(f"answered {len(html)} bytes of HTML; {status['daemon']['backend']} backend, "
      f"up {status['daemon']['uptime_seconds']:.0f} s")
PYEOF
)
stop
trap - EXIT
echo "== daemon log"
cat "$log"

parity() { sed -n 's/.*\(largest |loss.*\)/\1/p' "$1" | tail -n 1; }
echo
echo "== summary"
printf '  %-14s %s\n' \
  "daemon" "${listen:-?} (stopped now; log $log)" \
  "status page" "${page:-none (metrics off)}${page_check:+ - $page_check}" \
  "metrics" "${page:+${page}metrics}" \
  "update mode" "$steps steps; loss parity: $(parity "$train_log")" \
  "apply mode" "$steps steps; loss parity: $(parity "$apply_log")" \
  "loss plots" "$plot ${plot%.png}_apply.png" \
  "training logs" "$train_log $apply_log"
