#!/usr/bin/python3
"""Many-node step time of MultiNodeMuonWithAuxAdam with emulated nodes in Linux network
namespaces, against a model built from rates measured in the same run.

Usage (as root): multinode_netns_bench.py [--nodes 1,2,4] [--ranks-per-node 1]
    [--rate-mbit 400] [--steps 5] [--warmup 2] [--layers 1]
    [--dtype float32] [--json PATH] [--muond PATH]

Emulated nodes. Node n is a network namespace muondbench-<pid>-<n> with one veth ("mbeth",
10.200.0.<n+1>/24) whose peer is a port of a bridge in a switch namespace muondbench-<pid>-sw.
Both ends of every veth carry a tbf qdisc of --rate-mbit (tbf shapes egress only: the node's
end limits what the node sends, the switch's end what it receives), so every node has a
full-duplex link of that rate to a non-blocking switch. Everything lives in those namespaces;
deleting them (on exit, on an error, on SIGINT/SIGTERM/SIGHUP, and at the start of a run for
namespaces of a run whose process is gone) removes every veth and the bridge.

What is measured. For each node count N of --nodes (N = 1 always runs: it calibrates the
model), one muond per node runs inside the node's namespace (--threads 1, --backend cpu, its
own socket and state directory under a temporary directory) and L = --ranks-per-node ranks run
inside it: a gloo world of W = N*L ranks over TCP between the namespaces (MASTER_ADDR node 0's
veth address, GLOO_SOCKET_IFNAME=mbeth). Every rank builds MultiNodeMuonWithAuxAdam (update
mode, zero_stage=2, float32 by default, reduce_gradients=False: the gradients are set directly,
as already reduced) over --layers Qwen3-0.6B-like layers of Muon matrices (q 2048x1024, k and v
1024x1024, o 1024x2048, gate and up 3072x1024, down 1024x3072: 15.7 M elements and about 390
GFLOP of Newton-Schulz per layer, about 3.3 s on one core here, hence one layer by default),
then times --warmup + --steps calls of opt.step() after a barrier. A step's time is its slowest
rank's; the table shows the median over the measured steps. The default --rate-mbit 400 (50
MB/s a link) makes the data exchanges about half of a 2- or 4-node step. Per step the ranks
also record their phases (the two all-to-alls, the daemon's step, the ZeRO all-gather) and
the CPU seconds of their node's daemon (in --json).

One step, in order: the forward all-to-all (every rank's ZeRO partition to the owner nodes),
the daemons' Newton-Schulz (all nodes at once), the agreement all-reduce and the commits, the
inverse all-to-all (the updates back), the update applied to the rank's partition, and ZeRO
stage 2's all-gather of the new weights over the world. The three data exchanges cross the
node links and do not overlap the compute, so step = compute + network.

The model, from what this run measured (no constants):
  compute(N). T1: the 1-node step (every tensor on one daemon), taken in CPU seconds: the
    daemon's and the rank's per step (median over the steps), which other load on this shared
    machine changes little, unlike its wall time. Node n's work is T1 * F_n / F CPU seconds,
    F_n the Newton-Schulz FLOPs that the ownership plan
    (muon_offload.multinode_plan.ownership_plan(spec, N)) gives node n, F their sum. The N
    daemons compute at the same time on this machine's 2 CPUs
    (shared with whatever else runs on it), so none gets a whole CPU. Before and after each
    node count a calibration job on each daemon (one 3072x1024 matrix, single rank, no network)
    measures s(k), the share of a CPU that a computing daemon gets (its CPU seconds over its
    steps' wall time) while k daemons compute at once, k = 1..N; the model takes the mean of
    the two. compute(N) is when the last node finishes when each of the k nodes still
    computing progresses at s(k) (processor sharing: a node that finishes early leaves the CPUs
    to the others). On C idle cores s(k) = min(1, C/k), which is the usual oversubscription
    factor max(1, k/C); measuring it keeps the model honest on a machine whose CPUs are shared
    (on an idle one here s(1..4) = 0.99, 0.97, 0.69, 0.49). The rank's own work in T1 (copying
    gradients and applying updates) shrinks with its partition as the daemon's does, so it is
    scaled with it. With several ranks per node, T1 leaves out the CPU of the 1-node step's own
    collectives (between the node's ranks), which network(1) counts.
  network(N). The bytes: per step the busiest node link carries one way 2 * max over nodes of
    max(E_n, I_n) in the all-to-alls (E_n, I_n: what node n's ranks send to and receive from
    other nodes in the forward one, from the routing's split sizes; the inverse swaps them; with
    one rank per node 2 E_n is opt.bytes_per_step() = opt.expected_bytes(), shown per rank in
    the table) and (W-1) * P * e in the ZeRO all-gather (a ring of W-1 rounds of one padded
    partition of P elements of e bytes). The rate: the link's is measured by bulk TCP (python
    sockets, namespace 0 <-> 1, both directions at once, 1.5 s of --rate-mbit). gloo's
    collectives do not reach it, so the rate they reach is measured as well: the step's three
    exchanges through the same library calls with the same sizes (the routed pieces gathered
    and sent, the results received and scattered back, the ZeRO all-gather into the
    parameters), timed alone over the same world and links after an idle pause with no daemon
    computing, once after each measured step (median of the slowest rank). network(N) =
    bytes / that rate, i.e. those times. Why gloo falls short (as its protocol and the sockets'
    statistics during a transfer show): its TCP transport sends a "ready to receive" notice on
    the same connection, queued behind its own outgoing data; when one rank of a pair starts its
    send first, the peer learns that it may send only after that whole message, and the two
    directions of the pair go one after the other. With 2 nodes an all-to-all then runs at half
    the link rate (or at the full rate when both ranks start together), the all-gather at about
    60 %; with 4 nodes (three peers share a link) both at about 80-90 %.
  The README's model is modelled@link(N) = compute(N) + bytes / (the bulk TCP link rate); the
  table also shows modelled(N) = compute(N) + network(N) with the network at the rate gloo
  reaches (its ratio: what is left once gloo's shortfall is known). The last line is
  `result: multinode ratio=<measured / modelled@link at the largest N> target=1.2`: the README's
  model, with the link rate and the compute measured in the same run.

What the ratio tests: that a multi-node step costs what its busiest node's share of the compute
(under the CPU contention) and its data exchanges cost and nothing more: no hidden waits or
interference between the routing, the two-phase commit and the daemons, and a daemon's work
divided as the plan says (the daemons' CPU seconds per step, in --json: the busiest node's is
the 1-node daemon's times its FLOPs share, within about 5 %). At N = 1 it checks the conversion
from CPU seconds to wall time.

Not modelled: the small collectives of a step (barrier, agreement, commit check: a few on a
veth, well under 10 ms) and the commit itself; and that inside a step the exchanges do not
start together: the ZeRO all-gather, which the ranks reach at different times after applying
their updates, often takes 0.1-0.6 s longer in the step than alone (each round of its ring
waits for the slowest rank; work the daemons do after their step may compete for the CPUs then
too). That is most of what is left between measured and modelled (ratios at 4 nodes of
0.93-1.10 in runs on an otherwise idle machine). Caveats: this machine's CPUs are shared, and
when other work starts or stops during a run the ratio moves by 10-20 %; on 2 nodes an
all-to-all takes the whole or half the link rate depending on which rank sends first (see
above), so it varies from step to step.

Exit codes: 0 the run completed (target met or not), 1 an
error, 77 skipped (not root, no network namespaces, veth, bridge or tbf here, or muond not
built), 130 interrupted.
"""
import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
# What runs inside the node namespaces (its hidden sub-commands).
PROCS = os.path.join(HERE, "multinode_bench_procs.py")
PYTHON = "/usr/bin/python3"
TARGET = 1.2
SKIP = 77

