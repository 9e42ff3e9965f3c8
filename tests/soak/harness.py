"""What the soak (tests/soak/soak.py) and chaos (tests/chaos/chaos.py) runs share: a muond on a
private state directory (start, SIGTERM, SIGKILL, private memory and descriptors, log errors),
rank processes (rank_worker.py) driven by JSON lines, the two jobs with random shapes drawn from a
seed, and the comparison of a job's checkpointed state bit for bit.
"""
import json
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
PY = "/usr/bin/python3"
WORKER = os.path.join(HERE, "rank_worker.py")
WORLD = 4


class HarnessError(RuntimeError):
    """A failure of the run (a hang, an unexpected answer, a daemon that would not start)."""


def log(msg):
    print(msg, flush=True)


def stage_binaries(muond, workdir):
    """Copies muond and the client library into `workdir` and returns the daemon's copy: a build
    in the same tree relinking them during a run (a restart, a respawned rank) cannot break it.
    The rank processes and this one load the copy of the library ($MUOND_CLIENT_LIB)."""
    import shutil
    lib = os.environ.get("MUOND_CLIENT_LIB") or os.path.join(ROOT, "build", "lib",
                                                             "libmuond_client.so")
    for path in (muond, lib):
        if not os.access(path, os.R_OK):
            raise HarnessError(f"{path}: not found (build the muond and muond_client_shared "
                               "targets)")
    daemon = os.path.join(workdir, "muond")
    shutil.copy2(muond, daemon)
    os.environ["MUOND_CLIENT_LIB"] = os.path.join(workdir, "libmuond_client.so")
    shutil.copy2(lib, os.environ["MUOND_CLIENT_LIB"])
    return daemon


# ----- the daemon -----

class Daemon:
    """muond on `workdir`/muond.sock with state in `workdir`/state; its log is appended to
    `workdir`/muond.log across restarts. fault: $MUOND_TEST_CHECKPOINT_FAULT for this start."""

    running = []  # every Daemon started, for kill_daemons()

    def __init__(self, muond, workdir, metrics=True):
        self.muond = muond
        self.workdir = workdir
        self.address = f"unix://{workdir}/muond.sock"
        self.state = os.path.join(workdir, "state")
        self.log_path = os.path.join(workdir, "muond.log")
        self.metrics = metrics
        self.metrics_address = None
        self.proc = None
        self.starts = 0

    def start(self, fault=None, extra=(), hooks=None):
        """hooks: more test-hook variables for this start (e.g. MUOND_TEST_COMMIT_HOLD_MS)."""
        import muon_offload as mo
        env = dict(os.environ)
        env.pop("MUOND_TEST_CHECKPOINT_FAULT", None)
        env.pop("MUOND_TEST_COMMIT_HOLD_MS", None)
        if fault:
            env["MUOND_TEST_CHECKPOINT_FAULT"] = fault
        env.update(hooks or {})
        offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        logf = open(self.log_path, "ab")
        args = [self.muond, "--listen", self.address, "--state-dir", self.state, "--threads", "1",
                "--metrics-address", "127.0.0.1:0" if self.metrics else "off", *extra]
        self.proc = subprocess.Popen(args, stdout=logf, stderr=logf, env=env)
        Daemon.running.append(self)
        logf.close()
        self.starts += 1
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                raise HarnessError(f"muond exited {self.proc.returncode} at start:\n"
                                   f"{self.log_tail(offset)}")
            try:
                with mo.Client(self.address) as c:
                    c.health(0.5)
                break
            except mo.MuondError:
                if time.time() > deadline:
                    raise HarnessError(f"muond not healthy after 60 s:\n{self.log_tail(offset)}")
                time.sleep(0.05)
        while self.metrics:  # logged once the endpoint is up, after the API serves
            with open(self.log_path, errors="replace") as f:
                f.seek(offset)
                m = re.findall(r"metrics on http://(127\.0\.0\.1:\d+)/metrics", f.read())
            if m:
                self.metrics_address = m[-1]
                break
            if time.time() > deadline or self.proc.poll() is not None:
                raise HarnessError(f"muond logged no metrics address:\n{self.log_tail(offset)}")
            time.sleep(0.05)

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self):
        """SIGTERM; returns the exit code (0 expected)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise HarnessError("muond did not exit within 120 s of SIGTERM")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def private_bytes(self):
        """RssAnon of /proc/PID/status: the daemon's own (anonymous) resident memory.

        Not Private_Clean + Private_Dirty: a library's code pages count as private while no other
        process maps them and as shared while one does, so that sum moved by ~60 MiB when another
        muond (a concurrent test) started or exited (libcublasLt alone is 50 MiB of code)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        raise HarnessError(f"no RssAnon in /proc/{self.pid}/status")

    def fd_count(self):
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def thread_count(self):
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
        return -1

    def scrape(self):
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            if r.status != 200:
                raise HarnessError(f"/metrics answered {r.status}")
            return r.read()

    def log_tail(self, offset=0, lines=30):
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            return "".join(f.readlines()[-lines:])

    def log_errors(self):
        """Lines logged at ERROR (or FATAL) level."""
        out = []
        with open(self.log_path, errors="replace") as f:
            for line in f:
                parts = line.split(None, 2)
                if len(parts) >= 2 and parts[1] in ("E", "F"):
                    out.append(line.rstrip())
        return out


