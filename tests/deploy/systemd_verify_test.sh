#!/usr/bin/env bash
# deploy/systemd/muond.service:
#   (a) `systemd-analyze verify` on it, with ExecStart's binary replaced by the built muond (verify
#       checks that it exists): exit 0 and NO output at all (verify exits 0 even for unknown keys;
#       a copy with an unknown key is checked too, to prove the check sees such warnings here);
#   (b) the settings the deployment relies on: Type=notify, NotifyAccess=main, WatchdogSec,
#       LimitMEMLOCK=infinity, RuntimeDirectory=muond (0750, with a Group), StateDirectory=muond (0700),
#       ProtectSystem=strict with ReadWritePaths, ProtectHome, NoNewPrivileges, PrivateTmp; no
#       PrivateDevices and no DevicePolicy=closed (they would hide the GPUs); TimeoutStopSec above
#       the sample config's shutdown-grace-seconds; ExecStart reads /etc/muond/muond.conf.
# Usage: systemd_verify_test.sh REPO_ROOT PATH/TO/muond
set -euo pipefail
root=${1:?usage: systemd_verify_test.sh REPO_ROOT MUOND}
muond=$(realpath "${2:?usage: systemd_verify_test.sh REPO_ROOT MUOND}")
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
if ! command -v systemd-analyze >/dev/null; then
  echo "SKIP: systemd-analyze not installed (deploy/install-deps.sh installs systemd)"
  exit 77
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/muond-systemd.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
unit="$root/deploy/systemd/muond.service"
grep -q '^ExecStart=/usr/local/bin/muond --config /etc/muond/muond.conf$' "$unit" ||
  fail "ExecStart is not /usr/local/bin/muond --config /etc/muond/muond.conf"
sed "s#^ExecStart=/usr/local/bin/muond #ExecStart=$muond #" "$unit" >"$tmp/muond.service"

# --- (a) verify -----------------------------------------------------------------------------------
set +e
systemd-analyze verify "$tmp/muond.service" >"$tmp/verify.out" 2>&1
rc=$?
set -e
if [ "$rc" -ne 0 ] || [ -s "$tmp/verify.out" ]; then
  cat "$tmp/verify.out"
  fail "systemd-analyze verify: exit $rc, $(wc -l <"$tmp/verify.out") lines of output"
fi
echo "systemd-analyze verify muond.service: exit 0, no output"
sed 's/^\[Service\]$/[Service]\nNoSuchSetting=1/' "$tmp/muond.service" >"$tmp/bad.service"
systemd-analyze verify "$tmp/bad.service" >"$tmp/bad.out" 2>&1 || true
grep -q "Unknown key 'NoSuchSetting'" "$tmp/bad.out" ||
  fail "control: verify did not report an unknown key: $(cat "$tmp/bad.out")"
echo "control: an unknown key is reported ($(head -c 100 "$tmp/bad.out"))"

# --- (b) the settings -----------------------------------------------------------------------------
/usr/bin/python3 - "$unit" "$root/deploy/muond.conf.sample" <<'PYEOF'
import sys
unit, sample = sys.argv[1], sys.argv[2]
settings = {}
for line in open(unit):
    line = line.strip()
    if line and not line.startswith(("#", ";", "[")):
        k, v = line.split("=", 1)
        settings.setdefault(k, []).append(v)
one = lambda k: settings.get(k, [None])[-1]
want = {"Type": "notify", "NotifyAccess": "main", "LimitMEMLOCK": "infinity",
        "RuntimeDirectory": "muond", "RuntimeDirectoryMode": "0750", "StateDirectory": "muond",
        "StateDirectoryMode": "0700",
        "ProtectSystem": "strict", "ProtectHome": "yes", "NoNewPrivileges": "yes",
        "PrivateTmp": "yes"}
bad = [f"{k}={one(k)!r}, wanted {v!r}" for k, v in want.items() if one(k) != v]
for k in ("WatchdogSec", "Group", "ReadWritePaths", "User"):
    if not one(k):
        bad.append(f"{k} missing")
if one("PrivateDevices") not in (None, "no", "false"):
    bad.append("PrivateDevices would hide the GPUs")
if one("DevicePolicy") in ("closed", "strict"):
    bad.append("DevicePolicy closed/strict would hide the GPUs")
grace = None
for line in open(sample):
    if line.startswith("shutdown-grace-seconds"):
        grace = float(line.split("=", 1)[1])
stop = one("TimeoutStopSec")
if grace is None or stop is None or float(stop) <= grace:
    bad.append(f"TimeoutStopSec {stop} not above shutdown-grace-seconds {grace}")
if bad:
    sys.exit("FAIL: " + "; ".join(bad))
print(f"settings: {', '.join(f'{k}={one(k)}' for k in sorted(want))}, WatchdogSec={one('WatchdogSec')}, "
      f"TimeoutStopSec={stop} > grace {grace:g}")
PYEOF
echo "PASS"
