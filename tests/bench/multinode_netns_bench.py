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
    F_n the Newton-Schulz FLOPs that the ownership plan (muon_offload.ownership_plan(spec, N))
    gives node n, F their sum. The N daemons compute at the same time on this machine's 2 CPUs
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
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
SCRIPT = os.path.abspath(__file__)
PYTHON = "/usr/bin/python3"
PREFIX = "muondbench"
IFNAME = "mbeth"
SUBNET = "10.200.0"
TARGET = 1.2
SKIP = 77
# Qwen3-0.6B-like dimensions: hidden, query (16 heads of 128), key/value (8 heads of 128), MLP.
HIDDEN, Q_DIM, KV_DIM, MLP_DIM = 1024, 2048, 1024, 3072
CALIBRATION_SHAPE = (MLP_DIM, HIDDEN)
CALIBRATION_STEPS = 3


def layer_shapes(layers):
    out = []
    for layer in range(layers):
        p = f"layers.{layer}."
        out += [(p + "q", (Q_DIM, HIDDEN)), (p + "k", (KV_DIM, HIDDEN)),
                (p + "v", (KV_DIM, HIDDEN)), (p + "o", (HIDDEN, Q_DIM)),
                (p + "gate", (MLP_DIM, HIDDEN)), (p + "up", (MLP_DIM, HIDDEN)),
                (p + "down", (HIDDEN, MLP_DIM))]
    return out


def import_client():
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    import muon_offload
    return muon_offload


# ----------------------------------------------------------------------------------------------
# Helper processes (run inside the namespaces by the driver; hidden sub-commands)
# ----------------------------------------------------------------------------------------------