sys.path.insert(0, HERE)
from multinode_bench_model import (collective_cpu_seconds, median_step, model,  # noqa: E402
                                   step_cpu_seconds)
from multinode_bench_procs import (CALIBRATION_STEPS, import_client, layer_shapes,  # noqa: E402
                                   process_cpu_seconds)
from multinode_netns import IFNAME, PREFIX, Skip, Topology, remove_leftovers, run  # noqa: E402


class Bench:
    def __init__(self, args):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix=f"{PREFIX}-{os.getpid()}-")
        self.procs = []      # every child still to be stopped (Popen)
        self.daemons = []    # (Popen, address, log path) per node
        self.calibration = []  # calibration clients (Popen)
        self.topo = None

    # ----- clean-up -----

    def cleanup(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except OSError:
                    pass
        deadline = time.time() + 15
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        if self.topo is not None:
            self.topo.destroy()
            self.topo = None
        if self.tmp and os.path.isdir(self.tmp):
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = None

    def spawn(self, cmd, **kw):
        p = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def in_ns(self, n, cmd):
        return ["ip", "netns", "exec", self.topo.ns[n], *cmd]

    # ----- measurements -----

    def measure_link(self):
        """Bulk TCP between namespaces 0 and 1, both directions at once: bytes/s each way."""
        rate = self.args.rate_mbit * 1e6 / 8
        nbytes = int(max(4 << 20, rate * 1.5))
        port = 5201
        receivers = []
        for dst in (1, 0):
            p = self.spawn(self.in_ns(dst, [PYTHON, PROCS, "--_tcp-recv", self.topo.ip[dst],
                                            str(port)]), stdout=subprocess.PIPE, text=True)
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("the TCP receiver did not start")
            receivers.append(p)
        senders = [self.spawn(self.in_ns(src, [PYTHON, PROCS, "--_tcp-send", self.topo.ip[dst],
                                               str(port), str(nbytes)]))
                   for src, dst in ((0, 1), (1, 0))]
        rates = []
        for p in receivers:
            out = json.loads(p.stdout.readline())
            p.wait(timeout=60)
            if out["bytes"] != nbytes:
                raise RuntimeError(f"TCP transfer: {out['bytes']} of {nbytes} bytes arrived")
            rates.append(out["bytes"] / out["seconds"])
        for p in senders:
            if p.wait(timeout=60) != 0:
                raise RuntimeError("the TCP sender failed")
        return {"bytes_per_second": statistics.mean(rates), "directions": rates,
                "transfer_bytes": nbytes}

    def start_daemons(self, mo):
        muond = self.args.muond
        for n, ns in enumerate(self.topo.ns):
            d = os.path.join(self.tmp, f"node{n}")
            os.makedirs(d)
            address = f"unix://{d}/muond.sock"
            log = os.path.join(d, "muond.log")
            with open(log, "ab") as logf:
                p = self.spawn(self.in_ns(n, [muond, "--listen", address, "--state-dir",
                                              os.path.join(d, "state"), "--threads", "1",
                                              "--backend", "cpu", "--metrics-address", "off"]),
                               stderr=logf, env=dict(os.environ, OMP_NUM_THREADS="1"))
            self.daemons.append((p, address, log))
        for p, address, log in self.daemons:
            deadline = time.time() + 30
            while True:
                try:
                    with mo.Client(address) as c:
                        c.health(0.5)
                    break
                except mo.MuondError:
                    if p.poll() is not None or time.time() > deadline:
                        with open(log) as f:
                            raise RuntimeError(f"muond at {address} did not start:\n{f.read()}")
                    time.sleep(0.1)

    def start_calibration(self, kmax):
        """One calibration client (a single-rank job of one CALIBRATION_SHAPE matrix) on each of
        daemons 0..kmax-1, idle until measure_contention."""
        self.calibration = []
        for n in range(kmax):
            p = self.spawn([PYTHON, PROCS, "--_calibrate", self.daemons[n][1], f"calib{n}",
                            self.args.dtype],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
            self.calibration.append(p)
        for p in self.calibration:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a calibration client failed")

    def measure_contention(self, kmax):
        """For k = 1..kmax daemons computing at once (a calibration job each): s(k), the share
        of one CPU a computing daemon gets (its CPU seconds over the wall time of its steps; the
        median over the k daemons), and c(k), the median wall time of a calibration step."""
        out = {}
        for k in range(1, kmax + 1):
            clients = self.calibration[:k]
            pids = [self.daemons[n][0].pid for n in range(k)]
            before = [process_cpu_seconds(pid) for pid in pids]
            for p in clients:
                p.stdin.write(f"go {CALIBRATION_STEPS}\n")
                p.stdin.flush()
            times = [json.loads(p.stdout.readline()) for p in clients]
            cpu = [process_cpu_seconds(pid) - b for pid, b in zip(pids, before)]
            out[k] = {"share": statistics.median(c / sum(t) for c, t in zip(cpu, times)),
                      "step": statistics.median(x for t in times for x in t)}
        return out

    def stop_calibration(self):
        for p in self.calibration:
            p.stdin.write("quit\n")
            p.stdin.flush()
            p.wait(timeout=60)
        self.calibration = []

    def run_world(self, nodes):
        L = self.args.ranks_per_node
        world = nodes * L
        node_map = [q // L for q in range(world)]
        out = os.path.join(self.tmp, f"out-{nodes}")
        os.makedirs(out)
        cfg = {"world": world, "node_map": node_map,
               "addresses": [a for _, a, _ in self.daemons[:nodes]],
               "daemon_pids": [p.pid for p, _, _ in self.daemons[:nodes]],
               "master_addr": self.topo.ip[0], "port": 29400 + nodes, "out": out,
               "job_id": f"bench-n{nodes}", "layers": self.args.layers,
               "dtype": self.args.dtype, "steps": self.args.steps,
               "warmup": self.args.warmup, "idle": 0.3}
        path = os.path.join(self.tmp, f"world-{nodes}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME)
        procs = [self.spawn(self.in_ns(node_map[r], [PYTHON, PROCS, "--_rank", path, str(r)]),
                            env=env) for r in range(world)]
        # Wait for every rank; once one has failed, the others get 10 s to report before they
        # are killed (they would otherwise wait in a collective for gloo's timeout).
        deadline, failed_at = time.time() + 600, None
        while any(p.poll() is None for p in procs):
            now = time.time()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + 10):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                if failed_at is None:
                    raise RuntimeError(f"{nodes} nodes: the ranks did not finish in 600 s")
                break
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
        results = []
        for r in range(world):
            try:
                with open(os.path.join(out, f"rank{r}.json")) as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                results.append({"exception": f"no result (exit code {codes[r]})"})
        errors = [f"rank {r}: {res['exception']}\n{res.get('trace', '')}"
                  for r, res in enumerate(results) if "exception" in res]
        if errors:
            raise RuntimeError(f"{nodes} nodes:\n" + "\n".join(errors))
        return results


def drive(args, bench):
    mo = import_client()
    counts = sorted(set(args.nodes) | {1})
    nmax = max(counts)
    bench.topo = Topology(max(2, nmax), args.rate_mbit)
    try:
        bench.topo.create()
    except RuntimeError as e:
        raise Skip(f"could not build the emulated network (veth, bridge or tbf): {e}")
    link = bench.measure_link()
    print(f"link: tbf {args.rate_mbit:g} Mbit/s each way; bulk TCP measured "
          f"{link['bytes_per_second'] / 1e6:.2f} MB/s (both directions at once: "
          f"{', '.join(f'{r / 1e6:.2f}' for r in link['directions'])} MB/s, "
          f"{link['transfer_bytes'] / 1e6:.1f} MB each)", flush=True)
    bench.start_daemons(mo)
    bench.start_calibration(nmax)
    rows = []
    t1_cpu = None
    for nodes in counts:
        t0 = time.time()
        before = bench.measure_contention(nodes)
        results = bench.run_world(nodes)
        after = bench.measure_contention(nodes)
        # the machine's load may change during the run: the mean of before and after
        contention = {k: {x: (before[k][x] + after[k][x]) / 2 for x in before[k]}
                      for k in before}
        measured, phases = median_step(results)
        if nodes == 1:
            # less the CPU of its own collectives (with several ranks on the node): those are
            # in network(1)
            t1_cpu = step_cpu_seconds(results) - collective_cpu_seconds(results)
            print(f"  1-node step: {measured:.3f} s, {t1_cpu:.3f} CPU s (daemon and rank)",
                  flush=True)
        m = model(nodes, results, t1_cpu, contention, link)
        row = {"nodes": nodes, "ranks": len(results), "measured": measured, **m,
               "phases": phases,
               "bytes_per_rank": max(res["bytes_per_step"][0] for res in results),
               "expected_bytes_per_rank": max(res["expected_bytes"][0] for res in results),
               "link_bytes_per_second": link["bytes_per_second"],
               "elements": results[0]["elements"],
               "tensors_per_node": results[0]["tensors_per_node"],
               "rank_steps": [res["steps"] for res in results],
               "rank_collectives": [res["collectives"] for res in results]}
        row["ratio"] = measured / row["modelled"]
        row["ratio_link"] = measured / row["modelled_link"]
        row["contention"] = {"before": before, "after": after}
        if any(res["bytes_per_step"] != res["expected_bytes"] for res in results):
            print(f"  warning: {nodes} nodes: bytes_per_step() differs from expected_bytes() "
                  f"on some rank: {[res['bytes_per_step'] for res in results]} vs "
                  f"{[res['expected_bytes'] for res in results]}", flush=True)
        rows.append(row)
        print("  CPU share of a computing daemon, k daemons at once, before / after (one "
              "3072x1024 Newton-Schulz each): " +
              ", ".join(f"k={k} s={before[k]['share']:.3f}/{after[k]['share']:.3f}"
                        for k in before), flush=True)
        alone = m["collectives_alone"]
        print(f"  {nodes} node(s), {time.time() - t0:.0f} s: in the step (slowest rank, median) "
              + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()) +
              (" s; alone " + ", ".join(f"{k} {v:.3f}" for k, v in alone.items()) + " s"
               if alone else " s") +
              f"; plan max/mean FLOPs {m['max_mean_flops']:.3f}", flush=True)
    bench.stop_calibration()
    return rows, link


def mb(x):
    return "-" if not x else f"{x / 1e6:.1f}"


def print_table(rows, args):
    print()
    print(f"{rows[0]['elements']:,} Muon elements ({args.layers} Qwen3-0.6B-like layer(s)), "
          f"{args.dtype}, update mode, ZeRO stage 2, {args.ranks_per_node} rank(s) per node, "
          f"muond --threads 1, {os.cpu_count()} CPUs, tbf {args.rate_mbit:g} Mbit/s")
    print(f"{'nodes':>5} {'ranks':>5} {'measured':>8} {'modelled':>8} {'compute':>7} "
          f"{'network':>7} {'a2a':>6} {'gather':>6} {'bytes/rank/step':>15} {'link':>6} "
          f"{'a2a':>6} {'gather':>6} {'@link':>8} {'ratio':>6} {'ratio@link':>10}")
    print(f"{'':>5} {'':>5} {'s':>8} {'s':>8} {'s':>7} {'s':>7} {'s':>6} {'s':>6} {'':>15} "
          f"{'MB/s':>6} {'MB/s':>6} {'MB/s':>6} {'s':>8} {'':>6} {'':>10}")
    for r in rows:
        print(f"{r['nodes']:>5} {r['ranks']:>5} {r['measured']:>8.3f} {r['modelled']:>8.3f} "
              f"{r['compute']:>7.3f} {r['network']:>7.3f} {r['network_alltoall']:>6.3f} "
              f"{r['network_allgather']:>6.3f} {r['bytes_per_rank']:>15,} "
              f"{mb(r['link_bytes_per_second']):>6} {mb(r['gloo_rate_alltoall']):>6} "
              f"{mb(r['gloo_rate_allgather']):>6} {r['modelled_link']:>8.3f} "
              f"{r['ratio']:>6.3f} {r['ratio_link']:>10.3f}")
    print("measured: median step (slowest rank). modelled = compute + network. compute: the "
          "1-node step's CPU seconds x the busiest node's Newton-Schulz share, at the CPU share "
          "a computing daemon got before and after (k at once). network = a2a + gather: the step's "
          "two all-to-alls and its ZeRO all-gather, byte for byte, timed alone over the same "
          "links. "
          "bytes/rank/step: sent by the busiest rank in both all-to-alls (opt.bytes_per_step() "
          "= opt.expected_bytes()). link MB/s: bulk TCP; a2a/gather MB/s: the rate gloo's "
          "collectives reach on the busiest node link. @link: the model with the network at "
          "the bulk TCP rate (the README's model), and its ratio (the result line's).")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,2,4")
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--rate-mbit", type=float, default=400.0)
    ap.add_argument("--steps", type=int, default=5, help="measured steps per node count")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per node count")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--muond", default=os.path.join(ROOT, "build", "bin", "muond"))
    args = ap.parse_args(argv)
    try:
        args.nodes = sorted({int(x) for x in args.nodes.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--nodes: a comma-separated list of node counts, not '{args.nodes}'")
    if not args.nodes or min(args.nodes) < 1 or max(args.nodes) > 200:
        ap.error("--nodes: node counts from 1 to 200")
    if args.ranks_per_node < 1 or args.steps < 1 or args.warmup < 0 or args.layers < 1:
        ap.error("--ranks-per-node, --steps and --layers must be >= 1, --warmup >= 0")
    if args.rate_mbit <= 0:
        ap.error("--rate-mbit must be positive")
    if len(layer_shapes(args.layers)) < max(args.nodes):
        ap.error(f"{max(args.nodes)} nodes need at least as many Muon matrices "
                 f"({len(layer_shapes(args.layers))} in {args.layers} layer(s))")
    return args


def preflight(args):
    if os.geteuid() != 0:
        raise Skip("network namespaces, veth pairs and tc need root (run it as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise Skip(f"'{tool}' (iproute2) is not installed")
    if run(["ip", "netns", "list"], check=False).returncode != 0:
        raise Skip("'ip netns' is unavailable here")
    probe = f"{PREFIX}-{os.getpid()}-probe"
    p = run(["ip", "netns", "add", probe], check=False)
    if p.returncode != 0:
        raise Skip(f"cannot create a network namespace: {p.stderr.strip()}")
    run(["ip", "netns", "del", probe], check=False)
    if not os.access(args.muond, os.X_OK):
        raise Skip(f"muond is not built ({args.muond}); build the project first")


def main(argv):
    args = parse_args(argv)
    bench = None

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    try:
        preflight(args)
        remove_leftovers()
        bench = Bench(args)
        atexit.register(bench.cleanup)
        start = time.time()
        rows, link = drive(args, bench)
    except Skip as e:
        print(f"SKIP: {e}", file=sys.stderr)
        return SKIP
    except KeyboardInterrupt as e:
        print(f"interrupted ({e or 'SIGINT'}); cleaned up", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if bench is not None:
            # signals now would interrupt the clean-up itself
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(s, signal.SIG_IGN)
            bench.cleanup()
    print_table(rows, args)
    last = max(rows, key=lambda r: r["nodes"] if r["nodes"] in args.nodes else 0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "link": link,
                       "args": {k: v for k, v in vars(args).items()},
                       "cpus": os.cpu_count(), "seconds": time.time() - start,
                       "ratio": last["ratio_link"], "ratio_gloo_rate": last["ratio"],
                       "target": TARGET}, f, indent=1)
    print(f"result: multinode ratio={last['ratio_link']:.3f} target={TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
