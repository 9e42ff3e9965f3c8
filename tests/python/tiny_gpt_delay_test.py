#!/usr/bin/python3
"""train_tiny_gpt.py --delay 1 --steps 200 (the quickstart's tiny GPT, update mode): the loss at
the end (the mean of the last 10 steps' losses) within 3% of the synchronous in-process run's,
the example's verdict agreeing with the losses it wrote, and the delayed steps really in flight
(the exposed-time line says the update was delayed).

Usage: tiny_gpt_delay_test.py LIBMUOND_CLIENT --address ADDR (tests/python/with_daemon.sh
appends --address).
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EXAMPLE = os.path.join(ROOT, "client", "examples", "train_tiny_gpt.py")
STEPS, END, TARGET = 200, 10, 0.03


def main():
    lib = sys.argv[1]
    address = sys.argv[sys.argv.index("--address") + 1]
    with tempfile.TemporaryDirectory(prefix="tiny-gpt-delay-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, EXAMPLE, "--address", address, "--steps", str(STEPS),
               "--delay", "1", "--plot", "", "--json", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, MUOND_CLIENT_LIB=lib))
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        with open(out) as f:
            result = json.load(f)
    losses, ref = result["losses"], result["ref_losses"]
    assert len(losses) == len(ref) == STEPS, (len(losses), len(ref))
    end, sync = sum(losses[-END:]) / END, sum(ref[-END:]) / END
    gap = abs(end - sync) / sync
    assert gap <= TARGET, f"loss at the end {end} vs synchronous {sync}: {gap:.2%} apart"
    assert abs(result["final_loss_gap"] - gap) < 1e-12, (result["final_loss_gap"], gap)
    # The two runs differ: the delayed one is not the synchronous one under another name.
    assert max(abs(a - b) for a, b in zip(losses, ref)) > 1e-3
    assert losses[-1] < losses[0] - 1.0, (losses[0], losses[-1])
    assert "update delayed one step" in proc.stdout, proc.stdout
    assert f"is {gap * 100:.2f}% from the synchronous in-process run's (at most 3%)" \
        in proc.stdout, proc.stdout
    print(f"--delay 1, {STEPS} steps: loss at the end {end:.4f} vs synchronous {sync:.4f} "
          f"({gap:.2%} apart, target 3%)")


if __name__ == "__main__":
    main()
