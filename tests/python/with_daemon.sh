#!/usr/bin/env bash
# with_daemon.sh MUOND_BIN CMD...: starts muond on a private socket, runs CMD with --address
# appended, stops the daemon with SIGTERM and fails unless both CMD and muond exit 0.
set -euo pipefail
muond="$1"; shift
dir="$(mktemp -d /tmp/muond-test.XXXXXX)"
"$muond" --listen "unix://$dir/muond.sock" --state-dir "$dir/state" --threads 1 2>"$dir/log" &
pid=$!
cleanup() { kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
for _ in $(seq 1 100); do [ -S "$dir/muond.sock" ] && break; sleep 0.1; done
"$@" --address "unix://$dir/muond.sock"
kill -TERM "$pid"
if ! wait "$pid"; then echo "muond did not exit 0" >&2; cat "$dir/log" >&2; exit 1; fi
trap - EXIT
rm -rf "$dir"
