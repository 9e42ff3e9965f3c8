#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts muond with its defaults, runs a real
# multi-step Muon workload through it with muonctl, prints the per-step results and stops the
# daemon. Run as root on Debian 12 (as another user it needs the packages already installed and
# XDG_RUNTIME_DIR set).
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

echo "== running a Muon training workload through muond"
/usr/bin/python3 client/examples/muonctl_regression.py --muonctl build/bin/muonctl --steps 8
stop
trap - EXIT
echo "== daemon log"
cat "$log"
