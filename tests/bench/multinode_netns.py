"""The emulated network of multinode_netns_bench.py (its module comment has the design): node
namespaces joined by veth pairs to a bridge in a switch namespace, tbf on both ends of every
link, and the clean-up of what a run (or a dead earlier run) left. Needs root, ip and tc.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

PREFIX = "muondbench"
IFNAME = "mbeth"
SUBNET = "10.200.0"
# The driver's file name: a namespace muondbench-<pid>-* belongs to a live run while that pid's
# command line names it.
DRIVER = "multinode_netns_bench.py"


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
            return DRIVER.encode() in f.read()
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
