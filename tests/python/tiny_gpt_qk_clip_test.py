#!/usr/bin/python3
"""client/examples/train_tiny_gpt.py --mode apply --qk-clip TAU (QK-Clip on muond's masters,
DESIGN.md 4e) against the same run without QK-Clip, both with the query and key projections'
lr raised (--qk-lr-mult 4) so that the attention logits grow.

Asserts: without QK-Clip the largest logit climbs past 1.5 tau; with it, every step's largest
logit on its batch at the parameters the step returned stays within 1.1 tau (the clip is computed
from the forward's logits, so the step's own update can add to them), both runs track their
in-process references (which clip their own masters the same way) within 1e-5 in loss, and the
clipped run's loss still goes down.

Usage: tiny_gpt_qk_clip_test.py LIBMUOND_CLIENT --address ADDR (with_daemon.sh appends it)
"""
import json
import os
import subprocess
import sys
import tempfile

LIB = sys.argv[1]
ADDRESS = sys.argv[sys.argv.index("--address") + 1] if "--address" in sys.argv else None
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EXAMPLE = os.path.join(ROOT, "client", "examples", "train_tiny_gpt.py")
TAU = 10.0


def run(extra, path):
    env = dict(os.environ, MUOND_CLIENT_LIB=LIB)
    cmd = [sys.executable, EXAMPLE, "--mode", "apply", "--steps", "40", "--qk-lr-mult", "4",
           "--plot", "", "--json", path] + extra
    if ADDRESS:
        cmd += ["--address", ADDRESS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    sys.stdout.write(proc.stdout[-1500:])
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        sys.exit(f"FAIL: {' '.join(extra) or 'no clip'}: exit {proc.returncode}")
    with open(path) as f:
        return json.load(f)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        free = run([], os.path.join(tmp, "free.json"))
        clipped = run(["--qk-clip", str(TAU)], os.path.join(tmp, "clipped.json"))
    bad = []
    if not max(free["max_logits_after"]) > 1.5 * TAU:
        bad.append(f"without QK-Clip the logits stayed at {max(free['max_logits_after']):.3f}")
    worst = max(clipped["max_logits_after"])
    if not worst <= 1.1 * TAU:
        bad.append(f"with QK-Clip a step left a logit of {worst:.3f} (tau {TAU})")
    for name, out in (("free", free), ("clipped", clipped)):
        if out["max_abs_diff"] > 1e-5:
            bad.append(f"{name}: loss differs from the reference's by {out['max_abs_diff']:.3e}")
    if not clipped["losses"][-1] < clipped["losses"][0]:
        bad.append("the clipped run's loss did not go down")
    if bad:
        sys.exit("FAIL:\n  " + "\n  ".join(bad))
    print(f"PASS: largest logit after a step: {max(free['max_logits_after']):.3f} without "
          f"QK-Clip, {worst:.3f} with it (tau {TAU})")


if __name__ == "__main__":
    main()
