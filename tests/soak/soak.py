"""The soak run (tests/soak/run.sh): two jobs of four ranks each on one muond for N steps, side by
side -- an update-mode job whose ranks use shared memory and an apply-mode job whose ranks use
gRPC, shapes drawn from a printed seed -- with a checkpoint of each job saved in the background
every few steps while the steps go on, and /metrics scraped every second.

Passes when: every rank's result of every step equals, bit for bit, that of the same job run alone
in a fresh daemon (the reference), and so does each job's final state (a checkpoint of it); the
daemon's private (anonymous) resident memory (RssAnon) grows by at most 8 MiB and its
open descriptors not at all from the end of the warm-up (a tenth of the steps, at least 20) to
the end; every scrape succeeds; the daemon logs no error and exits 0 on SIGTERM.
"""
import argparse
import os
import random
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as h  # noqa: E402
from harness import log  # noqa: E402

RSS_GROWTH_LIMIT = 8 << 20


class Scraper(threading.Thread):
    """Scrapes /metrics and samples the daemon's memory and descriptors every second; `lock` is
    held while it does, so a sample taken under it sees no scrape connection."""

    def __init__(self, daemon):
        super().__init__(daemon=True)
        self.d = daemon
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.ok = 0
        self.failed = []
        self.curve = []  # (seconds, private bytes, fds)
        self.t0 = time.time()

    def run(self):
        while not self.stopped.wait(1.0):
            with self.lock:
                try:
                    self.d.scrape()
                    self.ok += 1
                except Exception as e:  # noqa: BLE001 -- reported at the end
                    self.failed.append(repr(e))
                try:
                    self.curve.append((time.time() - self.t0, self.d.private_bytes(),
                                       self.d.fd_count()))
                except OSError:
                    pass


class Saver:
    """At most one background checkpoint save per job."""

    def __init__(self, address):
        import muon_offload as mo
        self.client = mo.Client(address)
        self.threads = {}
        self.saved = 0
        self.generations = {}  # job: [(generation, step)] of the background saves
        self.overlapped = 0  # saves during which the job committed steps
        self.errors = []

    def start(self, job):
        t = self.threads.get(job.id)
        if t is not None and t.is_alive():
            return

        def body():
            first = job.next
            try:
                gen, step = self.client.checkpoint_save(job.id, job.token)
                self.overlapped += job.next > first
                self.generations.setdefault(job.id, []).append((gen, step))
                self.saved += 1
            except Exception as e:  # noqa: BLE001 -- reported at the end
                self.errors.append(f"{job.id}: {e}")

        t = threading.Thread(target=body, daemon=True)
        self.threads[job.id] = t
        t.start()

    def wait(self):
        for t in self.threads.values():
            t.join()


def sample(daemon, scraper, saver):
    """Private bytes and fds with no save in flight, no scrape open and the heap trimmed."""
    saver.wait()
    with scraper.lock:
        time.sleep(0.5)  # the heap trimmer runs once no step is in flight
        return daemon.private_bytes(), daemon.fd_count(), daemon.thread_count()


