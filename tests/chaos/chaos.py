"""The chaos run (tests/chaos/run.sh): the soak's two jobs (tests/soak/harness.py: update mode
over shared memory, apply mode over gRPC, 4 ranks each) on one muond, in rounds: a checkpoint of
each job, a few clean steps, then one fault drawn from a printed seed and the recovery a user would
make. At the end each job's state (a checkpoint) must equal, bit for bit, a fault-free run of the
same steps in a fresh daemon, and every step that ran more than once must have returned the same
results each time.

Faults: rank_kill (SIGKILL of one rank at a random time in a step, or by itself half way through
writing its gradients, before submitting them or after its step returned), daemon_kill_step
(SIGKILL of the daemon at a random time in a step of both jobs, sometimes with a save in flight),
daemon_kill_save (SIGKILL while a save is being written, writes slowed by the daemon's test hook
$MUOND_TEST_CHECKPOINT_FAULT), daemon_kill_commit (SIGKILL in the middle of a commit: the daemon
restarted with the hook $MUOND_TEST_COMMIT_HOLD_MS, which holds every commit after the state store
flipped and before any rank gets its results; the kill lands when the daemon logs the hold),
daemon_kill_inplace (SIGKILL in the middle of an in-place update: the hook
$MUOND_TEST_INPLACE_HOLD_MS holds a sealed step after its first batch updated the state in place,
part new and part old, nothing committed; the restart must resume from the newest save),
save_enospc (the daemon restarted with that hook failing a write of a save with ENOSPC), save_eio (EIO from a mkdir, open, write, fsync, rename or directory fsync of a
save), corrupt_newest (a bit of the newest generation flipped), stall (a rank that waits past the
job's step timeout before it submits). Recoveries: checkpoint load (newest good generation) or, for
the update-mode job, a reset to step 0, then the lost steps replayed; daemon restart (each job
restored from its newest good generation), then the lost steps replayed; a failed save retried.
A restart after SIGKILL must not resume before the newest acknowledged save; one after SIGTERM
must resume where the jobs were.
"""
import argparse
import collections
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "soak"))
import harness as h  # noqa: E402
from harness import HarnessError, log  # noqa: E402
from chaos_check import reference, report  # noqa: E402

KINDS = ["rank_kill", "daemon_kill_step", "daemon_kill_save", "daemon_kill_commit",
         "daemon_kill_inplace", "save_enospc", "save_eio", "corrupt_newest", "stall"]
STEP_TIMEOUT = 5  # seconds, the jobs' step_timeout_seconds
SAVE_DELAY_MS = 4  # every checkpoint write call sleeps this long (a slow disk): saves last long
COMMIT_HOLD_MS = 30000  # daemon_kill_commit: far longer than the harness needs to see the hold
SKIP = 77


class Skip(Exception):
    pass