def tcp_receive(host, port):
    """Accepts one connection, reads to EOF; prints {"bytes", "seconds"} (first byte to EOF)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    total, first = 0, None
    buf = bytearray(1 << 20)
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        if first is None:
            first = time.perf_counter()
        total += n
    end = time.perf_counter()
    print(json.dumps({"bytes": total, "seconds": end - first}), flush=True)


def tcp_send(host, port, nbytes):
    conn = socket.create_connection((host, port), timeout=60)
    chunk = b"\0" * (1 << 20)
    left = nbytes
    while left > 0:
        conn.sendall(chunk[:min(left, len(chunk))])
        left -= min(left, len(chunk))
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # the receiver closes after reading everything
    conn.close()


def calibration_client(address, job_id, dtype_name):
    """One single-rank job of one CALIBRATION_SHAPE matrix on the daemon at `address`. Protocol
    on stdin/stdout: prints "ready" after a warm-up step; each "go N" line runs N steps and
    prints their times (JSON list); "quit" deletes the job."""
    import torch
    mo = import_client()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    w = torch.nn.Parameter(torch.randn(CALIBRATION_SHAPE, generator=g).to(dtype))
    grad = torch.randn(CALIBRATION_SHAPE, generator=g).to(dtype)
    opt = mo.MuonWithAuxAdam([dict(params=[("w", w)], use_muon=True, lr=0.02,
                                   weight_decay=0.01)],
                             address=address, job_id=job_id, transport="shm", stream=False)
    w.grad = grad
    opt.step()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        times = []
        for _ in range(int(cmd[1])):
            w.grad = grad
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        print(json.dumps(times), flush=True)
    opt.close(delete_job=True)


def rank_main(cfg_path, rank):
    """One rank of the gloo world (inside its node's namespace): writes OUT/rank<R>.json."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    out = os.path.join(cfg["out"], f"rank{rank}.json")
    try:
        result = run_rank(cfg, rank)
    except Exception as e:  # reported to the driver, then the rank fails
        result = {"exception": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)
    sys.exit(0 if "exception" not in result else 1)


def run_rank(cfg, rank):
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    mo = import_client()
    import muon_offload.optim as optim_module

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = cfg["master_addr"]
    os.environ["MASTER_PORT"] = str(cfg["port"])
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world"],
                            timeout=timedelta(seconds=300))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["dtype"]]
    node_of = cfg["node_map"]
    g = torch.Generator().manual_seed(1234)  # the same weights on every rank
    params = [(n, torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype)))
              for n, s in layer_shapes(cfg["layers"])]
    g.manual_seed(100 + rank)  # each rank's own (already reduced) gradients
    grads = [torch.randn(p.shape, generator=g).to(dtype) for _, p in params]
    opt = mo.MultiNodeMuonWithAuxAdam(
        [dict(params=params, use_muon=True, lr=0.02, weight_decay=0.01)],
        node_map=node_of, address=cfg["addresses"][node_of[rank]], zero_stage=2,
        mode="update", transport="shm", job_id=cfg["job_id"], reduce_gradients=False)

    # Phase timers (instrumentation only: the same calls, timed).
    phases = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    real_a2a = opt._all_to_all
    opt._all_to_all = lambda out, inp, forward: timed(
        "alltoall_forward" if forward else "alltoall_inverse", real_a2a)(out, inp, forward)
    opt.session.step_in_place = timed("daemon_step", opt.session.step_in_place)
    optim_module.all_gather_partitions = timed("zero_allgather",
                                               optim_module.all_gather_partitions)

    daemon_pid = cfg["daemon_pids"][node_of[rank]]
    # The step's data exchanges alone, one repetition after each measured step (so that both
    # see the same conditions on the machine).
    exchanges = standalone_collectives(cfg, opt, real_a2a, params) if cfg["world"] > 1 else None
    steps, collectives = [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        for (_, p), grad in zip(params, grads):
            p.grad = grad
        dist.barrier()
        phases.clear()
        cpu0, daemon0 = time.process_time(), process_cpu_seconds(daemon_pid)
        t0 = time.perf_counter()
        opt.step()
        total = time.perf_counter() - t0
        if i >= cfg["warmup"]:
            # CPU seconds of this rank and of its node's daemon during the step (the daemon's
            # counts every local rank's share: the same number on each of them)
            steps.append(dict(phases, total=total, rank_cpu=time.process_time() - cpu0,
                              daemon_cpu=process_cpu_seconds(daemon_pid) - daemon0))
            if exchanges is not None:
                collectives.append(exchanges())

    r = opt._routing
    e = torch.empty(0, dtype=dtype).element_size()
    bytes_per_step = list(opt.bytes_per_step())
    cross_send = sum(n for q, n in enumerate(r.send_splits) if node_of[q] != r.node)
    cross_recv = sum(n for q, n in enumerate(r.recv_splits) if node_of[q] != r.node)
    result = {"rank": rank, "node": r.node, "steps": steps, "collectives": collectives,
              "element_bytes": e,
              "bytes_per_step": bytes_per_step,
              "expected_bytes": list(opt.expected_bytes()),
              "forward_cross_node_bytes": [e * cross_send, e * cross_recv],
              "partition_buffer_elements": opt.partition.buffer_elements,
              "elements": sum(p.numel() for _, p in params)}
    if rank == 0:
        owner, flops, _ = mo.ownership_plan(opt.spec, r.nodes)
        result["node_flops"] = list(flops)
        result["tensors_per_node"] = [owner.count(n) for n in range(r.nodes)]
    opt.close(delete_job=True)
    dist.destroy_process_group()
    return result


def process_cpu_seconds(pid):
    """User + system CPU seconds of process `pid` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def standalone_collectives(cfg, opt, real_all_to_all, params):
    """Returns a function that runs the step's three data exchanges alone, over the same world
    and links, through the same library calls with the step's sizes (a collective: every rank
    calls it): the forward all-to-all (with gathering the routed pieces of the partition), the
    inverse one (with scattering the results back into partition order) and ZeRO's all-gather
    of the parameters (with copying them into the tensors). Each after an idle pause, as in a
    step where they follow the compute. It returns this rank's seconds in each, and its CPU
    seconds in the three ("cpu")."""
    import torch
    import torch.distributed as dist
    from muon_offload.zero import all_gather_partitions, copy_into_buffer
    r = opt._routing
    tensors = [p for _, p in params]
    part = torch.zeros(opt.partition.buffer_elements, dtype=opt.dtype)
    recv = torch.empty(sum(r.recv_splits), dtype=opt.dtype)
    back = torch.empty(r.send_elements, dtype=opt.dtype)
    out = torch.zeros_like(part)
    cpu = []

    def timed(fn):
        dist.barrier()
        time.sleep(cfg["idle"])
        t0, cpu0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - cpu0)
        return time.perf_counter() - t0

    def forward():
        real_all_to_all(recv, r.gather_send(part), forward=True)

    def inverse():
        real_all_to_all(back, recv, forward=False)
        r.scatter_back(back, out)

    def allgather():
        with torch.no_grad():  # as in opt.step()
            all_gather_partitions(part, opt.partitions, opt.rank, tensors, opt.process_group)

    def once():
        # the current parameters: the all-gather writes back the values they have
        copy_into_buffer(part, opt.partition, tensors)
        cpu.clear()
        rep = {"alltoall_forward": timed(forward), "alltoall_inverse": timed(inverse),
               "zero_allgather": timed(allgather)}
        rep["cpu"] = sum(cpu)
        return rep
    return once


# ----------------------------------------------------------------------------------------------
# The driver (root namespace)
# ----------------------------------------------------------------------------------------------

class Skip(Exception):
    pass


def run(cmd, check=True):
    """Runs a short command; returns its CompletedProcess; raises with its stderr on failure."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def netns_names():
    p = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def is_our_run(pid):
    """Is `pid` a live process of this script (a concurrent run that owns its namespaces)?"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.path.basename(SCRIPT).encode() in f.read()
    except OSError:
        return False


def delete_namespace(name):
    """Kills what still runs in namespace `name` (processes an earlier run of this script
    started there) and deletes it (its veth ends and bridge go with it)."""
    for pid in run(["ip", "netns", "pids", name], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    run(["ip", "netns", "del", name], check=False)


def remove_leftovers():
    """Namespaces and temporary directories of earlier runs whose process is gone (or of this
    pid: a reused one)."""
    pattern = re.compile(rf"^{PREFIX}-(\d+)-")
    stale = []
    for name in netns_names():
        m = pattern.match(name)
        if m and (int(m.group(1)) == os.getpid() or not is_our_run(int(m.group(1)))):
            stale.append(name)
    for name in stale:
        delete_namespace(name)
    for name in os.listdir(tempfile.gettempdir()):  # their temporary directories
        m = pattern.match(name)
        if m and (int(m.group(1)) == os.getpid() or not is_our_run(int(m.group(1)))):
            shutil.rmtree(os.path.join(tempfile.gettempdir(), name), ignore_errors=True)
            stale.append(name)
    if stale:
        print(f"removed what an earlier run left (namespaces, temporary directories): "
              f"{', '.join(stale)}", file=sys.stderr)


class Topology:
    """Node namespaces on a bridge in a switch namespace, every link tbf-shaped both ways."""

    def __init__(self, nodes, rate_mbit):
        tag = f"{PREFIX}-{os.getpid()}"
        self.switch = f"{tag}-sw"
        self.ns = [f"{tag}-{n}" for n in range(nodes)]
        self.ip = [f"{SUBNET}.{n + 1}" for n in range(nodes)]
        self.rate_mbit = rate_mbit
        self.created = []

    def _add(self, name):
        run(["ip", "netns", "add", name])
        self.created.append(name)
        run(["ip", "-n", name, "link", "set", "lo", "up"])

    def shape(self, ns, dev):
        # burst: at least 64 KiB (a GSO packet), or 2 ms of the rate; latency bounds the queue.
        burst = max(64 * 1024, int(self.rate_mbit * 1e6 / 8 * 0.002))
        run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "20ms"])

    def create(self):
        self._add(self.switch)
        run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for n, (ns, ip) in enumerate(zip(self.ns, self.ip)):
            self._add(ns)
            port = f"port{n}"
            run(["ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port,
                 "netns", self.switch])
            run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", IFNAME])
            run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            self.shape(ns, IFNAME)            # what node n sends
            self.shape(self.switch, port)     # what node n receives

    def destroy(self):
        for name in reversed(self.created):
            delete_namespace(name)
        self.created = []


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
            p = self.spawn(self.in_ns(dst, [PYTHON, SCRIPT, "--_tcp-recv", self.topo.ip[dst],
                                            str(port)]), stdout=subprocess.PIPE, text=True)
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("the TCP receiver did not start")
            receivers.append(p)
        senders = [self.spawn(self.in_ns(src, [PYTHON, SCRIPT, "--_tcp-send", self.topo.ip[dst],
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
            p = self.spawn([PYTHON, SCRIPT, "--_calibrate", self.daemons[n][1], f"calib{n}",
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
        procs = [self.spawn(self.in_ns(node_map[r], [PYTHON, SCRIPT, "--_rank", path, str(r)]),
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


def median_step(results):
    """Median over the measured steps of the slowest rank's time, and the per-phase medians
    (each phase: the slowest rank's)."""
    per_step = list(zip(*[res["steps"] for res in results]))
    totals = [max(s["total"] for s in step) for step in per_step]
    names = sorted({k for step in per_step for s in step for k in s} - {"total", "rank_cpu"})
    phases = {k: statistics.median(max(s.get(k, 0.0) for s in step) for step in per_step)
              for k in names}
    return statistics.median(totals), phases


def shared_makespan(loads, speed):
    """When the last of `loads` (seconds alone) ends if the ones still running, k of them,
    each progress at speed[k] (processor sharing)."""
    left = sorted(x for x in loads if x > 0)
    t = 0.0
    while left:
        k = len(left)
        s = speed[min(k, max(speed))]
        dt = left[0] / s
        t += dt
        done = left[0]
        left = [x - done for x in left[1:]]
    return t


def collective_medians(results):
    """The standalone collectives: per repetition the slowest rank's time, median over the
    repetitions, per collective."""
    reps = list(zip(*[res["collectives"] for res in results]))
    if not reps:
        return {}
    return {k: statistics.median(max(x[k] for x in rep) for rep in reps) for k in reps[0][0]
            if k != "cpu"}


def collective_cpu_seconds(results):
    """The ranks' CPU seconds in the standalone collectives (slowest rank, median)."""
    reps = list(zip(*[res["collectives"] for res in results]))
    return statistics.median(max(x["cpu"] for x in rep) for rep in reps) if reps else 0.0


def step_cpu_seconds(results):
    """CPU seconds of one step: per measured step the busiest node's daemon plus its slowest
    rank, the median over the steps."""
    per_step = list(zip(*[res["steps"] for res in results]))
    return statistics.median(max(s["daemon_cpu"] + s["rank_cpu"] for s in step)
                             for step in per_step)


def model(nodes, results, t1_cpu, contention, link):
    rate = link["bytes_per_second"]
    rank0 = results[0]
    flops = rank0["node_flops"]
    # Node n's work: its FLOPs share of the 1-node step's CPU seconds; while k nodes compute,
    # each gets the CPU share s(k) measured around the run (the mean of before and after).
    loads = [t1_cpu * f / sum(flops) for f in flops]
    speed = {k: c["share"] for k, c in contention.items()}
    compute = shared_makespan(loads, speed)
    egress = [0] * nodes
    ingress = [0] * nodes
    for res in results:
        s, r = res["forward_cross_node_bytes"]
        egress[res["node"]] += s
        ingress[res["node"]] += r
    a2a_bytes = max(max(e, i) for e, i in zip(egress, ingress))  # one all-to-all, busiest node
    world = len(results)
    e = rank0["element_bytes"]
    allgather_bytes = (world - 1) * rank0["partition_buffer_elements"] * e if nodes > 1 else 0
    link_a2a = 2 * a2a_bytes / rate
    link_allgather = allgather_bytes / rate
    alone = collective_medians(results)
    gloo_a2a = alone.get("alltoall_forward", 0.0) + alone.get("alltoall_inverse", 0.0)
    gloo_allgather = alone.get("zero_allgather", 0.0)
    # The rate gloo's collectives reach on these links (bytes of the busiest node link / time).
    rate_a2a = 2 * a2a_bytes / gloo_a2a if gloo_a2a else None
    rate_allgather = allgather_bytes / gloo_allgather if gloo_allgather else None
    return {"compute": compute, "compute_cpu_seconds": loads, "cpu_share": speed,
            "max_mean_flops": max(flops) / (sum(flops) / len(flops)),
            "node_link_bytes_alltoall": 2 * a2a_bytes,
            "node_link_bytes_allgather": allgather_bytes,
            "network_link": link_a2a + link_allgather,
            "network_link_alltoall": link_a2a, "network_link_allgather": link_allgather,
            "modelled_link": compute + link_a2a + link_allgather,
            "network": gloo_a2a + gloo_allgather,
            "network_alltoall": gloo_a2a, "network_allgather": gloo_allgather,
            "gloo_rate_alltoall": rate_a2a, "gloo_rate_allgather": rate_allgather,
            "collectives_alone": alone,
            "modelled": compute + gloo_a2a + gloo_allgather}


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
    if argv[:1] == ["--_tcp-recv"]:
        return tcp_receive(argv[1], int(argv[2]))
    if argv[:1] == ["--_tcp-send"]:
        return tcp_send(argv[1], int(argv[2]), int(argv[3]))
    if argv[:1] == ["--_calibrate"]:
        return calibration_client(argv[1], argv[2], argv[3])
    if argv[:1] == ["--_rank"]:
        return rank_main(argv[1], int(argv[2]))

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
