#!/usr/bin/python3
"""The bound of train_tiny_gpt.py's apply-mode parity line (bf16 parameters): a few steps of the
example through muond hold every step's |loss(muond) - loss(reference)| within its per-step bound
(bf16 rounding of every parameter and activation, first order, Hoeffding at lambda 6; the
reference steps from the trainer's parameters each step; the example's docstring derives it), and
the same run with the bound scaled to 0 exits 1 naming the step over it, so the check can fail.

Usage: tiny_gpt_bound_test.py MUONCTL LIBMUOND_CLIENT --address ADDR (tests/python/with_daemon.sh
appends --address).
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EXAMPLE = os.path.join(ROOT, "client", "examples", "train_tiny_gpt.py")
STEPS = 5
# Small enough for two cores: 1 block of d 64, 4 sequences of 32 characters per rank.
SMALL = ["--steps", STEPS, "--layers", 1, "--d", 64, "--block-size", 32, "--batch-size", 4]


def run(muonctl, lib, address, job_id, *extra):
    """(exit status, stdout, stderr, JSON result) of one apply-mode run of the example."""
    with tempfile.TemporaryDirectory(prefix="tiny-gpt-bound-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, EXAMPLE, "--address", address, "--muonctl", muonctl,
               "--mode", "apply", "--param-dtype", "bfloat16", "--job-id", job_id, "--plot", "",
               "--json", out, *map(str, SMALL), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, MUOND_CLIENT_LIB=lib))
        result = None
        if os.path.exists(out):
            with open(out) as f:
                result = json.load(f)
        return proc.returncode, proc.stdout, proc.stderr, result


def parity_line(stdout):
    lines = [l for l in stdout.splitlines() if "largest |loss(muond) - loss(reference)|" in l]
    assert len(lines) == 1, stdout
    return lines[0]


def main():
    muonctl, lib = sys.argv[1], sys.argv[2]
    address = sys.argv[sys.argv.index("--address") + 1]

    code, stdout, stderr, result = run(muonctl, lib, address, "bound-held")
    assert code == 0, f"exit {code}\n{stdout}\n{stderr}"
    losses, ref, bounds = result["losses"], result["ref_losses"], result["bounds"]
    assert len(losses) == len(ref) == len(bounds) == STEPS, result
    diffs = [abs(a - b) for a, b in zip(losses, ref)]
    # Step 0: the same parameters on both sides, so the same loss, bit for bit.
    assert diffs[0] == 0.0, (losses[0], ref[0])
    for t, (d, b) in enumerate(zip(diffs, bounds)):
        # Positive, and far below the loss: 2 lambda u (|c| + |g w|) is about 0.2% of it here.
        assert 0 < b < 0.01 * losses[t], f"step {t}: bound {b} for loss {losses[t]}"
        assert d <= b, f"step {t}: |loss difference| {d} over its bound {b}"
    # Some step must differ, or the run below could not show the check failing.
    assert max(diffs) > 0, diffs
    line = parity_line(stdout)
    worst = max(range(STEPS), key=diffs.__getitem__)
    assert f"= {diffs[worst]:.3e} (step {worst}) <= bound {bounds[worst]:.3e}" in line, line
    assert ("(2^-8 relative bfloat16 rounding of every parameter and activation, first order, "
            "Hoeffding lambda 6, per step from the same parameters)" in line), line
    assert "every step within its bound" in line, line

    code, stdout, stderr, failed = run(muonctl, lib, address, "bound-zero", "--bound-scale", "0")
    assert code == 1, f"exit {code} with the bound scaled to 0\n{stdout}\n{stderr}"
    assert failed["bounds"] == [0.0] * STEPS, failed["bounds"]
    assert "exceeds its bound 0.000e+00" in stderr, stderr
    assert "> bound 0.000e+00" in parity_line(stdout), stdout
    # The run itself is the same: the scale changes only the verdict.
    assert failed["losses"] == losses and failed["ref_losses"] == ref, (failed, result)
    print(f"apply mode, bf16, {STEPS} steps: largest |loss difference| {max(diffs):.3e} (step "
          f"{worst}) <= bound {bounds[worst]:.3e}; largest share of a bound "
          f"{max(d / b for d, b in zip(diffs, bounds)):.2%}; bound scaled to 0: exit 1")


if __name__ == "__main__":
    main()
