#!/usr/bin/python3
"""A small real workload for muond, driven through `muonctl`.

Trains three linear least-squares models (a wide, a tall and a square weight matrix) with Muon:
each step computes the gradients in NumPy, pushes them to muond with `muonctl step`, reads the
orthogonalized update back and applies W <- W*(1 - lr*wd) - lr*U. Prints per-step results; exits
non-zero if the daemon fails or the loss does not go down.

Usage: muonctl_regression.py --muonctl PATH [--address ADDR] [--steps N] [--job-id ID]
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np



def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise ValueError(f"{path}: tensor {name}: unexpected dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + begin:8 + n + end], dtype=np.float32).reshape(
            info["shape"])
    return out


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return proc.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--muonctl", required=True)
    ap.add_argument("--address", default="")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--job-id", default="quickstart-regression")
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    args = ap.parse_args()

    rng = np.random.default_rng(7)
    shapes = {"layer0.wide": (64, 256), "layer1.tall": (256, 64), "layer2.square": (96, 96)}
    problems = {}
    for name, (out_dim, in_dim) in shapes.items():
        x = rng.standard_normal((512, in_dim)).astype(np.float32)
        w_true = (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)
        y = x @ w_true.T + 0.01 * rng.standard_normal((512, out_dim)).astype(np.float32)
        problems[name] = (x, y, np.zeros((out_dim, in_dim), dtype=np.float32))

    ctl = [args.muonctl] + (["--address", args.address] if args.address else [])
    with tempfile.TemporaryDirectory(prefix="muond-quickstart-") as tmp:
        spec = {"job_id": args.job_id, "world_size": 1, "zero_stage": 0,
                "muon": {"momentum": 0.95, "nesterov": True, "ns_method": "standard",
                         "ns_steps": 5, "compute_dtype": "float32", "scale_mode": "original"},
                "matrices": [{"name": n, "shape": list(s), "num_heads": 1, "dtype": "float32"}
                             for n, s in shapes.items()]}
        spec_path = os.path.join(tmp, "job.json")
        token_path = os.path.join(tmp, "token")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        print(run(ctl + ["job", "create", "--spec", spec_path, "--token-file", token_path]).strip())
        losses = []
        try:
            for step in range(args.steps):
                grads, loss = {}, 0.0
                for name, (x, y, w) in problems.items():
                    err = x @ w.T - y
                    loss += 0.5 * float(np.mean(np.sum(err * err, axis=1)))
                    grads[name] = (err.T @ x) / x.shape[0]
                losses.append(loss)
                gpath, upath = os.path.join(tmp, "grads.safetensors"), os.path.join(tmp, "upd.safetensors")
                write_safetensors(gpath, grads)
                line = run(ctl + ["step", "--job", args.job_id, "--rank", "0", "--step", str(step),
                                  "--grads", gpath, "--out", upath, "--token-file", token_path])
                updates = read_safetensors(upath)
                norms = []
                for name, (x, y, w) in problems.items():
                    u = updates[name]
                    w *= (1.0 - args.lr * args.weight_decay)
                    w -= args.lr * u
                    norms.append(f"{name} |U|_2={np.linalg.norm(u, 2):.3f}")
                print(f"step {step}: loss {loss:.5f}  " + "  ".join(norms))
                print("    muonctl: " + line.strip())
            print(run(ctl + ["job", "show", "--job", args.job_id, "--token-file", token_path]))
        finally:
            run(ctl + ["job", "delete", "--job", args.job_id, "--token-file", token_path])
    if not losses[-1] < 0.5 * losses[0]:
        raise SystemExit(f"loss did not go down enough: {losses[0]:.5f} -> {losses[-1]:.5f}")
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f} over {args.steps} steps through muond")


if __name__ == "__main__":
    main()
