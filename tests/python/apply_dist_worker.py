"""One rank of apply_mode_test.DistributedTest: MuonWithAuxAdam(mode="apply") over torch.distributed
(gloo) with the reference computed beside it on the ranks' summed gradients.

Four processes run every case on a group of the first N ranks (worlds 4, 3 and 2), then the
refusals on two ranks; rank 0 writes result.json with numbers only (the test asserts on them).
Every rank derives every rank's gradients from (step, rank), so the reference needs no
communication: it sums them in rank order in the parameters' dtype, as the package's
reduce-scatter does, and divides by the world size (the package's gradient divisor).
"""
import faulthandler
import json
import os
import sys
import zlib

import torch
import torch.distributed as dist

import apply_harness as h
from muon_offload import MuondError

STEPS = 12
# name, ranks, ZeRO stage, transport, dtype
CASES = [("w4-s2-shm-bf16", 4, 2, "shm", torch.bfloat16),
         ("w3-s1-grpc-f32", 3, 1, "grpc", torch.float32),
         ("w2-s3-shm-f32", 2, 3, "shm", torch.float32),
         ("w2-s2-shm-mixed", 2, 2, "shm", h.MIXED)]
CASE_NAMES = [c[0] for c in CASES]


def set_lr(opt, step):
    """A schedule set by hand, as an LR scheduler would: returns the groups' lr and wd."""
    f = 1.0 - step / 40.0
    opt.param_groups[0]["lr"] = h.GROUPS["muon"]["lr"] * f
    opt.param_groups[1]["lr"] = h.GROUPS["adamw"]["lr"] * f
    return ({"group0": opt.param_groups[0]["lr"], "group1": opt.param_groups[1]["lr"]},
            {"group0": opt.param_groups[0]["weight_decay"],
             "group1": opt.param_groups[1]["weight_decay"]})


def rank_gradients(tensors, step, rank, dtype):
    if dtype == h.MIXED:
        return h.param_gradients(tensors, step, rank)
    return h.gradients(tensors, step, rank, dtype)


def set_grads(params, tensors, step, rank, dtype):
    for p, g in zip(params.values(), rank_gradients(tensors, step, rank, dtype)):
        p.grad = g


def reference_step(ref, tensors, step, world, dtype, lr, wd):
    per_rank = [rank_gradients(tensors, step, r, dtype) for r in range(world)]
    if dtype == h.MIXED:  # the package sums a model of several dtypes in float32
        per_rank = [[g.float() for g in grads] for grads in per_rank]
    ref.step(h.summed(per_rank), lr, wd, grad_divisor=world)


def checksum(params):
    return [zlib.crc32(p.detach().float().numpy().tobytes()) for p in params.values()]


def ranks_agree(params, group, world):
    sums = [None] * world
    dist.all_gather_object(sums, checksum(params), group=group)
    return all(s == sums[0] for s in sums)


def run_case(name, group, world, stage, transport, dtype, address, tmp):
    params, kinds, tensors = h.optimizer_model(dtype)
    opt = h.apply_optimizer(params, kinds, address=address, job_id=f"dist-{name}",
                            process_group=group, zero_stage=stage, transport=transport)
    ref = h.reference_for(tensors, init=[t["param"].float() for t in tensors])
    rank = dist.get_rank(group)
    tolerance = h.MASTER_TOLERANCE if dtype == torch.float32 else 2.0 ** -8
    param_errors = []
    for step in range(STEPS):
        lr, wd = set_lr(opt, step)
        set_grads(params, tensors, step, rank, dtype)
        opt.step()
        reference_step(ref, tensors, step, world, dtype, lr, wd)
        param_errors.append({t["name"]: h.relative_error(params[t["name"]].detach(), m)
                             for t, m in zip(tensors, ref.masters)})
    path = os.path.join(tmp, f"{name}.safetensors")
    opt.export(path)
    masters = h.read_safetensors(path)
    bad, _ = h.bf16_rounding_mismatches([params[t["name"]].detach() for t in tensors], masters,
                                        ref)
    out = {"steps": opt.step_id, "tolerance": tolerance, "param_errors": param_errors,
           "master_errors": h.master_errors(masters, ref), "bf16_mismatches": bad,
           "ranks_agree": ranks_agree(params, group, world)}
    opt.close(delete_job=True)
    return out


def refused(opt, group):
    """opt.step() that must fail on every rank: (code_name, every rank's message joined)."""
    try:
        opt.step()
        error = None
    except MuondError as e:
        error = (e.code_name, e.message)
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if any(e is None for e in errors):
        return {"code_name": "none", "message": f"accepted on some rank: {errors}"}
    return {"code_name": errors[0][0], "message": " | ".join(e[1] for e in errors)}


