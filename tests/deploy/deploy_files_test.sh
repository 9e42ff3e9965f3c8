#!/usr/bin/env bash
# The deployment files under deploy/, checked with the tools that consume them:
#   (a) promtool check config deploy/prometheus/prometheus.yml and check rules muond.rules.yml:
#       exit 0 and no warning in their output; promtool test rules muond.rules.test.yml (each
#       alert fires, and only, when it should);
#   (b) every YAML file parses (/usr/bin/python3 + python3-yaml); the DaemonSet: RollingUpdate with
#       maxUnavailable 1, hostPath /run/muond mounted at the socket directory, the metrics port equal
#       to the ConfigMap's metrics-address port, probes that run `muonctl health`, MUOND_ADDRESS
#       equal to the ConfigMap's listen address, terminationGracePeriodSeconds >= the ConfigMap's
#       shutdown-grace-seconds + 60 (time for the final checkpoint);
#   (c) deploy/muond.conf.sample documents every option of `muond --help` (as `key =` or
#       `# key =`), and it and the ConfigMap's muond.conf parse (muond reads the file, then fails
#       on a deliberately bad flag given after it: exit 2 naming that flag, not the file);
#   (d) the Dockerfile builds on Debian 12 with deploy/install-deps.sh and deploy/build.sh, copies
#       only files that exist, and names runtime packages that apt knows.
# Usage: deploy_files_test.sh REPO_ROOT PATH/TO/muond
set -euo pipefail
root=${1:?usage: deploy_files_test.sh REPO_ROOT MUOND}
muond=${2:?usage: deploy_files_test.sh REPO_ROOT MUOND}
PY=/usr/bin/python3
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
if ! command -v promtool >/dev/null || ! "$PY" -c 'import yaml' 2>/dev/null; then
  echo "SKIP: promtool or python3-yaml not installed (deploy/install-deps.sh installs them)"
  exit 77
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/muond-deploy.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# --- (a) promtool ---------------------------------------------------------------------------------
prom="$root/deploy/prometheus"
for check in "check config $prom/prometheus.yml" "check rules $prom/muond.rules.yml" \
             "test rules $prom/muond.rules.test.yml"; do
  set +e
  # shellcheck disable=SC2086
  (cd "$prom" && promtool $check) >"$tmp/promtool.out" 2>&1
  rc=$?
  set -e
  if [ "$rc" -ne 0 ] || grep -qi 'warn' "$tmp/promtool.out"; then
    cat "$tmp/promtool.out"
    fail "promtool $check: exit $rc"
  fi
  echo "promtool $check: exit 0, $(grep -c SUCCESS "$tmp/promtool.out") SUCCESS lines, no warnings"
done
grep -q 'SUCCESS: 5 rules found' <(promtool check rules "$prom/muond.rules.yml" 2>&1) ||
  fail "muond.rules.yml: expected 5 rules"

# --- (b) YAML -------------------------------------------------------------------------------------
"$PY" - "$root" "$tmp/configmap.conf" <<'PYEOF'
import glob, os, sys, yaml
root, conf_out = sys.argv[1], sys.argv[2]
files = sorted(glob.glob(f"{root}/deploy/**/*.yml", recursive=True) +
               glob.glob(f"{root}/deploy/**/*.yaml", recursive=True))
for f in files:
    docs = list(yaml.safe_load_all(open(f)))
    assert docs and all(d is not None for d in docs), f"{f}: empty document"
print(f"yaml: {len(files)} files parse: {', '.join(os.path.relpath(f, root) for f in files)}")

docs = {d["kind"]: d for d in yaml.safe_load_all(open(f"{root}/deploy/kubernetes/daemonset.yaml"))}
assert set(docs) == {"Namespace", "ConfigMap", "DaemonSet"}, set(docs)
conf_text = docs["ConfigMap"]["data"]["muond.conf"]
open(conf_out, "w").write(conf_text)
conf = {}
for line in conf_text.splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        k, v = (p.strip() for p in line.split("=", 1))
        conf[k] = v