def kill_daemons():
    """SIGKILL every daemon still running (a run that failed or was skipped half way)."""
    for d in Daemon.running:
        if d.alive():
            d.kill()


def clean_up(name, workdir, jobs, keep):
    """The end of a run, passed or not: SIGKILL the daemons still running, stop the jobs' rank
    workers, and remove the work directory unless `keep` (a failed run, or --keep)."""
    kill_daemons()
    for j in jobs:
        j.quit()
    if keep:
        log(f"{name}: work directory kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


# ----- rank processes -----

class Worker:
    """rank_worker.py for one rank of one job."""

    def __init__(self, spec_path, rank, transport, seed, logdir):
        self.args = [PY, WORKER, "--spec", spec_path, "--rank", str(rank), "--transport",
                     transport, "--seed", str(seed)]
        self.rank = rank
        self.err_path = os.path.join(logdir, f"{os.path.basename(spec_path)}.rank{rank}.log")
        self.proc = None
        self.spawn()

    def spawn(self):
        err = open(self.err_path, "ab")
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=err)
        err.close()
        self.buf = b""
        self.ready = False

    def send(self, cmd):
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout=120):
        deadline = time.time() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0:
                raise HarnessError(f"rank {self.rank} ({self.args[3]}) answered nothing in "
                                   f"{timeout} s")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise HarnessError(f"rank {self.rank} ({self.args[3]}) exited "
                                       f"{self.proc.wait()}; see {self.err_path}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        out = json.loads(line)
        if out.get("ready"):
            self.ready = True
            return self.recv(max(1, deadline - time.time()))
        return out

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def quit(self):
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


# ----- jobs -----

SHAPE_DIMS = [16, 24, 32, 48, 64, 96, 128, 160, 192, 256]
MUON = {"momentum": 0.95, "nesterov": True, "ns_method": "standard", "ns_steps": 5,
        "compute_dtype": "float32", "scale_mode": "original"}


def random_specs(rng, workdir, tag, extra=None, wide=False):
    """Two jobs of random shapes: an update-mode job (ZeRO 2, its ranks over shared memory) and an
    apply-mode job (ZeRO 1, Muon matrices and AdamW tensors, initial weights from init_from, its
    ranks over gRPC). wide: the apply job also has a 64 x 65536 matrix, so that each rank's
    gradient and result travel in more than one 4 MiB gRPC chunk. Returns [(spec, transport,
    seed)]."""
    extra = extra or {}

    def matrices(n):
        out = []
        for i in range(n):
            r, c = rng.choice(SHAPE_DIMS), rng.choice(SHAPE_DIMS)
            e = {"name": f"layer{i}.w", "shape": [r, c]}
            if rng.random() < 0.25:
                e["shape"] = [2, r, c]  # experts
            elif r % 2 == 0 and rng.random() < 0.3:
                e["num_heads"] = 2
            out.append(e)
        return out

    update = {"job_id": f"{tag}-shm-update", "world_size": WORLD, "zero_stage": 2,
              "muon": dict(MUON, ns_method=rng.choice(["standard", "polar_express"])),
              "matrices": matrices(rng.randint(4, 8)), **extra}
    tensors = [dict(m, optimizer="muon", group="muon") for m in matrices(rng.randint(3, 6))]
    if wide:
        tensors.append({"name": "wide.w", "shape": [64, 65536], "optimizer": "muon",
                        "group": "muon"})
    tensors += [{"name": "embed.w", "shape": [rng.choice(SHAPE_DIMS), 32], "optimizer": "adamw",
                 "group": "adamw"},
                {"name": "norm.w", "shape": [rng.choice(SHAPE_DIMS)], "optimizer": "adamw",
                 "group": "adamw"},
                {"name": "head.b", "shape": [rng.randint(1, 50)], "optimizer": "adamw",
                 "group": "adamw"}]
    init = os.path.join(workdir, f"{tag}-init.safetensors")
    write_init(init, tensors, rng.randrange(1 << 30))
    apply = {"job_id": f"{tag}-grpc-apply", "mode": "apply", "world_size": WORLD,
             "zero_stage": 1, "muon": dict(MUON), "tensors": tensors,
             "groups": [{"name": "muon", "lr": 0.02, "weight_decay": 0.1},
                        {"name": "adamw", "lr": 0.01, "weight_decay": 0.01}],
             "adamw": {"betas": [0.9, 0.95], "eps": 1e-8}, "init_from": init, **extra}
    return [(update, "shm", rng.randrange(1 << 30)), (apply, "grpc", rng.randrange(1 << 30))]


def write_init(path, tensors, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    header, blobs, offset = {}, [], 0
    for t in tensors:
        data = (torch.randn(t["shape"], generator=g) * 0.1).numpy().tobytes()
        header[t["name"]] = {"dtype": "F32", "shape": t["shape"],
                             "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    os.chmod(path, 0o644)


def shapes_text(spec):
    ts = spec.get("tensors", spec.get("matrices"))
    return " ".join("x".join(map(str, t["shape"])) for t in ts)


class Job:
    """One job's rank processes and what they returned: results[t] = the ranks' hashes of step t
    (the first time it ran); a replay must give the same."""

    def __init__(self, spec, transport, seed, workdir):
        self.spec = spec
        self.id = spec["job_id"]
        self.transport = transport
        self.seed = seed
        self.spec_path = os.path.join(workdir, self.id + ".json")
        with open(self.spec_path, "w") as f:
            json.dump(spec, f)
        self.workers = [Worker(self.spec_path, r, transport, seed, workdir) for r in range(WORLD)]
        self.token = None
        self.next = 0  # the next step to run
        self.results = {}
        self.replay_mismatches = 0

    def create(self, client):
        self.token = client.create_job(self.spec)
        self.next = 0

    def attach(self, address):
        for w in self.workers:
            w.send({"op": "attach", "address": address, "token": self.token})
        answers = [w.recv() for w in self.workers]
        bad = [a for a in answers if not a["ok"]]
        if bad:
            raise HarnessError(f"job {self.id}: attach failed: {bad[0]}")
        steps = {a["next_step"] for a in answers}
        if len(steps) != 1:
            raise HarnessError(f"job {self.id}: ranks attached at different steps {steps}")
        return steps.pop()

    def detach(self):
        for w in self.workers:
            if w.proc.poll() is None:
                w.send({"op": "detach"})
        for w in self.workers:
            if w.proc.poll() is None:
                w.recv()

    def send_step(self, t, stall=None, die=None):
        """stall: {rank: seconds}; die: {rank: point} (rank_worker.py)."""
        for w in self.workers:
            cmd = {"op": "step", "step": t, "stall": (stall or {}).get(w.rank, 0)}
            if w.rank in (die or {}):
                cmd["die"] = die[w.rank]
            w.send(cmd)

    def collect(self, t, skip=()):
        """The answers of step t (None for ranks in `skip`)."""
        return [None if w.rank in skip else w.recv() for w in self.workers]

    def record(self, t, answers):
        """Checks and keeps a successful step's hashes; returns False when they differ from an
        earlier run of the same step."""
        hashes = tuple(a["hash"] for a in answers)
        old = self.results.setdefault(t, hashes)
        if old != hashes:
            self.replay_mismatches += 1
            return False
        return True

    def run_step(self, t):
        self.send_step(t)
        answers = self.collect(t)
        bad = [(r, a) for r, a in enumerate(answers) if not a["ok"]]
        if bad:
            raise HarnessError(f"job {self.id} step {t}: rank {bad[0][0]}: {bad[0][1]}")
        self.record(t, answers)
        self.next = t + 1
        return answers

    def quit(self):
        for w in self.workers:
            w.quit()


def run_steps(jobs, targets):
    """Steps every job from its `next` to its target, the jobs side by side."""
    while any(j.next < targets[j.id] for j in jobs):
        live = [j for j in jobs if j.next < targets[j.id]]
        for j in live:
            j.send_step(j.next)
        for j in live:
            answers = j.collect(j.next)
            bad = [(r, a) for r, a in enumerate(answers) if not a["ok"]]
            if bad:
                raise HarnessError(f"job {j.id} step {j.next}: rank {bad[0][0]}: {bad[0][1]}")
            j.record(j.next, answers)
            j.next += 1


# ----- checkpointed state -----

def generation_dir(state_dir, job_id, generation):
    return os.path.join(state_dir, "jobs", job_id, "checkpoints", f"gen-{generation:012d}")


def read_tensors(gen_dir):
    """{file/tensor: (dtype, shape, bytes)} of every safetensors file of a generation."""
    out = {}
    for name in sorted(os.listdir(gen_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(gen_dir, name), "rb") as f:
            raw = f.read()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        for t, info in header.items():
            if t == "__metadata__":
                continue
            b, e = info["data_offsets"]
            out[f"{name}/{t}"] = (info["dtype"], tuple(info["shape"]), raw[8 + n + b:8 + n + e])
    return out


def bits_differing(a, b):
    """Bits that differ between two states (read_tensors); a tensor missing on one side or of
    another shape counts all its bits."""
    import numpy as np
    lost = 0
    for key in set(a) | set(b):
        if key not in a or key not in b or a[key][:2] != b[key][:2]:
            lost += 8 * len((a.get(key) or b.get(key))[2])
            continue
        x = np.frombuffer(a[key][2], dtype=np.uint8)
        y = np.frombuffer(b[key][2], dtype=np.uint8)
        lost += int(np.unpackbits(np.bitwise_xor(x, y)).sum())
    return lost


def save_state(client, daemon, job):
    """Saves a generation of `job` and reads it back: (step, tensors)."""
    gen, step = client.checkpoint_save(job.id, job.token)
    return step, read_tensors(generation_dir(daemon.state, job.id, gen))


def mib(n):
    return n / (1 << 20)


def seed_from(arg):
    return arg if arg is not None else random.SystemRandom().randrange(1 << 31)
