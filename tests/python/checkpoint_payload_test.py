"""A checkpoint's payload is plain safetensors: read with numpy (and torch) it holds exactly the
momentum the daemon computed.

Usage: checkpoint_payload_test.py MUOND_BIN MUONCTL_BIN

Starts muond on a private state directory, runs three steps of a two-matrix job through
`muonctl step` with known gradients, saves a checkpoint with `muonctl checkpoint save`, and checks
that momentum.safetensors (parsed here from its bytes) equals the momentum EMA of DESIGN.md 3
computed in float32 with numpy, bit for bit, and that the manifest describes it.
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
import torch

MUOND, MUONCTL = sys.argv[1], sys.argv[2]


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        assert info["dtype"] == "F32", info
        begin, end = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + begin:8 + n + end], dtype=np.float32).reshape(
            info["shape"])
    return out, meta, raw


def main():
    tmp = tempfile.mkdtemp(prefix="muond-ckpt-py.")
    addr = "unix://" + os.path.join(tmp, "muond.sock")
    log = open(os.path.join(tmp, "log"), "w")
    daemon = subprocess.Popen([MUOND, "--listen", addr, "--state-dir", os.path.join(tmp, "state"),
                               "--threads", "1", "--metrics-address", "off"],
                              stdout=log, stderr=log)
    try:
        for _ in range(100):
            if os.path.exists(os.path.join(tmp, "muond.sock")):
                break
            time.sleep(0.1)

        def ctl(*args):
            r = subprocess.run([MUONCTL, "--address", addr, *args], capture_output=True,
                               text=True, env={**os.environ, "MUOND_JOB_TOKEN": ""})
            if r.returncode != 0:
                raise SystemExit("muonctl %s failed (%d): %s" % (args, r.returncode, r.stderr))
            return r.stdout

        beta = 0.9
        spec = {"job_id": "py", "muon": {"momentum": beta},
                "matrices": [{"name": "layers.0.w", "shape": [24, 40]},
                             {"name": "layers.0.v", "shape": [16, 16], "num_heads": 2}]}
        with open(os.path.join(tmp, "job.json"), "w") as f:
            json.dump(spec, f)
        token_file = os.path.join(tmp, "tok")
        ctl("job", "create", "--spec", os.path.join(tmp, "job.json"), "--token-file", token_file)

        rng = np.random.default_rng(3)
        momentum = {m["name"]: np.zeros(m["shape"], dtype=np.float32) for m in spec["matrices"]}
        w = np.float32(1.0 - beta)
        for step in range(3):
            grads = {name: rng.standard_normal(m.shape).astype(np.float32)
                     for name, m in momentum.items()}
            path = os.path.join(tmp, "g%d.safetensors" % step)
            write_safetensors(path, grads)
            ctl("step", "--job", "py", "--rank", "0", "--step", str(step), "--grads", path,
                "--out", os.path.join(tmp, "u%d.safetensors" % step), "--token-file", token_file)
            # DESIGN.md 3 step 1 in float32: M + (1 - beta)(G - M) (torch.lerp's formula for a
            # weight below 0.5), one rounding per operation.
            for name in momentum:
                momentum[name] = momentum[name] + w * (grads[name] - momentum[name])

        out = ctl("checkpoint", "save", "--job", "py", "--token-file", token_file)
        assert "generation 1 at step 3" in out, out
        gen = os.path.join(tmp, "state", "jobs", "py", "checkpoints", "gen-000000000001")
        tensors, meta, raw = read_safetensors(os.path.join(gen, "momentum.safetensors"))
        assert sorted(tensors) == sorted(momentum), tensors.keys()
        for name, want in momentum.items():
            got = tensors[name]
            assert got.shape == want.shape, (name, got.shape)
            assert got.tobytes() == want.tobytes(), (
                "%s: differs from the float32 EMA (max abs diff %g)"
                % (name, float(np.max(np.abs(got - want)))))
        assert meta.get("job_id") == "py" and meta.get("step") == "3", meta

        # torch reads the same bytes.
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        b, e = header["layers.0.w"]["data_offsets"]
        t = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=torch.float32).reshape(24, 40)
        assert torch.equal(t, torch.from_numpy(momentum["layers.0.w"].copy()))

        with open(os.path.join(gen, "manifest.json")) as f:
            manifest = json.load(f)
        assert manifest["format"] == "muond-checkpoint" and manifest["format_version"] == 1
        assert manifest["step"] == 3 and manifest["generation"] == 1
        assert manifest["job"]["job_id"] == "py"
        assert manifest["payload_bytes"] == len(raw)
        assert [t["name"] for t in manifest["tensors"]] == ["layers.0.w", "layers.0.v"]
        print("checkpoint payload: %d tensors bit-identical to the float32 EMA; %d bytes"
              % (len(tensors), len(raw)))
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(timeout=30)
        log.close()
        if rc != 0:
            print(open(os.path.join(tmp, "log")).read(), file=sys.stderr)
            raise SystemExit("muond exited %d" % rc)
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
