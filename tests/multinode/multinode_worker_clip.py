#!/usr/bin/python3
"""Scenarios of multinode_worker.py for global clipping across nodes (clip) and routing on the
GPU (nccl); run by multinode_test.py through multinode_worker.py, whose helpers they use."""
import torch
import torch.distributed as dist

import muon_offload as mo
from muon_offload import MuondError
from multinode_worker import STEPS, make, model, same, set_grads, snapshot


CLIP_STEPS = 6
CLIP_SCALES = [0.5, 2.0, 0.5, 2.0, 2.0, 0.5]  # x the unscaled gradients' norm: clipped at 2.0


def clip_grads(params, adam, step):
    """The same gradients on every rank (reduce_gradients=False), scaled by CLIP_SCALES[step]."""
    set_grads(params, adam, step, 0)
    for p in list(params.values()) + list(adam.values()):
        p.grad.mul_(CLIP_SCALES[step])


def clip(cfg, rank):
    """Global clipping over the nodes (apply mode, max_grad_norm = the unscaled gradients' norm,
    so the steps scaled by 2 clip and those by 0.5 do not), stage 2 and stage 3 with the
    embedding split by rows: against ApplyReference (torch.nn.utils.clip_grad_norm_ over the
    whole model) and one daemon clipping by itself. Rank 0 also checks what a node job with
    max_grad_norm refuses: a step without the global clip (no coordinating client), and a global
    clip sent to a job that is not such a node."""
    result = {}
    for stage in (2, 3):
        params, adam = model("apply", big=True)
        set_grads(params, adam, 0, 0)
        max_norm = float(torch.linalg.vector_norm(torch.stack([
            torch.linalg.vector_norm(p.grad) for p in list(params.values()) + list(adam.values())])))
        tensors = [{"name": n, "param": p, "optimizer": "muon", "group": "muon"}
                   for n, p in params.items()]
        tensors += [{"name": n, "param": p, "optimizer": "adamw", "group": "adam"}
                    for n, p in adam.items()]
        ref = mo.ApplyReference(tensors, betas=(0.9, 0.95), eps=1e-8, max_grad_norm=max_norm)
        ref_norms = []
        for step in range(CLIP_STEPS):
            clip_grads(params, adam, step)
            ref.step([p.grad for p in list(params.values()) + list(adam.values())],
                     {"muon": 0.02, "adam": 0.003}, {"muon": 0.01, "adam": 0.01})
            ref_norms.append(ref.last_grad_norm)
        want = ref.params(torch.float32)
        runs = {}
        for multinode in (False, True):
            opt, params, adam = make(cfg, rank, stage, "apply", multinode,
                                     f"clip{int(multinode)}-s{stage}", big=True,
                                     max_grad_norm=max_norm, reduce_gradients=False)
            norms = []
            for step in range(CLIP_STEPS):
                clip_grads(params, adam, step)
                opt.step()
                norms.append(opt.last_grad_norm if multinode else None)
            runs[multinode] = snapshot(params, adam)
            if multinode:
                result[f"s{stage}"] = {"norms": norms, "ref_norms": ref_norms,
                                       "clipped_steps": opt.clipped_steps(),
                                       "split": [opt._routing.spec["tensors"][t]["name"]
                                                 for t in opt._routing.split_tensors()]}
            opt.close(delete_job=True)
        got = runs[True]
        result[f"s{stage}"].update({
            "max_diff_ref": max(float((a - b).abs().max()) for a, b in zip(got, want)),
            "max_diff_single": max(float((a - b).abs().max()) for a, b in zip(got, runs[False])),
            "bitwise_single": same(got, runs[False])})
    if rank == 0:
        result["refusals"] = clip_refusals(cfg)
    return result


def clip_refusals(cfg):
    """(code, message) of a step without the global clip on a node job with max_grad_norm, of
    one with a global clip on a job of one node, and of one with a bad global sum, over shared
    memory and over gRPC."""
    client = mo.Client(cfg["addresses"][0])
    out = {}
    cases = (("no_coordinator", True, 0, 0.0), ("not_a_node", False, 1, 0.0),
             ("bad_sum", True, 2, float("nan")))
    for transport in ("shm", "grpc"):
        for name, multinode, mode, total in cases:
            spec = {"job_id": f"refuse-{name}-{transport}", "mode": "apply", "world_size": 1,
                    "tensors": [{"name": "w", "shape": [8, 8], "optimizer": "muon",
                                 "group": "g"}],
                    "groups": [{"name": "g", "lr": 0.01}], "max_grad_norm": 1.0}
            if multinode:
                spec["multinode"] = {"global_job_id": "refuse", "node": 0, "nodes": 2}
            token = client.create_job(spec)
            s = client.attach(spec["job_id"], 0, token, transport=transport)
            s.init_params_buffer(torch.full((64,), 0.5), float32=True)
            s.set_hyper(["g"], [0.01])
            try:
                if mode:
                    s.set_global_clip(mode, total)
                s.step_buffer(0, torch.ones(64), torch.zeros(64))
                out[f"{name}-{transport}"] = ["OK", ""]
            except MuondError as e:
                out[f"{name}-{transport}"] = [e.code_name, e.message]
            s.close()
            client.delete_job(spec["job_id"], token)
    client.close()
    return out


def nccl(cfg, rank):
    """Routing on the GPU (an NCCL world, one rank per node, each on its own CUDA device, apply
    mode stage 2 with CUDA parameters and the embedding split by rows) against the same world
    routing host tensors through a gloo group of the same ranks with CPU parameters: the same
    bits every step (the gradients are already reduced: reduce_gradients=False)."""
    gloo = dist.new_group(backend="gloo")
    runs = {}
    for route in ("gloo", "nccl"):
        opt, params, adam = make(cfg, rank, 2, "apply", True, f"route-{route}", big=True,
                                 device="cuda" if route == "nccl" else None,
                                 reduce_gradients=False,
                                 process_group=gloo if route == "gloo" else None)
        out = []
        for step in range(STEPS):
            set_grads(params, adam, step, 0)
            for p in list(params.values()) + list(adam.values()):
                p.grad = p.grad.to(p.device)
            opt.step()
            out.append([p.detach().cpu() for p in snapshot(params, adam)])
        runs[route] = (out, str(opt._route_device))
        opt.close(delete_job=True)
    return {"bitwise_steps": sum(same(a, b) for a, b in zip(runs["nccl"][0], runs["gloo"][0])),
            "route_devices": [runs["gloo"][1], runs["nccl"][1]]}
