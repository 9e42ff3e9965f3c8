"""One rank of multinode_test.py: a torch.distributed (gloo) world whose ranks are grouped into
emulated nodes, each node with its own muond (socket and state dir).

Usage: multinode_worker.py CONFIG.json RANK. CONFIG: world, nodes (global rank -> node), addresses
(one per node), single (the address of the daemon that serves the whole world as one node),
port, out (a directory), scenario, and the scenario's fields. Every rank writes
OUT/rank<R>.json with numbers only; the test asserts on them.

Scenarios:
  identical: for each case (stage, mode), 10 steps on the single daemon (MuonWithAuxAdam), then
    the same on the nodes (MultiNodeMuonWithAuxAdam): per step, is every parameter bit-identical;
    the measured and the formula's all-to-all bytes.
  fault: 6 steps uninterrupted on the single daemon (the reference), then on the nodes: a
    checkpoint after step 1, a fault in step 3 (see FAULTS), every rank's error, the nodes' next
    steps, then recovery (restart the daemon if killed, load_checkpoint, the trainer's own state
    back) and steps 2..5 again: bit-identical to the reference.
  reshard / reshard_resume: 2 nodes x 2 ranks export their state after 4 steps; 3 nodes x 2
    ranks created from the export continue: bit-identical to one daemon's uninterrupted run.
"""
import copy
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import muon_offload as mo  # noqa: E402
from muon_offload import MuondError  # noqa: E402

STEPS = 10
SHAPES = {"attn.q": (48, 32), "attn.o": (32, 48), "mlp.up": (64, 32), "mlp.down": (32, 64),
          "attn.k": (16, 32), "head.w": (24, 40)}
ADAM_SHAPES = {"embed": (40, 32), "norm": (32,), "bias": (64,)}
# An embedding whose AdamW state (6.3 MB) is more than a node's share: the ownership plan splits it
# by rows across the nodes (at least 1 MiB of state per piece).
BIG_EMBED = (1024, 512)


def model(mode, dtype=torch.float32, big=False):
    g = torch.Generator().manual_seed(11)
    params = {n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.2).to(dtype))
              for n, s in SHAPES.items()}
    shapes = dict(ADAM_SHAPES, embed=BIG_EMBED) if big else ADAM_SHAPES
    adam = {n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.2).to(dtype))
            for n, s in shapes.items()}
    return params, adam


def groups(params, adam):
    return [dict(params=list(params.items()), use_muon=True, lr=0.02, weight_decay=0.01),
            dict(params=list(adam.items()), use_muon=False, lr=0.003, weight_decay=0.01,
                 betas=(0.9, 0.95), eps=1e-8)]


def set_grads(params, adam, step, rank, poison=False):
    g = torch.Generator().manual_seed(1000 * step + rank)
    for i, p in enumerate(list(params.values()) + list(adam.values())):
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if poison and i == 0:
            p.grad.view(-1)[3] = float("nan")


def snapshot(params, adam):
    return [p.detach().clone() for p in list(params.values()) + list(adam.values())]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def make(cfg, rank, stage, mode, multinode, job_id, dtype=torch.float32, big=False,
         device=None, **kw):
    params, adam = model(mode, dtype, big)
    if device is not None:
        with torch.no_grad():
            for p in list(params.values()) + list(adam.values()):
                p.data = p.data.to(device)
    args = dict(zero_stage=stage, mode=mode, transport="shm", job_id=job_id)
    args.update(kw)
    if multinode:
        opt = mo.MultiNodeMuonWithAuxAdam(groups(params, adam), node_map=cfg["nodes"],
                                          address=cfg["addresses"][cfg["nodes"][rank]], **args)
    else:
        opt = mo.MuonWithAuxAdam(groups(params, adam), address=cfg["single"], **args)
    return opt, params, adam


def run_steps(opt, params, adam, rank, steps):
    out = []
    for step in steps:
        set_grads(params, adam, step, rank)
        opt.step()
        out.append(snapshot(params, adam))
    return out


