#!/usr/bin/python3
"""One world size of streaming_test.py's bit-identity check, as gloo ranks (torch.multiprocessing).

Usage: streaming_worker.py ADDRESS WORLD OUT_JSON PORT
For every ZeRO stage of the world size (1: 0; 2: 1, 2, 3; 4: 2, 3), both modes and both transports,
two identical models train 3 steps of 2 micro-batches (the first inside opt.accumulating()): one
with stream=False, one streaming in buckets of 2 KiB (each bucket a few tensors; the stage 1/2
partitions split matrices between ranks). Rank 0 writes, per configuration, whether every
parameter came out with the same bits, the largest difference, and the parts rank 0 posted
during backward (0 over gRPC, which sends the step whole).
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

STAGES = {1: [0], 2: [1, 2, 3], 4: [2, 3]}


def make_model():
    torch.manual_seed(11)
    return {"embed.w": torch.nn.Parameter(torch.randn(16, 24) / 4),
            "l1.w": torch.nn.Parameter(torch.randn(40, 24) / 5),
            "l1.b": torch.nn.Parameter(torch.zeros(40)),
            "l2.w": torch.nn.Parameter(torch.randn(40, 40) / 6),
            "l3.w": torch.nn.Parameter(torch.randn(24, 40) / 6),
            "head.w": torch.nn.Parameter(torch.randn(16, 24) / 5)}


def loss_of(m, tokens):
    x = m["embed.w"][tokens]
    x = torch.tanh(x @ m["l1.w"].t() + m["l1.b"])
    x = torch.tanh(x @ m["l2.w"].t())
    x = x @ m["l3.w"].t()
    logits = x @ m["head.w"].t()
    return torch.nn.functional.cross_entropy(logits, (tokens + 1) % 16)


def groups(m):
    muon = [(n, m[n]) for n in ("l1.w", "l2.w", "l3.w")]
    adam = [(n, m[n]) for n in ("embed.w", "l1.b", "head.w")]
    return [dict(params=muon, use_muon=True, lr=0.05, weight_decay=0.1),
            dict(params=adam, use_muon=False, lr=0.01, weight_decay=0.01)]


def train(address, stage, mode, transport, stream, rank):
    from muon_offload import MuonWithAuxAdam
    m = make_model()
    opt = MuonWithAuxAdam(groups(m), address=address, zero_stage=stage, transport=transport,
                          mode=mode, stream=stream, bucket_bytes=2048)
    early_parts = 0
    for step in range(3):
        for micro in range(2):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            tokens = torch.randint(0, 16, (32,), generator=g)
            ctx = opt.accumulating() if micro == 0 else contextlib.nullcontext()
            with ctx:
                loss_of(m, tokens).backward()
        if opt._stream is not None and opt._stream.armed:
            early_parts += opt._stream._posted  # parts that left during backward
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.close(delete_job=True)
    return {n: p.detach().clone() for n, p in m.items()}, early_parts


def run(rank, world, address, out, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = []
    for stage in STAGES[world]:
        for mode in ("update", "apply"):
            for transport in ("shm", "grpc"):
                whole, _ = train(address, stage, mode, transport, False, rank)
                streamed, early = train(address, stage, mode, transport, True, rank)
                same = all(torch.equal(whole[n], streamed[n]) for n in whole)
                diff = max(float((whole[n] - streamed[n]).abs().max()) for n in whole)
                moved = max(float((whole[n] - make_model()[n]).abs().max()) for n in whole)
                results.append({"world": world, "stage": stage, "mode": mode,
                                "transport": transport, "identical": same, "max_diff": diff,
                                "moved": moved, "early_parts": early})
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    address, world, out, port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    mp.spawn(run, args=(world, address, out, port), nprocs=world, join=True)
