"""The chaos run's verdict (tests/chaos/chaos.py): the same jobs and steps without faults in a
fresh daemon, and the comparison of the final states, bit for bit, with the run's problems."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "soak"))
import harness as h  # noqa: E402
from harness import log  # noqa: E402


def reference(args, workdir, jobs, done):
    """The same jobs and steps, no faults, in a fresh daemon."""
    import muon_offload as mo
    d = h.Daemon(args.muond, os.path.join(workdir, "reference"), metrics=False)
    os.makedirs(d.workdir)
    d.start()
    with mo.Client(d.address) as admin:
        for j in jobs:
            j.create(admin)
            j.attach(d.address)
        h.run_steps(jobs, done)
        finals = {j.id: h.save_state(admin, d, j) for j in jobs}
    for j in jobs:
        j.detach()
    return finals, d.stop()


def report(args, c, jobs, finals, ref, ref_code, seconds):
    problems = list(c.problems)
    lost = 0
    for j in jobs:
        (step, state), (rstep, rstate) = finals[j.id], ref[j.id]
        if step != rstep:
            problems.append(f"{j.id}: final state at step {step}, fault-free run at {rstep}")
        bits = h.bits_differing(state, rstate)
        lost += bits
        log(f"chaos: {j.id}: {step} steps, final state bits differing from the fault-free run: "
            f"{bits}")
    mismatched = sum(j.replay_mismatches for j in jobs)
    if mismatched:
        problems.append(f"{mismatched} steps returned results other than the fault-free run's")
    if lost:
        problems.append(f"{lost} bits of state lost")
    if ref_code != 0:
        problems.append(f"the reference muond exited {ref_code} on SIGTERM")
    for p in problems:
        log(f"chaos: FAIL: {p}")
    faults = ", ".join(f"{k} {v}" for k, v in sorted(c.faults.items()))
    recov = ", ".join(f"{k} {v}" for k, v in sorted(c.recoveries.items()))
    details = ", ".join(f"{k} {v}" for k, v in sorted(c.details.items()))
    log(f"chaos: where faults landed: {details}")
    log(f"chaos: {'PASS' if not problems else 'FAIL'}: {args.rounds} rounds in {seconds:.0f} s; "
        f"faults ({sum(c.faults.values())}): {faults}; recoveries "
        f"({sum(c.recoveries.values())}): {recov}; daemon starts {c.d.starts}; steps "
        f"{', '.join(f'{k} {v}' for k, v in c.done.items())}; results differing {mismatched}; "
        f"bits lost {lost}")
    return not problems