def job_show(cfg, opt):
    """muonctl job show of this rank's node job (its global job and node lines)."""
    muonctl = os.path.join(os.path.dirname(cfg["daemons"][0]["argv"][0]), "muonctl")
    out = subprocess.run([muonctl, "--address", cfg["addresses"][opt._routing.node], "job",
                          "show", "--job", opt._routing.node_job_id], capture_output=True,
                         text=True, env=dict(os.environ, MUOND_JOB_TOKEN=opt.node_token))
    return [line for line in out.stdout.splitlines() if line.startswith(("global_job", "node:"))]


def identical(cfg, rank):
    result = {}
    cases = [(stage, mode, torch.float32, False) for stage in (1, 2, 3)
             for mode in ("update", "apply")]
    if cfg.get("bf16"):  # gloo moves no bfloat16: every collective sends its bytes
        cases += [(2, "apply", torch.bfloat16, False), (2, "update", torch.bfloat16, False)]
    # The embedding split by rows across the nodes (apply mode: AdamW in the daemons)
    cases += [(stage, "apply", torch.float32, True) for stage in (1, 3)]
    cases = [c + (None,) for c in cases]
    # The routing staged on the collective's device (what an NCCL group does on the GPU), here
    # on the host with gloo: every buffer through the staging copies.
    cases += [(2, "update", torch.float32, False, "cpu"), (3, "apply", torch.float32, True, "cpu")]
    for stage, mode, dtype, big, route in cases:
        name = (f"s{stage}-{mode}" + ("-bf16" if dtype == torch.bfloat16 else "")
                + ("-split" if big else "") + (f"-route-{route}" if route else ""))
        opt, params, adam = make(cfg, rank, stage, mode, False, f"single-{name}", dtype, big)
        want = run_steps(opt, params, adam, rank, range(STEPS))
        opt.close(delete_job=True)
        extra = {"route_device": route} if route else {}
        opt, params, adam = make(cfg, rank, stage, mode, True, f"multi-{name}", dtype, big,
                                 **extra)
        got = run_steps(opt, params, adam, rank, range(STEPS))
        result[name] = {"bitwise_steps": sum(same(a, b) for a, b in zip(got, want)),
                        "route_device": str(opt._route_device),
                        "split": [opt._routing.spec["tensors"][t]["name"]
                                  for t in opt._routing.split_tensors()]
                        if mode == "apply" else [],
                        "bytes": list(opt.bytes_per_step()),
                        "expected_bytes": list(opt.expected_bytes()),
                        "nodes": opt.nodes, "global_job": opt.global_job_id,
                        "node": opt._routing.node, "job_show": job_show(cfg, opt)}
        opt.close(delete_job=True)
    return result