def soak(args, workdir, jobs):
    import muon_offload as mo
    d = h.Daemon(args.muond, os.path.join(workdir, "soak"))
    os.makedirs(d.workdir)
    d.start()
    admin = mo.Client(d.address)
    for j in jobs:
        j.create(admin)
        if j.attach(d.address) != 0:
            raise h.HarnessError(f"{j.id}: a new job attached past step 0")
    scraper = Scraper(d)
    scraper.start()
    saver = Saver(d.address)
    warm = max(20, args.steps // 10)
    marks = {warm: "start", (warm + args.steps) // 2: "middle", args.steps: "end"}
    samples = {}
    t0 = time.time()
    for t in range(args.steps):
        h.run_steps(jobs, {j.id: t + 1 for j in jobs})
        if (t + 1) % args.checkpoint_every == 0:
            for j in jobs:
                saver.start(j)
        if t + 1 in marks:
            samples[marks[t + 1]] = sample(d, scraper, saver)
            rss, fds, _ = samples[marks[t + 1]]
            log(f"soak: step {t + 1}/{args.steps} ({time.time() - t0:.0f} s): "
                f"private {h.mib(rss):.1f} MiB, fds {fds}, scrapes {scraper.ok}, "
                f"saves {saver.saved}")
    scraper.stopped.set()
    scraper.join()
    saver.wait()
    finals = {j.id: h.save_state(admin, d, j) for j in jobs}
    snapshots = {j.id: [(step, h.read_tensors(h.generation_dir(d.state, j.id, gen)))
                        for gen, step in saver.generations.get(j.id, [])] for j in jobs}
    admin.close()
    saver.client.close()
    for j in jobs:
        j.detach()
    code = d.stop()
    return {"daemon": d, "code": code, "samples": samples, "scraper": scraper, "saver": saver,
            "finals": finals, "snapshots": snapshots, "seconds": time.time() - t0}


def reference(args, workdir, jobs, snapshots):
    """Each job alone in a fresh daemon, same steps; the ranks' results are checked against the
    soak's as they come (Job.record), and a generation saved between steps at each step a
    background save of the soak snapshotted against that save (copy-on-write while steps
    committed). Returns ({job: final state}, bits the background generations differ in, exit
    code, daemon)."""
    import muon_offload as mo
    d = h.Daemon(args.muond, os.path.join(workdir, "reference"), metrics=False)
    os.makedirs(d.workdir)
    d.start()
    finals = {}
    snapshot_bits = 0
    with mo.Client(d.address) as admin:
        if any(j.spec.get("checkpoint_keep", 3) < 1000 for j in jobs):
            raise h.HarnessError("the soak jobs must keep every generation")
        for j in jobs:
            j.create(admin)
            j.attach(d.address)
            for step, state in sorted(snapshots[j.id], key=lambda x: x[0]):
                h.run_steps([j], {j.id: step})
                _, ref_state = h.save_state(admin, d, j)
                snapshot_bits += h.bits_differing(state, ref_state)
            h.run_steps([j], {j.id: args.steps})
            finals[j.id] = h.save_state(admin, d, j)
            j.detach()
            admin.delete_job(j.id, j.token)
    code = d.stop()
    return finals, snapshot_bits, code, d


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int)
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between background saves (default: steps/6, at least 5)")
    p.add_argument("--muond", default=os.path.join(h.ROOT, "build", "bin", "muond"))
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    if args.steps < 30:
        p.error("--steps must be at least 30 (20 of them warm-up)")
    args.checkpoint_every = args.checkpoint_every or max(5, args.steps // 6)
    seed = h.seed_from(args.seed)
    log(f"soak: seed {seed} (rerun: tests/soak/run.sh --steps {args.steps} --seed {seed})")
    rng = random.Random(seed)
    workdir = tempfile.mkdtemp(prefix="muond-soak-")
    ok = False
    jobs = []
    try:
        args.muond = h.stage_binaries(args.muond, workdir)
        specs = h.random_specs(rng, workdir, "soak", {"checkpoint_keep": 1000})
        jobs = [h.Job(spec, tr, s, workdir) for spec, tr, s in specs]
        for j in jobs:
            log(f"soak: job {j.id} ({j.transport}): {h.shapes_text(j.spec)}")
        got = soak(args, workdir, jobs)
        ref, snapshot_bits, ref_code, ref_daemon = reference(args, workdir, jobs,
                                                             got["snapshots"])
        ok = report(args, jobs, got, ref, snapshot_bits, ref_code, ref_daemon)
    except h.HarnessError as e:
        log(f"soak: FAIL: {e}")
    finally:
        h.clean_up("soak", workdir, jobs, keep=not ok or args.keep)
    return 0 if ok else 1


def report(args, jobs, got, ref, snapshot_bits, ref_code, ref_daemon):
    problems = []
    s = got["samples"]
    growth = s["end"][0] - s["start"][0]
    fd_growth = s["end"][1] - s["start"][1]
    for name in ("start", "middle", "end"):
        log(f"soak: {name:6s} private {h.mib(s[name][0]):8.1f} MiB  fds {s[name][1]}  threads "
            f"{s[name][2]}")
    curve = got["scraper"].curve
    if curve:
        log(f"soak: per-second samples {len(curve)}: private max "
            f"{h.mib(max(c[1] for c in curve)):.1f} MiB, fds max {max(c[2] for c in curve)}")
    if growth > RSS_GROWTH_LIMIT:
        problems.append(f"private memory grew {h.mib(growth):.1f} MiB after warm-up (limit 8)")
    if fd_growth != 0:
        problems.append(f"open descriptors changed by {fd_growth} after warm-up")
    mismatched = sum(j.replay_mismatches for j in jobs)
    if mismatched:
        problems.append(f"{mismatched} steps' results differ from the reference")
    lost = 0
    for j in jobs:
        (step, state), (rstep, rstate) = got["finals"][j.id], ref[j.id]
        if step != rstep:
            problems.append(f"{j.id}: final checkpoint at step {step}, reference at {rstep}")
        lost += h.bits_differing(state, rstate)
    if lost:
        problems.append(f"final state differs from the reference in {lost} bits")
    if snapshot_bits:
        problems.append(f"background generations differ from the reference's saves at the same "
                        f"steps in {snapshot_bits} bits")
    sc, sv = got["scraper"], got["saver"]
    if sc.failed:
        problems.append(f"{len(sc.failed)} scrapes failed, first: {sc.failed[0]}")
    if sc.ok == 0:
        problems.append("no scrape of /metrics")
    if sv.errors:
        problems.append(f"{len(sv.errors)} saves failed, first: {sv.errors[0]}")
    errors = got["daemon"].log_errors() + ref_daemon.log_errors()
    if errors:
        problems.append(f"{len(errors)} errors in the daemon logs, first: {errors[0]}")
    if got["code"] != 0 or ref_code != 0:
        problems.append(f"muond exit codes on SIGTERM: soak {got['code']}, reference {ref_code}")
    for p in problems:
        log(f"soak: FAIL: {p}")
    log(f"soak: {'PASS' if not problems else 'FAIL'}: {args.steps} steps x 2 jobs x {h.WORLD} "
        f"ranks in {got['seconds']:.0f} s; results {sum(len(j.results) for j in jobs)} steps "
        f"checked, {mismatched} differ; final state bits differing {lost}; background "
        f"generations {sv.saved} ({sv.overlapped} while steps committed), bits differing "
        f"{snapshot_bits}; private memory "
        f"{h.mib(s['start'][0]):.1f} -> {h.mib(s['middle'][0]):.1f} -> {h.mib(s['end'][0]):.1f} "
        f"MiB (growth {h.mib(growth):+.1f}); fds {s['start'][1]} -> {s['middle'][1]} -> "
        f"{s['end'][1]}; scrapes {sc.ok} ok {len(sc.failed)} failed; log errors "
        f"{len(errors)}")
    return not problems


if __name__ == "__main__":
    sys.exit(main())