ds = docs["DaemonSet"]
spec = ds["spec"]
tmpl = spec["template"]
pod = tmpl["spec"]
assert spec["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
assert spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}, \
    spec["updateStrategy"]
grace = float(conf["shutdown-grace-seconds"])
assert pod["terminationGracePeriodSeconds"] >= grace + 60, (pod["terminationGracePeriodSeconds"], grace)
(c,) = [c for c in pod["containers"] if c["name"] == "muond"]
listen = conf["listen"]
assert listen.startswith("unix:///"), listen
sock_dir = os.path.dirname(listen[len("unix://"):])
volumes = {v["name"]: v for v in pod["volumes"]}
mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
assert volumes[mounts[sock_dir]]["hostPath"]["path"] == sock_dir, (sock_dir, mounts)
metrics_port = int(conf["metrics-address"].rsplit(":", 1)[1])
ports = {p["name"]: p["containerPort"] for p in c["ports"]}
assert ports["metrics"] == metrics_port, (ports, metrics_port)
assert tmpl["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port)
env = {e["name"]: e["value"] for e in c["env"]}
assert env["MUOND_ADDRESS"] == listen, env
for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
    assert c[probe]["exec"]["command"] == ["muonctl", "health"], (probe, c[probe])
assert c["args"] == ["--config", "/etc/muond/muond.conf"], c["args"]
print(f"daemonset: RollingUpdate maxUnavailable 1, grace {pod['terminationGracePeriodSeconds']} s "
      f">= {grace:g} + 60, hostPath {sock_dir}, metrics port {metrics_port}, exec probes")
PYEOF

# --- (c) the sample config --------------------------------------------------------------------
sample="$root/deploy/muond.conf.sample"
"$muond" --help >"$tmp/help.txt"
missing=()
for key in $(grep -oE '^  --[a-z][a-z-]*' "$tmp/help.txt" | sed 's/^  --//' | sort -u); do
  case "$key" in help | version | config) continue ;; esac
  grep -Eq "^#? ?$key = " "$sample" || missing+=("$key")
done
[ "${#missing[@]}" -eq 0 ] || fail "muond.conf.sample does not document: ${missing[*]}"
echo "muond.conf.sample documents every option of muond --help"
for conf in "$sample" "$tmp/configmap.conf"; do
  set +e
  "$muond" --config "$conf" --threads=-1 >"$tmp/parse.out" 2>&1
  rc=$?
  set -e
  if [ "$rc" -ne 2 ] || ! grep -q -- '--threads' "$tmp/parse.out" || grep -q "$conf" "$tmp/parse.out"; then
    cat "$tmp/parse.out"
    fail "$conf does not parse (exit $rc)"
  fi
done
echo "muond parses muond.conf.sample and the ConfigMap's muond.conf"

# --- (d) Dockerfile -------------------------------------------------------------------------------
docker="$root/deploy/container/Dockerfile"
grep -q '^ARG DEBIAN_IMAGE=debian:12$' "$docker" || fail "Dockerfile: not based on debian:12"
grep -q 'deploy/install-deps.sh' "$docker" || fail "Dockerfile: does not use deploy/install-deps.sh"
grep -q 'deploy/build.sh' "$docker" || fail "Dockerfile: does not use deploy/build.sh"
for src in $(sed -n 's/^COPY \(--[a-z]*=[a-z]* \)\{0,1\}\(deploy[^ ]*\) .*/\2/p' "$docker"); do
  [ -e "$root/$src" ] || fail "Dockerfile copies $src, which does not exist"
done
pkgs=$(sed -n '/apt-get install/,/rm -rf/p' "$docker" | grep -oE 'lib[a-z0-9.+-]+|ca-certificates' |
  grep -vE '^lib(cublas)' | sort -u)
for p in $pkgs; do
  apt-cache show "$p" >/dev/null 2>&1 || fail "Dockerfile installs $p, unknown to apt"
done
echo "Dockerfile: debian:12, install-deps.sh + build.sh, runtime packages known to apt: $(echo $pkgs)"
echo "PASS"