def run_refusals(group, address):
    """Ranks disagreeing on lr, then a NaN on rank 1: refused on both ranks, nothing changes,
    and the trajectory goes on as the reference's."""
    dtype = torch.bfloat16
    params, kinds, tensors = h.optimizer_model(dtype)
    opt = h.apply_optimizer(params, kinds, address=address, job_id="dist-refusals",
                            process_group=group, zero_stage=2, transport="shm")
    ref = h.reference_for(tensors, init=[t["param"].float() for t in tensors])
    rank = dist.get_rank(group)
    out = {"unchanged": True}
    for step in range(4):
        lr, wd = set_lr(opt, step)
        if step == 2:
            before = {n: p.detach().clone() for n, p in params.items()}
            set_grads(params, tensors, step, rank, dtype)
            if rank == 1:
                opt.param_groups[0]["lr"] *= 2
            out["lr"] = refused(opt, group)
            set_lr(opt, step)
            if rank == 1:
                params["embed.w"].grad[0, 0] = float("nan")
            out["nan"] = refused(opt, group)
            same = all(torch.equal(p.detach(), before[n]) for n, p in params.items())
            out["unchanged"] = out["unchanged"] and same and opt.step_id == 2
        set_grads(params, tensors, step, rank, dtype)
        opt.step()
        reference_step(ref, tensors, step, 2, dtype, lr, wd)
        for t, m in zip(tensors, ref.masters):
            if h.relative_error(params[t["name"]].detach(), m) > 2.0 ** -8:
                out["unchanged"] = False
    out["ranks_agree"] = ranks_agree(params, group, 2)
    out["unchanged"] = out["unchanged"] and out["ranks_agree"]
    opt.close(delete_job=True)
    return out


def run(rank, world, address, tmp, lib):
    os.environ["MUOND_CLIENT_LIB"] = lib
    # A rank still running well past the usual few seconds prints where every thread is, so a
    # hang shows its stacks in the test's output before ctest's timeout kills it.
    faulthandler.dump_traceback_later(float(os.environ.get("MUOND_TEST_STACKS_AFTER_S", "120")),
                                      file=sys.stderr)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    result = {"cases": {}, "refusals": {}}
    try:
        for name, n, stage, transport, dtype in CASES:
            group = dist.new_group(list(range(n)))  # every process takes part in new_group
            if rank < n:
                result["cases"][name] = run_case(name, group, n, stage, transport, dtype, address,
                                                 tmp)
        pair = dist.new_group([0, 1])
        if rank < 2:
            result["refusals"] = run_refusals(pair, address)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_collectives(rank, world, tmp, lib):
    """zero.py's collectives on gloo for stage 2 and 3 layouts in float32 and bfloat16: the
    reduce-scatter gives each rank the rank-order sum of its partition, the all-gather puts every
    rank's partition back into whole tensors. Rank 0 writes collectives.json."""
    from muon_offload.zero import (all_gather_partition_buffers, copy_into_buffer,
                                   fill_world_buffer, job_partitions, reduce_scatter_partitions,
                                   scatter_world_buffer)
    os.environ["MUOND_CLIENT_LIB"] = lib
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-c", rank=rank,
                            world_size=world)
    checks = {}
    try:
        for stage in (2, 3):
            for dtype in (torch.float32, torch.bfloat16):
                tensors = h.model_tensors(dtype)
                spec = h.job_spec("collectives", tensors, dtype, world, stage)
                parts = job_partitions(spec)
                size = parts[0].buffer_elements
                per_rank = [h.gradients(tensors, 0, r, dtype) for r in range(world)]
                want = h.summed(per_rank)
                world_buffer = torch.zeros(world * size, dtype=dtype)
                fill_world_buffer(world_buffer, parts, per_rank[rank])
                mine = torch.full((size,), float("nan"), dtype=dtype)
                reduce_scatter_partitions(world_buffer, mine)
                expect = torch.zeros(size, dtype=dtype)
                copy_into_buffer(expect, parts[rank], want)
                ok_sum = torch.equal(mine, expect)
                gathered = torch.zeros(world * size, dtype=dtype)
                all_gather_partition_buffers(gathered, mine)
                out = [torch.zeros_like(t) for t in want]
                scatter_world_buffer(gathered, parts, out)
                ok_gather = all(torch.equal(a, b) for a, b in zip(out, want))
                checks[f"stage{stage}-{h.mo.client.DTYPE_NAMES[dtype]}"] = ok_sum and ok_gather
        results = [None] * world
        dist.all_gather_object(results, checks)
        if rank == 0:
            with open(os.path.join(tmp, "collectives.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
