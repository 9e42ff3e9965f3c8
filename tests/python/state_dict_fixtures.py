#!/usr/bin/python3
"""The saved state_dicts of tests/data that load_state_dict_test.py's CompatTest loads: what a
MuonWithAuxAdam of an earlier release saved must load into the current one.

Usage: state_dict_fixtures.py MUOND_BIN LIBMUOND_CLIENT OUT_DIR
  Runs a tiny model (two Muon matrices, a bias and a norm for AdamW) two steps in update mode and
  in apply mode against a daemon of its own (one rank, shared memory) and writes, per mode:
    state_dict_v1_<mode>.pt        torch.save(opt.state_dict()) after step 1 (step_id 2): the
                                   AdamW state (update mode) and the job's state by tensor name
                                   ("muond_state", the daemon's export as bytes);
    state_dict_v1_<mode>_model.pt  {"params": the model's parameters then, "next": after one more
                                   step with grads(2)}, which the optimizer that loads the state
                                   must reproduce.
Regenerate only on purpose (a format change): the files stand for what users saved before.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

MODES = ("update", "apply")


def params(seed=7):
    """{name: Parameter}: two Muon matrices and two AdamW vectors, a few hundred elements."""
    torch.manual_seed(seed)
    return {"w1": torch.nn.Parameter(torch.randn(8, 6) / 3),
            "w2": torch.nn.Parameter(torch.randn(4, 8) / 3),
            "b1": torch.nn.Parameter(torch.randn(8) / 5),
            "norm": torch.nn.Parameter(torch.ones(4))}


def optimizer(mo, address, mode, job_id, ps):
    muon = [(n, ps[n]) for n in ("w1", "w2")]
    adam = [(n, ps[n]) for n in ("b1", "norm")]
    return mo.MuonWithAuxAdam([dict(params=muon, use_muon=True, lr=0.05, weight_decay=0.1),
                               dict(params=adam, use_muon=False, lr=0.01, betas=(0.9, 0.95),
                                    weight_decay=0.01)],
                              mode=mode, address=address, job_id=job_id, transport="shm")


def set_grads(ps, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in ps.values():
        p.grad = torch.randn(p.shape, generator=g)


def snapshot(ps):
    return {n: p.detach().clone() for n, p in ps.items()}


def run_daemon(muond, tmp):
    address = f"unix://{tmp}/muond.sock"
    proc = subprocess.Popen([muond, "--listen", address, "--state-dir", os.path.join(tmp, "state"),
                             "--threads", "1", "--metrics-address", "off"])
    return proc, address


def wait_healthy(mo, proc, address):
    deadline = time.time() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"muond exited {proc.returncode}")
        try:
            with mo.Client(address) as c:
                c.health(0.5)
            return
        except mo.MuondError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def main():
    muond, lib, out = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ["MUOND_CLIENT_LIB"] = lib
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    sys.path.insert(0, os.path.join(root, "client", "python"))
    import muon_offload as mo
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="muond-fixtures-") as tmp:
        proc, address = run_daemon(muond, tmp)
        try:
            wait_healthy(mo, proc, address)
            for mode in MODES:
                ps = params()
                opt = optimizer(mo, address, mode, f"fixture-{mode}", ps)
                for step in range(2):
                    set_grads(ps, step)
                    opt.step()
                # Saved before the next step: torch's state_dict() holds the live state's tensors.
                torch.save(opt.state_dict(), os.path.join(out, f"state_dict_v1_{mode}.pt"))
                model = {"params": snapshot(ps)}
                set_grads(ps, 2)
                opt.step()
                model["next"] = snapshot(ps)
                opt.close(delete_job=True)
                torch.save(model, os.path.join(out, f"state_dict_v1_{mode}_model.pt"))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