class Chaos:
    def __init__(self, args, workdir, rng, jobs):
        self.args = args
        self.rng = rng
        self.jobs = jobs
        self.d = h.Daemon(args.muond, os.path.join(workdir, "chaos"), metrics=False)
        os.makedirs(self.d.workdir)
        self.admin = None
        self.faults = collections.Counter()
        self.details = collections.Counter()  # where faults landed
        self.recoveries = collections.Counter()
        self.events = []  # what each round did, for the report
        self.problems = []
        self.step_times = []
        self.save_times = collections.defaultdict(list)  # job: seconds, writes slowed
        self.slow_saves = False  # whether the daemon runs with the write delay armed
        self.done = {j.id: 0 for j in jobs}  # steps whose results are known
        # The step of each job's newest acknowledged save (None: not known), which a restart after
        # SIGKILL must not resume before: an OK save is durable.
        self.acked = {j.id: 0 for j in jobs}

    # ----- daemon -----

    def start(self, fault=None, hooks=None):
        import muon_offload as mo
        offset = os.path.getsize(self.d.log_path) if os.path.exists(self.d.log_path) else 0
        self.slow_saves = not fault
        fault = fault or f"delay:{SAVE_DELAY_MS}"
        self.d.start(fault=fault, hooks=hooks)
        with open(self.d.log_path, errors="replace") as f:
            f.seek(offset)
            if "checkpoint fault injection armed" not in f.read():
                raise Skip("muond has no test fault hooks (configure with -DMUOND_TEST_HOOKS=ON)")
        if self.admin is not None:
            self.admin.close()
        self.admin = mo.Client(self.d.address)

    def check_alive(self, what):
        if not self.d.alive():
            raise HarnessError(f"muond died by itself during {what} (exit {self.d.proc.returncode})"
                               f":\n{self.d.log_tail()}")

    # ----- steps and recovery -----

    def clean_steps(self, n):
        t0 = time.time()
        h.run_steps(self.jobs, {j.id: j.next + n for j in self.jobs})
        self.step_times.append((time.time() - t0) / n)
        for j in self.jobs:
            self.done[j.id] = max(self.done[j.id], j.next)

    def step_estimate(self):
        return statistics.median(self.step_times) if self.step_times else 0.05

    def save(self, job):
        t0 = time.time()
        gen, step = self.admin.checkpoint_save(job.id, job.token)
        self.acked[job.id] = step
        if self.slow_saves:
            self.save_times[job.id].append(time.time() - t0)
        return gen, step

    def replay(self, job, how):
        """After a recovery put `job` at job.next: runs the steps up to what it had reached."""
        lost = self.done[job.id] - job.next
        before = job.replay_mismatches
        h.run_steps([job], {job.id: self.done[job.id]})
        if job.replay_mismatches != before:
            self.problems.append(f"{job.id}: a replayed step after {how} returned other results")
        self.recoveries[how] += 1
        return lost

    def reattach_all(self):
        for j in self.jobs:
            for w in j.workers:
                if w.proc.poll() is not None:
                    w.spawn()
            j.detach()
            j.next = j.attach(self.d.address)

    def recover_job(self, job, allow_reset=True):
        """Load the newest good generation (or, update mode, reset to 0), attach, replay."""
        job.detach()
        for w in job.workers:
            if w.proc.poll() is not None:
                w.spawn()
        if allow_reset and job.spec.get("mode") != "apply" and self.rng.random() < 0.3:
            self.admin.reset_job(job.id, job.token, 0)
            how, expect, what = "reset", 0, "reset to step 0"
        else:
            gen, expect = self.admin.checkpoint_load(job.id, job.token)
            how, what = "load", f"loaded generation {gen} (step {expect})"
        self.acked[job.id] = expect  # a restart now comes back to this state
        job.next = job.attach(self.d.address)
        if job.next != expect:
            raise HarnessError(f"{job.id}: {what} but the ranks attached at step {job.next}")
        lost = self.replay(job, how)
        return f"{what}, replayed {lost} steps"

    def restart(self, kill=True, fault=None, hooks=None):
        """SIGKILL (or SIGTERM) and start again; every job resumes where its state was restored.
        A daemon already killed is not signalled again."""
        if kill:
            if self.d.alive():
                self.d.kill()
        else:
            code = self.d.stop()
            if code != 0:
                self.problems.append(f"muond exited {code} on SIGTERM")
        self.start(fault, hooks)
        self.reattach_all()
        lost = {j.id: self.done[j.id] - j.next for j in self.jobs}
        for j in self.jobs:
            if not kill and j.next != self.done[j.id]:
                self.problems.append(f"{j.id}: after SIGTERM (which saves) the daemon resumed at "
                                     f"step {j.next}, not {self.done[j.id]}")
            elif kill and self.acked[j.id] is not None and j.next < self.acked[j.id]:
                self.problems.append(f"{j.id}: restarted at step {j.next} although a save at step "
                                     f"{self.acked[j.id]} was acknowledged")
            self.acked[j.id] = j.next
        for j in self.jobs:
            self.replay(j, "restart" if kill else "graceful restart")
        return ", ".join(f"{k} resumed {v} steps back" for k, v in lost.items())

    # ----- faults -----

    def other(self, job):
        return [j for j in self.jobs if j is not job][0]

    def side_step(self, other):
        other.send_step(other.next)

    def side_collect(self, other, what):
        answers = other.collect(other.next)
        if not all(a["ok"] for a in answers):
            self.problems.append(f"{other.id} failed during {what} of the other job: "
                                 f"{[a for a in answers if not a['ok']][0]}")
            return
        other.record(other.next, answers)
        other.next += 1
        self.done[other.id] = max(self.done[other.id], other.next)

    def rank_kill(self):
        job = self.rng.choice(self.jobs)
        victim = self.rng.randrange(h.WORLD)
        point = self.rng.choice(["at a random time", "mid_write", "before_push", "after_push"])
        other = self.other(job)
        self.side_step(other)
        t = job.next
        if point == "at a random time":
            delay = self.rng.uniform(0, self.step_estimate())
            job.send_step(t)
            time.sleep(delay)
            job.workers[victim].kill()
            point = f"{delay * 1000:.0f} ms into step {t}"
        else:
            job.send_step(t, die={victim: point})
            try:
                job.workers[victim].proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.workers[victim].kill()
                self.problems.append(f"{job.id} rank {victim} did not reach {point} of step {t}")
            point = f"{point} of step {t}"
        answers = job.collect(t, skip={victim})
        self.side_collect(other, "rank_kill")
        self.check_alive("rank_kill")
        ok = sum(1 for a in answers if a is not None and a["ok"])
        self.details["rank killed, step committed" if ok == 3 else "rank killed, step aborted"] += 1
        return (f"{job.id} rank {victim} killed {point} "
                f"({ok}/3 others got results); " + self.recover_job(job))

    def daemon_kill_step(self):
        delay = self.rng.uniform(0, self.step_estimate())
        saving = self.rng.choice([None] + self.jobs)  # a save in flight as well
        th = threading.Thread(target=self.save_quietly, args=(saving,)) if saving else None
        if th:
            th.start()
        for j in self.jobs:
            j.send_step(j.next)
        time.sleep(delay)
        self.d.kill()
        if th:
            th.join()
        got = []
        for j in self.jobs:
            answers = j.collect(j.next)  # a hang here fails the run (Worker.recv's timeout)
            if all(a["ok"] for a in answers):
                j.record(j.next, answers)
                j.next += 1
                self.done[j.id] = max(self.done[j.id], j.next)
                got.append(j.id)
        self.details["daemon killed mid-step"] += len(self.jobs) - len(got)
        also = f", a save of {saving.id} in flight" if saving else ""
        return (f"muond killed {delay * 1000:.0f} ms into a step of both jobs{also} (completed "
                f"before the kill: {got or 'none'}); " + self.restart())

    def save_quietly(self, job):
        """A save that a kill may interrupt; an acknowledged one counts as durable."""
        try:
            _, step = self.admin.checkpoint_save(job.id, job.token)
            self.acked[job.id] = step
        except Exception:  # noqa: BLE001 -- interrupted by the fault
            pass

    def daemon_kill_save(self):
        job = self.rng.choice(self.jobs)
        times = self.save_times[job.id]
        est = statistics.median(times) if times else 0.05
        delay = self.rng.uniform(0.05, 0.9) * est
        result = {}

        def body():
            try:
                result["ok"] = self.admin.checkpoint_save(job.id, job.token)
            except Exception as e:  # noqa: BLE001 -- the save is expected to fail
                result["error"] = str(e)

        th = threading.Thread(target=body)
        th.start()
        time.sleep(delay)
        self.d.kill()
        th.join()
        if "ok" in result:
            self.acked[job.id] = result["ok"][1]
        mid = "error" in result
        if mid:
            self.details["daemon killed mid-save"] += 1
        ckpt = os.path.join(self.d.state, "jobs", job.id, "checkpoints")
        tmp = [n for n in os.listdir(ckpt) if n.endswith(".tmp")]
        out = (f"muond killed {delay * 1000:.0f} ms into a save of {job.id} "
               f"({'mid-save' if mid else 'after it finished'}; partial dirs {tmp}); ")
        return out + self.restart()

    def daemon_kill_commit(self):
        """SIGKILL while a commit holds (the store flipped in memory, no result released): no rank
        may get results, and the restarted daemon resumes from the newest acknowledged save."""
        return self.kill_at_hold("MUOND_TEST_COMMIT_HOLD_MS", "commit of job '{job}' step {t} holds",
                                 "inside the commit", "daemon killed mid-commit",
                                 "committed (store flipped, ")

    def daemon_kill_inplace(self):
        """SIGKILL while a sealed step holds in the middle of updating the state in place (one copy:
        part of it new, part old, nothing committed): no rank may get results, and the restarted
        daemon resumes from the newest acknowledged save, bit for bit."""
        return self.kill_at_hold("MUOND_TEST_INPLACE_HOLD_MS",
                                 "job '{job}' step {t} holds in the middle of an in-place update",
                                 "in the middle of an in-place update",
                                 "daemon killed mid in-place update", "was updated in place (")

    def kill_at_hold(self, hook, marker_format, where, detail, doing):
        held = self.restart(kill=False, hooks={hook: str(COMMIT_HOLD_MS)})
        job = self.rng.choice(self.jobs)
        t = job.next
        offset = os.path.getsize(self.d.log_path)
        marker = "test hook: " + marker_format.format(job=job.id, t=t)
        job.send_step(t)
        deadline = time.time() + 120
        while True:
            with open(self.d.log_path, errors="replace") as f:
                f.seek(offset)
                if marker in f.read():
                    break
            self.check_alive("a held commit")
            if time.time() > deadline:
                raise HarnessError(f"{job.id} step {t}: no hold ({hook}) logged within 120 s:\n"
                                   f"{self.d.log_tail(offset)}")
            time.sleep(0.01)
        self.d.kill()
        answers = job.collect(t)
        released = [a for a in answers if a["ok"]]
        if released:
            self.problems.append(f"{job.id} step {t}: the daemon was killed {where}, before any "
                                 f"result was released, but {len(released)} ranks got results")
        self.details[detail] += 1
        return (f"({held}) muond killed while {job.id} step {t} {doing}"
                f"{len(released)}/{h.WORLD} results released); " + self.restart())

    def save_fault(self, errno_value, point_choices):
        point = self.rng.choice(point_choices)
        nth = self.rng.randint(1, 2)
        fault = f"{point}:{nth}:{errno_value}"
        restarted = self.restart(kill=False, fault=fault)
        job = self.rng.choice(self.jobs)
        error = None
        for _ in range(4):
            try:
                self.save(job)
            except Exception as e:  # noqa: BLE001 -- the injected failure
                error = e
                break
        self.check_alive("a failed save")
        if error is None:
            self.problems.append(f"{fault}: no save of {job.id} failed")
            return f"{fault}: no save failed"
        code = getattr(error, "code_name", "?")
        if errno_value == 28 and code != "RESOURCE_EXHAUSTED":
            self.problems.append(f"ENOSPC save of {job.id} answered {code}, not "
                                 f"RESOURCE_EXHAUSTED: {error}")
        ckpt = os.path.join(self.d.state, "jobs", job.id, "checkpoints")
        tmp = [n for n in os.listdir(ckpt) if n.endswith(".tmp")]
        if tmp:
            self.problems.append(f"failed save of {job.id} left {tmp}")
        gen, step = self.save(job)  # recovery: the user saves again
        self.recoveries["save retried"] += 1
        msg = getattr(error, "message", str(error))
        return (f"({restarted}) {fault}: save of {job.id} failed {code}: {msg[:160]}; "
                f"retried: generation {gen} at step {step}")

    def save_enospc(self):
        return self.save_fault(28, ["write"])

    def save_eio(self):
        return self.save_fault(5, ["mkdir", "open", "write", "fsync", "rename", "fsyncdir"])

    def corrupt_newest(self):
        job = self.rng.choice(self.jobs)
        h.run_steps([job], {job.id: job.next + self.rng.randint(1, 3)})
        self.done[job.id] = max(self.done[job.id], job.next)
        gen, step = self.save(job)  # the newest generation, steps ahead of the one before
        path = os.path.join(h.generation_dir(self.d.state, job.id, gen), "momentum.safetensors")
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            n = int.from_bytes(f.read(8), "little")
            at = self.rng.randrange(8 + n, size)
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ (1 << self.rng.randrange(8))]))
        out = f"{job.id} generation {gen} (step {step}) byte {at} flipped; "
        if self.rng.random() < 0.5:
            self.acked[job.id] = None  # the newest generation is the corrupt one
            out += "restart: " + self.restart()
        else:
            out += self.recover_job(job, allow_reset=False)
        ckpt = os.path.join(self.d.state, "jobs", job.id, "checkpoints")
        if not any("broken" in n for n in os.listdir(ckpt)):
            self.problems.append(f"{job.id}: corrupt generation {gen} not set aside as .broken")
        return out

    def stall(self):
        job = self.rng.choice(self.jobs)
        victim = self.rng.randrange(h.WORLD)
        other = self.other(job)
        t = job.next
        job.send_step(t, stall={victim: STEP_TIMEOUT + 1.5})
        self.side_step(other)
        self.side_collect(other, "stall")
        answers = job.collect(t)
        codes = sorted({a.get("code", "OK") for a in answers})
        if any(a["ok"] for a in answers):
            self.problems.append(f"{job.id} step {t}: rank {victim} stalled past the step "
                                 f"timeout but ranks got results: {codes}")
        self.check_alive("stall")
        return (f"{job.id} rank {victim} stalled {STEP_TIMEOUT + 1.5} s at step {t} (answers "
                f"{codes}); " + self.recover_job(job))

    # ----- the run -----

    def run(self):
        self.start()
        for j in self.jobs:
            j.create(self.admin)
            j.next = j.attach(self.d.address)
            self.save(j)  # a generation at step 0: a load always has one
        plan = list(KINDS) if self.args.rounds >= len(KINDS) else []
        self.rng.shuffle(plan)
        plan += [self.rng.choice(KINDS) for _ in range(self.args.rounds - len(plan))]
        for r, kind in enumerate(plan):
            for j in self.jobs:
                self.save(j)
            self.clean_steps(self.rng.randint(2, 5))  # lost by a fault, replayed
            self.faults[kind] += 1
            t0 = time.time()
            what = getattr(self, kind)()
            self.events.append(f"round {r + 1}: {kind}: {what} ({time.time() - t0:.1f} s)")
            log(f"chaos: {self.events[-1]}")
        self.clean_steps(2)
        finals = {j.id: h.save_state(self.admin, self.d, j) for j in self.jobs}
        self.admin.close()
        for j in self.jobs:
            j.detach()
        code = self.d.stop()
        if code != 0:
            self.problems.append(f"muond exited {code} on the final SIGTERM")
        return finals


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--seed", type=int)
    p.add_argument("--muond", default=os.path.join(h.ROOT, "build", "bin", "muond"))
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--wide", action="store_true",
                   help="add a 64 x 65536 matrix to the gRPC job: its ranks' data travels in "
                        "several 4 MiB chunks (slower: about 0.5 s a step here)")
    args = p.parse_args()
    seed = h.seed_from(args.seed)
    wide = " --wide" if args.wide else ""
    log(f"chaos: seed {seed} (rerun: tests/chaos/run.sh --rounds {args.rounds} --seed {seed}"
        f"{wide})")
    rng = random.Random(seed)
    workdir = tempfile.mkdtemp(prefix="muond-chaos-")
    jobs, ok, rc = [], False, 1
    try:
        args.muond = h.stage_binaries(args.muond, workdir)
        specs = h.random_specs(rng, workdir, "chaos", {"step_timeout_seconds": STEP_TIMEOUT,
                                                       "checkpoint_keep": 4}, wide=args.wide)
        jobs = [h.Job(spec, tr, s, workdir) for spec, tr, s in specs]
        for j in jobs:
            log(f"chaos: job {j.id} ({j.transport}): {h.shapes_text(j.spec)}")
        t0 = time.time()
        c = Chaos(args, workdir, rng, jobs)
        finals = c.run()
        seconds = time.time() - t0
        ref, ref_code = reference(args, workdir, jobs, c.done)
        ok = report(args, c, jobs, finals, ref, ref_code, seconds)
        rc = 0 if ok else 1
    except Skip as e:
        log(f"chaos: SKIP: {e}")
        ok, rc = True, SKIP
    except HarnessError as e:
        log(f"chaos: FAIL: {e}")
    finally:
        h.clean_up("chaos", workdir, jobs, keep=not ok or args.keep)
    return rc


if __name__ == "__main__":
    sys.exit(main())
