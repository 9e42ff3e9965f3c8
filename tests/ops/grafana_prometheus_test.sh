#!/usr/bin/env bash
# deploy/grafana/muond.json against a real Prometheus: a muond runs a job (steps over gRPC and
# shared memory, one refused out-of-order step, a checkpoint save) while Debian's prometheus
# scrapes it every second; then every PromQL expression of every panel of the dashboard, with its
# variables substituted ($node -> the daemon's instance, $__rate_interval -> 1m), is evaluated
# through Prometheus' HTTP API and must return at least one series with a value that is not NaN (+Inf
# counts: RLIMIT_MEMLOCK unlimited). The
# dashboard must also be a well-formed Grafana JSON model (datasource and node variables, every
# target on the datasource variable).
# Usage: grafana_prometheus_test.sh MUOND MUONCTL DASHBOARD_JSON
# Exits 77 (ctest: skipped) when prometheus or promtool is not installed (deploy/install-deps.sh).
set -euo pipefail
MUOND=${1:?usage: grafana_prometheus_test.sh MUOND MUONCTL DASHBOARD}
MUONCTL=${2:?usage: grafana_prometheus_test.sh MUOND MUONCTL DASHBOARD}
DASHBOARD=${3:?usage: grafana_prometheus_test.sh MUOND MUONCTL DASHBOARD}
for tool in promtool prometheus /usr/bin/python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP: $tool not installed (deploy/install-deps.sh installs it)"
    exit 77
  fi
done
# shellcheck source=tests/metrics/live_daemon.sh
. "$(dirname "$0")/../metrics/live_daemon.sh"

start_daemon
create_job dash 64 128

start_prometheus "$metrics"

# Waits (bounded) until prometheus has scraped the daemon, so that the steps below happen while it
# watches (rates over them are then non-zero).
wait_scraped() {
  "$PY" - "$prom_port" "$metrics" "$1" <<'PYEOF'
import json, sys, time, urllib.parse, urllib.request
prom, target, query = sys.argv[1], sys.argv[2], sys.argv[3]
deadline = time.time() + 60
while time.time() < deadline:
    try:
        url = f"http://127.0.0.1:{prom}/api/v1/query?query=" + urllib.parse.quote(query)
        with urllib.request.urlopen(url, timeout=2) as r:
            if json.load(r)["data"]["result"]:
                sys.exit(0)
    except OSError:
        pass  # not listening yet
    time.sleep(0.2)
sys.exit(f"FAIL: prometheus never saw {query} from {target} in 60 s")
PYEOF
}
wait_scraped 'muond_jobs{instance="'"$metrics"'"} == 1'

run_steps dash 64 128 4 --transport grpc
# The step histograms are born with the first step: Prometheus must have scraped them once before
# the next steps, or their rates (and the quantiles over them) stay 0/0 however long it is asked.
wait_scraped 'muond_step_duration_seconds_count{instance="'"$metrics"'",muond_job="dash"} >= 4'
for t in 4 5; do
  write_grads "$tmp/dash.g$t.safetensors" 64 128 "$t"
  "$MUONCTL" step --job dash --rank 0 --step "$t" --grads "$tmp/dash.g$t.safetensors" \
    --out "$tmp/dash.u$t.safetensors" --token-file "$tmp/dash.token" --transport shm >/dev/null ||
    fail "muonctl step dash $t --transport shm"
done
# One refused request (out of order: FAILED_PRECONDITION), for the RPC errors panel.
if "$MUONCTL" step --job dash --rank 0 --step 9 --grads "$tmp/dash.g5.safetensors" \
  --out "$tmp/dash.u9.safetensors" --token-file "$tmp/dash.token" --transport grpc \
  >/dev/null 2>&1; then
  fail "an out-of-order step was accepted"
fi
# A QK-Clip job (muonctl step --max-logits) for the QK-Clip panel.
qk_job dashqk 2
"$MUONCTL" checkpoint save --job dash --token-file "$tmp/dash.token" >/dev/null 2>&1 ||
  fail "muonctl checkpoint save"
wait_scraped 'muond_checkpoint_newest_age_seconds{instance="'"$metrics"'"}'
wait_scraped 'muond_steps_completed_total{instance="'"$metrics"'",muond_job="dash"} == 6'

