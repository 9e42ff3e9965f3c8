#!/usr/bin/python3
"""The model of stream_exact_test.py, and its worlds of two gloo ranks (torch.multiprocessing).

Usage: stream_exact_worker.py ADDRESS OUT_JSON PORT
Per case of CASES and mode (update, apply), two identical models on each rank train 3 steps on
the rank's own data, one with stream=False and one streaming in 4 KiB buckets over shared memory:
  - ddp_copy / ddp_view: the model in DistributedDataParallel (gradient_as_bucket_view False /
    True), MuonWithAuxAdam(reduce_gradients=False); DDP's reduction rewrites (copy) or reduces in
    place (view) every gradient after it was streamed, so every step falls back;
  - ddp_copy_route / ddp_view_route: the same through opt.stream_ddp(model) (DDP's reduced
    buckets streamed from its communication hook), against stream=False through the same hook:
    nothing falls back;
  - edit_rank0: no DDP, the optimizer reduces; rank 0 alone scales one gradient through .data at
    step 1: both ranks fall back on that step only;
  - clip: no DDP, max_grad_norm in muond (every step clips: the Muon matrices' share of the norm
    summed in the daemon over both ranks' partitions, the AdamW share from rank 0): nothing falls
    back, against stream=False with the same max_grad_norm.
Rank 0 writes, per run, whether every parameter came out with the same bits as stream=False, the
fallbacks it counted and the buckets that left during backward.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

VOCAB, WIDTH = 32, 48
STEPS = 3
# case: fallbacks expected (apply mode streams from step 1: step 0 uploads the weights first)
CASES = {"ddp_copy": STEPS, "ddp_view": STEPS, "ddp_copy_route": 0, "ddp_view_route": 0,
         "edit_rank0": 1, "clip": 0}
CLIP = 0.05  # case "clip": max_grad_norm in muond, below every step's norm


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    """16 tensors: an embedding, three pre-norm MLP blocks (6 Muon matrices), a norm, a head."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def batch(gen):
    return torch.randint(0, VOCAB, (8, 12), generator=gen)


def loss_of(model, tokens):
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ((tokens + 1) % VOCAB).reshape(-1))


def groups(model):
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    muon = [(n, p) for n, p in module.named_parameters() if p.dim() == 2 and ".fc" in n]
    rest = [(n, p) for n, p in module.named_parameters() if not (p.dim() == 2 and ".fc" in n)]
    return [dict(params=muon, use_muon=True, lr=0.05, weight_decay=0.1),
            dict(params=rest, use_muon=False, lr=0.01, weight_decay=0.01)]


def train(address, case, mode, stream, rank):
    import warnings
    from muon_offload import MuonWithAuxAdam
    net = Net(7)
    model = net
    if case.startswith("ddp"):
        model = nn.parallel.DistributedDataParallel(
            net, gradient_as_bucket_view=case.startswith("ddp_view"), bucket_cap_mb=0.01)
    opt = MuonWithAuxAdam(groups(model), address=address, mode=mode, stream=stream,
                          bucket_bytes=4096, reduce_gradients=not case.startswith("ddp"),
                          max_grad_norm=CLIP if case == "clip" else None)
    if case.endswith("_route"):
        opt.stream_ddp(model)  # with stream=False too: the same reduction, nothing streamed
    gen = torch.Generator().manual_seed(100 + rank)
    streamed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(STEPS):
            opt.zero_grad(set_to_none=True)
            sent = opt._stream.buckets_sent
            loss_of(model, batch(gen)).backward()
            streamed.append(opt._stream.buckets_sent - sent)
            if case == "edit_rank0" and rank == 0 and t == 1:
                net.blocks[1].fc2.weight.grad.data.mul_(0.5)
            opt.step()
    fallbacks = opt.stream_fallbacks
    opt.close(delete_job=True)
    return {n: p.detach().clone() for n, p in net.named_parameters()}, fallbacks, streamed


def run(rank, world, address, out, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = []
    for case, expected in CASES.items():
        for mode in ("update", "apply"):
            whole, _, _ = train(address, case, mode, False, rank)
            got, fallbacks, streamed = train(address, case, mode, True, rank)
            same = all(torch.equal(whole[n], got[n]) for n in whole)
            diff = max(float((whole[n] - got[n]).abs().max()) for n in whole)
            first = 1 if mode == "apply" else 0
            results.append({"case": case, "mode": mode, "rank": rank, "identical": same,
                            "max_diff": diff, "fallbacks": fallbacks,
                            "expected_fallbacks": min(expected, STEPS - first),
                            "streamed_before_step": streamed[first:]})
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        merged = []
        for per_rank in zip(*everyone):  # a run is identical only if it is on every rank
            r = dict(per_rank[0])
            r["identical"] = all(x["identical"] for x in per_rank)
            r["fallbacks_per_rank"] = [x["fallbacks"] for x in per_rank]
            if len(set(r["fallbacks_per_rank"])) != 1:
                r["fallbacks"] = -1  # the ranks disagree: never expected
            merged.append(r)
        with open(out, "w") as f:
            json.dump(merged, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    address, out, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mp.spawn(run, args=(2, address, out, port), nprocs=2, join=True)