def wait_gone(pid, timeout=60):
    """Waits until process `pid` has exited (a zombie counts: its parent reaps it later)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise RuntimeError(f"process {pid} did not exit in {timeout} s")


def restart_daemon(cfg, node):
    d = cfg["daemons"][node]
    wait_gone(d["pid"])  # a daemon stopping with SIGTERM saves its state first
    subprocess.Popen(d["argv"], stderr=open(d["log"], "ab"), start_new_session=True)
    deadline = time.time() + 30
    while True:
        try:
            with mo.Client(cfg["addresses"][node]) as c:
                c.health(0.5)
            return
        except MuondError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def inject(cfg, opt, rank, fault):
    """Arms `fault` for the next step: on the first rank of node 1 (global rank `victim`)."""
    s = opt.session
    real = s.step_in_place
    if fault == "daemon_kill":
        def hook(step):
            os.kill(cfg["daemons"][1]["pid"], signal.SIGKILL)
            time.sleep(0.5)
            return real(step)
    elif fault == "timeout":
        def hook(step):
            time.sleep(cfg["timeout_sleep"])  # past node 1's --step-timeout-seconds
            return real(step)
    else:
        return
    s.step_in_place = hook


def fault(cfg, rank):
    mode, stage, kind = cfg["mode"], cfg["stage"], cfg["fault"]
    victim = cfg["nodes"].index(1)  # node 1's first rank
    opt, params, adam = make(cfg, rank, stage, mode, False, f"ref-{kind}")
    want = run_steps(opt, params, adam, rank, range(6))
    opt.close(delete_job=True)
    opt, params, adam = make(cfg, rank, stage, mode, True, f"multi-{kind}")
    run_steps(opt, params, adam, rank, range(2))
    saved = opt.save_checkpoint()
    sd = copy.deepcopy(opt.state_dict())  # torch.optim's state_dict aliases the live state
    trainer = snapshot(params, adam)
    run_steps(opt, params, adam, rank, [2])
    before = opt.step_id
    if rank == victim:
        inject(cfg, opt, rank, kind)
    set_grads(params, adam, 3, rank, poison=(kind == "nonfinite" and rank == victim))
    lrs = [g["lr"] for g in opt.param_groups]
    if kind == "lr_disagree" and cfg["nodes"][rank] == 1:
        # Both ranks of node 1 (so its daemon sees its ranks agree) send twice the lr.
        for g in opt.param_groups:
            g["lr"] *= 2
    error = None
    start = time.time()
    try:
        opt.step()
    except MuondError as e:
        error = {"code": e.code_name, "message": e.message}
    seconds = time.time() - start
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    unchanged = opt.step_id == before
    if kind in ("daemon_kill", "commit_window") and rank == victim:
        restart_daemon(cfg, 1)
    dist.barrier()
    # Did this node's daemon commit the step? A commit of it now answers OK only if it was
    # committed, or still prepared (then the abort failed): both are wrong.
    committed = None
    if opt._routing.local_rank == 0:
        try:
            opt._two_phase.commit(before)
            committed = True
        except MuondError as e:
            committed = e.code_name + ": " + e.message
    dist.barrier()
    # Recovery: the daemons' state from the checkpoint, the trainer's from its own copy.
    for p, t in zip(list(params.values()) + list(adam.values()), trainer):
        p.data.copy_(t)
    next_step = opt.load_state_dict(sd)
    got = run_steps(opt, params, adam, rank, range(2, 6))
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, error and error["message"])
    result = {"error": error, "same_error_everywhere": len(set(messages)) == 1,
              "seconds": seconds,
              "node_commit_probe": committed,
              "unchanged_step": unchanged, "resumed_at": next_step,
              "saved_step": saved["next_step"],
              "bitwise_after_recovery": sum(same(a, b) for a, b in zip(got, want[2:]))}
    opt.close(delete_job=True)
    return result


def rank_kill(cfg, rank):
    """Phase 1 of the dead-rank case: the reference, then the nodes until node 1's first rank
    SIGKILLs itself inside step 3 (after the forward all-to-all, before pushing to its daemon).
    The survivors' errors and what phase 2 needs (tokens, state_dict, the trainer's state) are
    saved."""
    mode, stage = cfg["mode"], cfg["stage"]
    victim = cfg["nodes"].index(1)
    opt, params, adam = make(cfg, rank, stage, mode, False, "ref-rank-kill")
    want = run_steps(opt, params, adam, rank, range(6))
    opt.close(delete_job=True)
    opt, params, adam = make(cfg, rank, stage, mode, True, "multi-rank-kill")
    run_steps(opt, params, adam, rank, range(2))
    opt.save_checkpoint()
    torch.save({"want": want, "sd": copy.deepcopy(opt.state_dict()),
                "trainer": snapshot(params, adam), "tokens": opt.node_tokens},
               os.path.join(cfg["out"], f"state{rank}.pt"))
    run_steps(opt, params, adam, rank, [2])
    before = opt.step_id
    if rank == victim:
        opt.session.step_in_place = lambda step: os.kill(os.getpid(), signal.SIGKILL)
    set_grads(params, adam, 3, rank)
    error = None
    try:
        opt.step()
    except MuondError as e:
        error = {"code": e.code_name, "message": e.message}
    return {"error": error, "unchanged_step": opt.step_id == before}


def rank_kill_resume(cfg, rank):
    """Phase 2: a new world attaches to the existing node jobs (their tokens), loads the
    checkpoint and runs steps 2..5: bit-identical to the reference?"""
    saved = torch.load(os.path.join(cfg["out"], f"state{rank}.pt"))
    opt, params, adam = make(cfg, rank, cfg["stage"], cfg["mode"], True, "multi-rank-kill",
                             token=saved["tokens"], takeover=True)
    for p, t in zip(list(params.values()) + list(adam.values()), saved["trainer"]):
        p.data.copy_(t)
    resumed = opt.load_state_dict(saved["sd"])
    got = run_steps(opt, params, adam, rank, range(2, 6))
    result = {"resumed_at": resumed,
              "bitwise_after_recovery": sum(same(a, b) for a, b in zip(got, saved["want"][2:]))}
    opt.close(delete_job=True)
    return result


RESHARD_STEPS, RESHARD_AT = 8, 4
RESHARD_CASES = [(2, "update"), (3, "apply")]


def _pieces(opt):
    """The embedding's row ranges by node: [[first row, end row, node]]."""
    r = opt._routing
    names = [t["name"] for t in r.spec.get("tensors", r.spec.get("matrices"))]
    return [[b, e, n] for t, b, e, n in r.units if names[t] == "embed"]


