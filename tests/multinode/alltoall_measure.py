#!/usr/bin/python3
"""Measures the routing all-to-all of a multi-node job (DESIGN.md 4c) on this machine: gloo over
loopback, W ranks grouped into N emulated nodes, no daemon (the routing and the ownership plan
are the client library's, computed as the trainer computes them). For each model: the bytes each
rank sends per step (the formula of muon_offload/multinode.py, both all-to-alls) and the median
wall time of one forward all-to-all. The numbers of README "Scaling out" come from here.

Usage: alltoall_measure.py [--world 4] [--nodes 2] [--repeats 5] [--dtype bfloat16]
A measurement, not a test: it asserts nothing and is not run by ctest.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import muon_offload as mo  # noqa: E402
from muon_offload.zero import job_partitions  # noqa: E402
from muon_offload.multinode_plan import NodeRouting, ownership_plan  # noqa: E402
from muon_offload.rank_group import RankGroup  # noqa: E402


def tiny_gpt():
    """The Muon matrices of client/examples/train_tiny_gpt.py (d 128, 2 blocks)."""
    sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
    import train_tiny_gpt as t
    model = t.TinyGPT(96)
    return [(n, list(p.shape)) for n, p in t.param_groups(model, 0.02, 3e-3, 0)[0]["params"]]


def qwen3_06b():
    """Qwen3-0.6B-like: 28 layers, hidden 1024, 16 query and 8 key/value heads of 128, MLP 3072."""
    h, q, kv, mlp = 1024, 2048, 1024, 3072
    out = []
    for layer in range(28):
        p = f"layers.{layer}."
        out += [(p + "q", [q, h]), (p + "k", [kv, h]), (p + "v", [kv, h]), (p + "o", [h, q]),
                (p + "gate", [mlp, h]), (p + "up", [mlp, h]), (p + "down", [h, mlp])]
    return out


def measure(rank, world, nodes, models, dtype, repeats, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ranks = RankGroup()
    node_of = [q * nodes // world for q in range(world)]
    results = {}
    for name, shapes in models.items():
        spec = {"job_id": name, "world_size": world, "zero_stage": 2,
                "matrices": [{"name": n, "shape": s, "dtype": dtype} for n, s in shapes]}
        parts = job_partitions(spec)
        plan = ownership_plan(spec, nodes)
        r = NodeRouting(spec, parts, node_of, plan, rank)
        tdt = mo.client.TORCH_DTYPES[dtype]
        part = torch.ones(parts[rank].buffer_elements, dtype=tdt)
        send = r.gather_send(part).view(torch.uint8)
        recv = torch.empty(sum(r.recv_splits) * part.element_size(), dtype=torch.uint8)
        e = part.element_size()
        times = []
        for _ in range(repeats):
            ranks.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send, [n * e for n in r.recv_splits],
                                   [n * e for n in r.send_splits])
            times.append(time.perf_counter() - t0)
        elements = sum(x for _, s in shapes for x in [torch.Size(s).numel()])
        results[name] = {"elements": elements, "dtype": dtype,
                         "rank_bytes_per_step": e * (r.sent_elements_remote +
                                                     r.recv_elements_remote),
                         "forward_alltoall_seconds": statistics.median(times),
                         "node_flops": plan[1]}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    models = {"tiny_gpt": tiny_gpt(), "qwen3_0.6b_like": qwen3_06b()}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(measure, args=(args.world, args.nodes, models, args.dtype, args.repeats,
                                os.path.join(tmp, "store"), out), nprocs=args.world)
        with open(out) as f:
            per_rank = json.load(f)
    for name in models:
        rows = [r[name] for r in per_rank]
        print(f"{name}: {rows[0]['elements']} Muon elements ({args.dtype}), world {args.world}, "
              f"{args.nodes} nodes: bytes per rank per step (sent = received, both "
              f"all-to-alls) {[r['rank_bytes_per_step'] for r in rows]}; forward all-to-all "
              f"median {max(r['forward_alltoall_seconds'] for r in rows) * 1e3:.2f} ms "
              f"(slowest rank); NS GFLOP per node "
              f"{[round(f / 1e9, 1) for f in rows[0]['node_flops']]}")


if __name__ == "__main__":
    main()
