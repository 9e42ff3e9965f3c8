#!/usr/bin/env python3
"""Daemon state written by an earlier muond loads in this one (issue 46's compatibility rule).

  checkpoint_compat_test.py MUOND MUONCTL FIXTURE_DIR
      copies FIXTURE_DIR/state (a --state-dir an earlier muond left at shutdown: an update-mode
      and an apply-mode job, each with a checkpoint generation) to a temporary directory, starts
      MUOND on it and checks, for each job: it was restored (not broken, not fenced) at the saved
      next step; `muonctl checkpoint export` of its newest generation and of its live state give,
      tensor by tensor, the bytes the earlier daemon exported (FIXTURE_DIR/expected/); and a
      further step runs and its result is the one the earlier daemon computed for that step
      (FIXTURE_DIR/expected/<job>.next.safetensors).
  checkpoint_compat_test.py --make MUOND MUONCTL FIXTURE_DIR
      writes the fixture with the given (earlier) daemon. The fixture committed under
      tests/data/compat_v1 was made by muond at f408fa1, before the rooms and Job's face.
"""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client",
                                "examples"))
from muonctl_regression import write_safetensors  # noqa: E402

SHAPES = {"layer0.wide": (16, 48), "layer1.tall": (40, 12)}
STEPS = 2  # steps before the checkpoint


