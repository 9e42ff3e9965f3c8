#!/usr/bin/python3
"""train_tiny_gpt.py --momentum-dtype int8 and bfloat16, 200 steps (the quickstart's tiny GPT,
update mode): with muond holding Muon's momentum compressed, the loss at the end (the mean of the
last 10 steps' losses) is within 2% of the in-process run's, which keeps fp32 momentum; the
example's verdict agrees with the losses it wrote, and the two runs really differ (the momentum
was held compressed, not in fp32 under another name).

Usage: tiny_gpt_state_dtype_test.py LIBMUOND_CLIENT --address ADDR (tests/python/with_daemon.sh
appends --address).
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EXAMPLE = os.path.join(ROOT, "client", "examples", "train_tiny_gpt.py")
STEPS, END, TARGET = 200, 10, 0.02


def run(lib, address, dtype):
    with tempfile.TemporaryDirectory(prefix="tiny-gpt-state-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, EXAMPLE, "--address", address, "--steps", str(STEPS),
               "--momentum-dtype", dtype, "--job-id", f"tiny-gpt-momentum-{dtype}",
               "--plot", "", "--json", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                              env=dict(os.environ, MUOND_CLIENT_LIB=lib))
        result = None
        if os.path.exists(out):
            with open(out) as f:
                result = json.load(f)
        return proc, result


def main():
    lib = sys.argv[1]
    address = sys.argv[sys.argv.index("--address") + 1]
    for dtype in ("int8", "bfloat16"):
        proc, result = run(lib, address, dtype)
        assert proc.returncode == 0, f"{dtype}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        losses, ref = result["losses"], result["ref_losses"]
        assert len(losses) == len(ref) == STEPS, (len(losses), len(ref))
        end, fp32 = sum(losses[-END:]) / END, sum(ref[-END:]) / END
        gap = abs(end - fp32) / fp32
        assert gap <= TARGET, f"{dtype}: loss at the end {end} vs fp32 state {fp32}: {gap:.2%}"
        assert abs(result["final_loss_gap"] - gap) < 1e-12, (result["final_loss_gap"], gap)
        verdict = [l for l in proc.stdout.splitlines() if "the loss at the end" in l]
        assert len(verdict) == 1 and f"momentum {dtype}" in verdict[0], proc.stdout
        # The runs differ: muond's momentum was held compressed.
        assert max(abs(a - b) for a, b in zip(losses, ref)) > 0, dtype
        print(f"{dtype} momentum: loss at the end {end:.4f}, fp32 state {fp32:.4f} "
              f"({gap * 100:.2f}% apart, at most {TARGET * 100:g}%)")
    print("OK")


if __name__ == "__main__":
    main()