def reshard(cfg, rank):
    """Phase 1 of re-sharding (2 nodes x 2 ranks): the reference (one daemon, 8 steps
    uninterrupted), then the nodes for 4 steps, export_state into one directory per case, the
    trainer's own state saved for phase 2. The gradients are the same on every rank (already
    reduced, reduce_gradients=False), so the trajectory does not depend on the world size."""
    result = {}
    for stage, mode in RESHARD_CASES:
        name = f"s{stage}-{mode}"
        big = mode == "apply"  # the embedding split by rows: 2 pieces here, 3 after
        opt, params, adam = make(cfg, rank, stage, mode, False, f"ref-reshard-{name}",
                                 big=big, reduce_gradients=False)
        want = run_steps(opt, params, adam, 0, range(RESHARD_STEPS))
        opt.close(delete_job=True)
        opt, params, adam = make(cfg, rank, stage, mode, True, f"reshard2-{name}",
                                 big=big, reduce_gradients=False)
        got = run_steps(opt, params, adam, 0, range(RESHARD_AT))
        exported = opt.export_state(os.path.join(cfg["export_root"], name))
        torch.save({"want": want, "sd": copy.deepcopy(opt.state_dict()),
                    "trainer": snapshot(params, adam)},
                   os.path.join(cfg["out"], f"reshard-{name}-{rank}.pt"))
        result[name] = {"bitwise_before": sum(same(a, b) for a, b in zip(got, want)),
                        "exported": exported, "pieces": _pieces(opt)}
        opt.close(delete_job=True)  # the export stands on its own
    return result


def reshard_resume(cfg, rank):
    """Phase 2 (3 nodes x 2 ranks): node jobs created from the export (import_dir), the
    trainer's state loaded, steps 4..7: bit-identical to the uninterrupted reference?"""
    result = {}
    for stage, mode in RESHARD_CASES:
        name = f"s{stage}-{mode}"
        saved = torch.load(os.path.join(cfg["out"], f"reshard-{name}-{rank % 4}.pt"))
        export_dir = os.path.join(cfg["export_root"], name)
        opt, params, adam = make(cfg, rank, stage, mode, True, f"reshard3-{name}",
                                 big=mode == "apply", reduce_gradients=False,
                                 import_dir=export_dir)
        for p, t in zip(list(params.values()) + list(adam.values()), saved["trainer"]):
            p.data.copy_(t)
        resumed = opt.load_state_dict(saved["sd"])
        got = run_steps(opt, params, adam, 0, range(RESHARD_AT, RESHARD_STEPS))
        result[name] = {"resumed_at": resumed, "nodes": opt.nodes, "pieces": _pieces(opt),
                        "files": sorted(os.listdir(export_dir)),
                        "bitwise_after": sum(same(a, b) for a, b in
                                             zip(got, saved["want"][RESHARD_AT:]))}
        opt.close(delete_job=True)
    return result


def main():
    cfg = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg["port"])
    torch.set_num_threads(1)
    backend = cfg.get("backend", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=cfg["world"],
                            timeout=timedelta(seconds=cfg.get("pg_timeout", 120)))
    from multinode_worker_clip import clip, nccl  # noqa: E402 (they use this module)
    try:
        result = {"identical": identical, "fault": fault, "rank_kill": rank_kill,
                  "rank_kill_resume": rank_kill_resume, "reshard": reshard,
                  "reshard_resume": reshard_resume, "clip": clip, "nccl": nccl}[cfg["scenario"]](cfg, rank)
    except Exception as e:  # reported in the rank's file, then the rank fails
        result = {"exception": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(0 if "exception" not in result else 1)


if __name__ == "__main__":
    main()