def read_safetensors(path):
    """{name: (dtype, shape, raw bytes)}: compared byte for byte."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], raw[8 + n + begin:8 + n + end])
    return out


def specs():
    update = {"job_id": "compat-update", "world_size": 1, "zero_stage": 0,
              "muon": {"momentum": 0.95, "nesterov": True, "ns_method": "standard", "ns_steps": 5,
                       "compute_dtype": "float32", "scale_mode": "original"},
              "matrices": [{"name": n, "shape": list(s), "num_heads": 1, "dtype": "float32"}
                           for n, s in SHAPES.items()]}
    tensors = [{"name": n, "shape": list(s), "dtype": "float32", "param_dtype": "float32",
                "optimizer": "muon", "group": "hidden"} for n, s in SHAPES.items()]
    tensors.append({"name": "bias", "shape": [24], "dtype": "float32", "param_dtype": "float32",
                    "optimizer": "adamw", "group": "other"})
    apply = {"job_id": "compat-apply", "mode": "apply", "world_size": 1, "zero_stage": 0,
             "muon": dict(update["muon"]), "tensors": tensors,
             "groups": [{"name": "hidden", "lr": 0.02, "weight_decay": 0.01},
                        {"name": "other", "lr": 0.001, "weight_decay": 0.0}],
             "adamw": {"betas": [0.9, 0.95], "eps": 1e-8}}
    return {"compat-update": update, "compat-apply": apply}


def grads_of(job, step):
    rng = np.random.default_rng(1000 * step + (1 if job == "compat-apply" else 0))
    out = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    if job == "compat-apply":
        out["bias"] = rng.standard_normal(24).astype(np.float32)
    return out


def apply_flags(job):
    return ["--lr", "hidden=0.02", "--lr", "other=0.001"] if job == "compat-apply" else []


class Daemon:
    def __init__(self, muond, muonctl, state_dir, work):
        self.sock = os.path.join(work, "muond.sock")
        self.log = open(os.path.join(work, "muond.log"), "w")
        self.proc = subprocess.Popen(
            [muond, "--listen", f"unix://{self.sock}", "--state-dir", state_dir, "--threads", "1",
             "--metrics-address", "off"], stderr=self.log)
        self.ctl = [muonctl, "--address", f"unix://{self.sock}"]
        for _ in range(1200):  # 60 s: the daemon probes its CPU paths at start
            if os.path.exists(self.sock):
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if not os.path.exists(self.sock):
            self.proc.kill()
            self.log.flush()
            raise SystemExit("muond did not start: " + open(self.log.name).read()[-2000:])

    def run(self, *args):
        proc = subprocess.run(self.ctl + list(args), capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"muonctl {' '.join(args)} failed ({proc.returncode}): "
                             f"{proc.stderr.strip()}")
        return proc.stdout

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        if self.proc.wait(timeout=60) != 0:
            raise SystemExit(f"muond exited {self.proc.returncode}")


def step(d, job, token, t, work, out):
    gpath = os.path.join(work, f"{job}.grads.safetensors")
    write_safetensors(gpath, grads_of(job, t))
    d.run("step", "--job", job, "--rank", "0", "--step", str(t), "--grads", gpath, "--out", out,
          "--token-file", token, *apply_flags(job))


def make(muond, muonctl, fixture):
    if os.path.exists(fixture):
        shutil.rmtree(fixture)
    os.makedirs(os.path.join(fixture, "expected"))
    state = os.path.join(fixture, "state")
    with tempfile.TemporaryDirectory(prefix="compat-make-") as work:
        d = Daemon(muond, muonctl, state, work)
        try:
            for job, spec in specs().items():
                spec_path = os.path.join(work, f"{job}.json")
                with open(spec_path, "w") as f:
                    json.dump(spec, f)
                token = os.path.join(fixture, f"{job}.token")
                d.run("job", "create", "--spec", spec_path, "--token-file", token)
                if job == "compat-apply":
                    rng = np.random.default_rng(7)
                    init = {n: (rng.standard_normal(s) * 0.1).astype(np.float32)
                            for n, s in SHAPES.items()}
                    init["bias"] = np.zeros(24, np.float32)
                    ipath = os.path.join(work, "init.safetensors")
                    write_safetensors(ipath, init)
                    d.run("params", "init", "--job", job, "--rank", "0", "--params", ipath,
                          "--token-file", token)
                for t in range(STEPS):
                    step(d, job, token, t, work, os.path.join(work, "out.safetensors"))
                d.run("checkpoint", "save", "--job", job, "--token-file", token)
                d.run("checkpoint", "export", "--job", job, "--dir",
                      os.path.join(fixture, "expected"), "--token-file", token)
            # What the next step gives, computed by this daemon on a copy of the state (the fixture
            # keeps the state as saved: the step runs on a second daemon over a copy).
        finally:
            d.stop()
        copy = os.path.join(work, "copy")
        shutil.copytree(state, copy)
        d = Daemon(muond, muonctl, copy, work)
        try:
            for job in specs():
                token = os.path.join(fixture, f"{job}.token")
                step(d, job, token, STEPS, work,
                     os.path.join(fixture, "expected", f"{job}.next.safetensors"))
        finally:
            d.stop()
    print(f"fixture written to {fixture}")


def check(muond, muonctl, fixture):
    failures = []
    with tempfile.TemporaryDirectory(prefix="compat-") as work:
        state = os.path.join(work, "state")
        shutil.copytree(os.path.join(fixture, "state"), state)
        tokens = {}
        for job in specs():
            tokens[job] = os.path.join(work, f"{job}.token")
            shutil.copy(os.path.join(fixture, f"{job}.token"), tokens[job])
            os.chmod(tokens[job], 0o600)
        d = Daemon(muond, muonctl, state, work)
        try:
            for job in specs():
                before = len(failures)
                token = tokens[job]
                show = d.run("job", "show", "--job", job, "--token-file", token)
                if "fenced: yes" in show.lower() or "broken" in show.lower():
                    failures.append(f"{job}: restored fenced or broken:\n{show}")
                want = read_safetensors(os.path.join(fixture, "expected", f"{job}.safetensors"))
                for label, extra in (("newest generation", ["--step", str(STEPS)]),
                                     ("live state", [])):
                    out = os.path.join(work, "export-" + label.replace(" ", "-"))
                    d.run("checkpoint", "export", "--job", job, "--dir", out, "--token-file",
                          token, *extra)
                    got = read_safetensors(os.path.join(out, f"{job}.safetensors"))
                    if sorted(got) != sorted(want):
                        failures.append(f"{job} {label}: arrays {sorted(got)} != {sorted(want)}")
                    for name in want:
                        if name in got and got[name] != want[name]:
                            failures.append(f"{job} {label}: array '{name}' differs from the "
                                            "earlier daemon's export")
                    manifest = json.load(open(os.path.join(out, f"{job}.manifest.json")))
                    want_manifest = json.load(open(os.path.join(fixture, "expected",
                                                                f"{job}.manifest.json")))
                    if manifest.get("step") != want_manifest.get("step"):
                        failures.append(f"{job} {label}: next step {manifest.get('step')} != "
                                        f"{want_manifest.get('step')}")
                out = os.path.join(work, f"{job}.next.safetensors")
                step(d, job, token, STEPS, work, out)
                want_next = read_safetensors(os.path.join(fixture, "expected",
                                                          f"{job}.next.safetensors"))
                if read_safetensors(out) != want_next:
                    failures.append(f"{job}: step {STEPS} after the load differs from the earlier "
                                    "daemon's")
                if len(failures) == before:
                    print(f"{job}: restored at step {STEPS}; exports and step {STEPS} match")
        finally:
            d.stop()
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


def main(argv):
    if argv[1:2] == ["--make"] and len(argv) == 5:
        make(*[os.path.abspath(a) for a in argv[2:5]])
        return 0
    if len(argv) != 4:
        print(__doc__)
        return 64
    return check(*[os.path.abspath(a) for a in argv[1:4]])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
