#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts muond with its defaults, trains a small
# character-level GPT through it (client/examples/train_tiny_gpt.py: two torch.distributed ranks,
# ZeRO-2 partition, shared memory) next to the same training with an in-process Muon, prints the
# per-step losses of both and their largest difference, writes a plot of the two loss curves and
# then the same in apply mode (bf16 parameters; masters and all optimizer state in the daemon), and
# stops the daemon. Run as root on Debian 12 (as another user it needs the packages already
# installed and XDG_RUNTIME_DIR set). MUOND_QUICKSTART_STEPS (default 40) and
# MUOND_QUICKSTART_PLOT (default build/tiny_gpt_loss.png) change the run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

deploy/install-deps.sh
deploy/build.sh

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
echo "== training a tiny GPT for $steps steps through muond (2 ranks) and with an in-process Muon"
MUOND_CLIENT_LIB="$root/build/lib/libmuond_client.so" /usr/bin/python3 \
  client/examples/train_tiny_gpt.py --steps "$steps" --plot "$plot"
echo "== the loss curves (muond vs in-process Muon) are in $plot"
echo "== the same in apply mode: full optimizer offload, bf16 parameters in the trainer, fp32 masters,"
echo "   momentum and AdamW state in muond"
MUOND_CLIENT_LIB="$root/build/lib/libmuond_client.so" /usr/bin/python3 \
  client/examples/train_tiny_gpt.py --steps "$steps" --mode apply --param-dtype bfloat16 \
  --job-id tiny-gpt-apply --muonctl "$root/build/bin/muonctl" --plot "${plot%.png}_apply.png"
stop
trap - EXIT
echo "== daemon log"
cat "$log"