"$PY" - "$prom_port" "$metrics" "$DASHBOARD" <<'PYEOF'
import json, math, sys, time, urllib.parse, urllib.request
prom, instance, path = sys.argv[1], sys.argv[2], sys.argv[3]
dash = json.load(open(path))
bad = []
variables = {v["name"]: v for v in dash["templating"]["list"]}
if variables.get("datasource", {}).get("type") != "datasource":
    bad.append("no datasource variable of type datasource")
if variables.get("node", {}).get("type") != "query":
    bad.append("no node variable of type query")
exprs = []
for p in dash["panels"]:
    if p.get("datasource", {}).get("uid") != "${datasource}":
        bad.append(f"panel {p['title']!r} is not on ${{datasource}}")
    if not p.get("targets"):
        bad.append(f"panel {p['title']!r} has no query")
    for t in p.get("targets", []):
        if t.get("datasource", {}).get("uid") != "${datasource}":
            bad.append(f"panel {p['title']!r} target {t['refId']} is not on ${{datasource}}")
        if '$node' not in t["expr"]:
            bad.append(f"panel {p['title']!r} target {t['refId']} ignores $node")
        exprs.append((p["title"], t["refId"], t["expr"]))
node_query = variables["node"]["query"]["query"]
def query(expr):
    url = f"http://127.0.0.1:{prom}/api/v1/query?query=" + urllib.parse.quote(expr)
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise ValueError(body)
    return body["data"]["result"]
# The node variable's values: label_values(muond_build_info, instance) is the instance label of
# muond_build_info.
nodes = sorted({s["metric"].get("instance") for s in query("muond_build_info")})
if nodes != [instance]:
    bad.append(f"node variable values {nodes}, expected [{instance!r}]")
# A series Prometheus has seen once has no rate yet: each expression is asked again, for up to
# 30 s in all, until it answers (a bounded wait for scrapes, not a timing assertion).
deadline = time.time() + 30
for title, ref, expr in exprs:
    promql = expr.replace("$__rate_interval", "1m").replace("$node", instance.replace(".", "\\\\."))
    while True:
        try:
            result = query(promql)
        except Exception as e:  # a PromQL error answers 400
            result = e
            break
        finite = [v for v in (float(s["value"][1]) for s in result) if not math.isnan(v)]
        if finite or time.time() > deadline:
            break
        time.sleep(0.5)
    if isinstance(result, Exception):
        bad.append(f"{title} {ref}: {promql}: {result}")
        continue
    if not finite:
        bad.append(f"{title} {ref}: no value but NaN ({len(result)} series): {promql}")
    else:
        print(f"ok  {title} [{ref}]: {len(result)} series, e.g. {finite[0]:.6g}")
# Every metric the dashboard, the alert rules and the README's metrics table name is a family the
# daemon exposes (the names are an interface: renaming one breaks dashboards and alerts).
import os, re
with urllib.request.urlopen(f"http://{instance}/metrics", timeout=5) as r:
    scrape = r.read().decode()
exposed = set(re.findall(r"^# TYPE (\S+) ", scrape, re.M))
def family(name):  # a histogram's series name to its family
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in exposed:
            return name[: -len(suffix)]
    return name
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(path))))
rules = open(os.path.join(root, "deploy/prometheus/muond.rules.yml")).read()
readme = open(os.path.join(root, "README.md")).read()
table = readme[readme.index("### Prometheus"):readme.index("### muonctl status and top")]
named = {
    "dashboard": {family(n) for _, _, e in exprs for n in re.findall(r"\bmuond_[a-z_]+", e)},
    "rules": {family(n) for n in re.findall(r"\bmuond_[a-z_]+(?=[{\s\[(])", rules)},
    "README": {n for row in re.findall(r"^\| (`muond_.*?) \|", table, re.M)
               for n in re.findall(r"`(muond_[a-z_]+)`", row)},
}
# Families that exist only in some states, and why they are absent from this run.
conditional = {"muond_momentum_limit_bytes": "no --max-state-bytes"}
for where, names in named.items():
    names.discard("muond_job")  # the job label
    missing = sorted(n for n in names if n not in exposed and n not in conditional)
    if missing:
        bad.append(f"{where} names metrics the daemon does not expose: {missing}")
    else:
        print(f"ok  {len(names)} metric names of the {where} are exposed")
if bad:
    sys.exit("FAIL:\n  " + "\n  ".join(bad))
print(f"all {len(exprs)} expressions of {len(dash['panels'])} panels returned data")
PYEOF
stop_daemon
echo "PASS"
