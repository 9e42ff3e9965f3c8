"""One rank of a soak or chaos job, in its own process: the driver (harness.py) sends JSON
commands on stdin, one a line, and reads one JSON answer a line on stdout.

  {"op": "attach", "address": A, "token": T}  -> {"ok": true, "next_step": n}
  {"op": "detach"}                            -> {"ok": true}
  {"op": "step", "step": t, "stall": s, "die": P} -> {"ok": true, "step": t, "hash": sha256 hex}
  {"op": "quit"}                              -> exits 0

A failed call answers {"ok": false, "code": "ABORTED", "message": ...}. A step's gradients are a
function of (job seed, step) only (the same full tensors on every rank, as after the trainer's
reduction): each rank sends its spans of them, so a replayed step sends the same bytes. The hash
covers this rank's elements of the result (update mode: its update slices; apply mode: its new
parameters), in span order. `stall` sleeps that many seconds after the gradients are written and
before they are submitted (a rank that stalls past the step timeout). `die` makes the rank SIGKILL
itself at that point of the step: "mid_write" (half of its spans written), "before_push" (all
written, not submitted) or "after_push" (the step returned, no answer sent).
"""
import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402

import muon_offload as mo  # noqa: E402
from muon_offload.zero import Partition, copy_into_buffer  # noqa: E402
from muon_offload import MuondError  # noqa: E402


def tensor_shapes(spec):
    return [tuple(t["shape"]) for t in spec.get("tensors", spec.get("matrices", []))]


def gradients(spec, seed, step):
    """The full gradients of step `step` of the job (float32), the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return [torch.randn(shape, generator=g).contiguous() for shape in tensor_shapes(spec)]


def hyper(spec, step):
    """Apply mode: (groups, lr, weight_decay) of step `step` (a cosine schedule of the lr)."""
    groups = spec["groups"]
    f = 0.5 + 0.5 * math.cos(step * 0.05)
    return ([g["name"] for g in groups], [g["lr"] * f for g in groups],
            [g["weight_decay"] for g in groups])


class Rank:
    def __init__(self, args):
        with open(args.spec) as f:
            self.spec = json.load(f)
        self.apply = self.spec.get("mode") == "apply"
        self.job = self.spec["job_id"]
        self.rank = args.rank
        self.transport = args.transport
        self.seed = args.seed
        self.client = None
        self.session = None

    def detach(self):
        if self.session is not None:
            try:
                self.session.close()
            except MuondError:
                pass  # the daemon may be gone: nothing to detach from
            self.session = None
        if self.client is not None:
            self.client.close()
            self.client = None
        return {"ok": True}

    def attach(self, address, token):
        self.detach()
        self.client = mo.Client(address)
        self.session = self.client.attach(self.job, self.rank, token, takeover=True,
                                          transport=self.transport)
        self.part = Partition(self.rank, self.session.spans, self.session.buffer_elements)
        return {"ok": True, "next_step": self.session.next_step,
                "shm": self.session.is_shm}

    def step(self, t, stall, die=None):
        s = self.session
        if s is None:
            return {"ok": False, "code": "FAILED_PRECONDITION", "message": "not attached"}
        grads = gradients(self.spec, self.seed, t)
        if self.apply:
            s.set_hyper(*hyper(self.spec, t))
        if s.is_shm:
            buf = s.gradient_view(t)
            buf.zero_()
            if die == "mid_write":
                half = self.part.spans[:max(1, len(self.part.spans) // 2)]
                copy_into_buffer(buf, Partition(self.rank, half, len(buf)), grads)
                _die()
            copy_into_buffer(buf, self.part, grads)
            if die == "before_push":
                _die()
            if stall:
                time.sleep(stall)
            s.step_in_place(t)
            out = s.update_view(t)
        else:
            buf = torch.zeros(s.buffer_elements, dtype=torch.float32)
            copy_into_buffer(buf, self.part, grads)
            out = torch.full((s.buffer_elements,), float("nan"), dtype=torch.float32)
            if die in ("mid_write", "before_push"):
                _die()
            if stall:
                time.sleep(stall)
            s.step_buffer(t, buf, out)
        if die == "after_push":
            _die()
        h = hashlib.sha256()
        for _, _, length, rank_offset in self.part.spans:
            h.update(out[rank_offset:rank_offset + length].numpy().tobytes())
        return {"ok": True, "step": t, "hash": h.hexdigest()}


def _die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--transport", choices=("shm", "grpc"), required=True)
    p.add_argument("--seed", type=int, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    r = Rank(args)
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "attach":
                out = r.attach(cmd["address"], cmd["token"])
            elif op == "detach":
                out = r.detach()
            elif op == "step":
                out = r.step(int(cmd["step"]), float(cmd.get("stall", 0)), cmd.get("die"))
            elif op == "quit":
                r.detach()
                return 0
            else:
                out = {"ok": False, "code": "INVALID_ARGUMENT", "message": f"unknown op {op}"}
        except MuondError as e:
            out = {"ok": False, "code": e.code_name, "message": e.message}
        print(json.dumps(out), flush=True)
    r.detach()
    return 0


if __name__ == "__main__":
    sys.exit(main())
