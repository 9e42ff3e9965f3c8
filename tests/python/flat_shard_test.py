#!/usr/bin/python3
"""ZeRO stage 3 in the trainer: muon_offload.FlatShardOptimizer on ranks that hold only their
shard of a flat parameter and of its averaged gradient (FSDP use_orig_params=False's layout; torch
1.13's FSDP cannot be imported under Python 3.11, so the shards are built here as FSDP builds
them: the tensors flattened and concatenated in order, zero padded to a multiple of the world,
split evenly). Two gloo ranks, shared memory and gRPC: every step each rank's shard of the new
parameters is the reference's (ApplyReference on whole tensors with the averaged gradients); a
rank without a gradient makes every rank raise with nothing changed; a shard of the wrong size is
refused before anything is created.

Usage: flat_shard_test.py MUOND_BIN LIBMUOND_CLIENT [unittest names...]
"""
import os
import sys
import tempfile
import unittest

MUOND, LIB = sys.argv[1], sys.argv[2]
os.environ["MUOND_CLIENT_LIB"] = LIB
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import apply_harness as h  # noqa: E402
from apply_harness import MASTER_TOLERANCE, DaemonTest  # noqa: E402
from muon_offload import FlatShardOptimizer, MuondError  # noqa: E402

torch.set_num_threads(1)
DaemonTest.muond = MUOND
WORLD = 2
STEPS = 5
GROUPS = [{"lr": 0.02, "weight_decay": 0.1}, {"lr": 0.01, "weight_decay": 0.01}]
LR = {"group0": 0.02, "group1": 0.01}
WD = {"group0": 0.1, "group1": 0.01}


def model():
    """The flat parameter's tensors in order (model_tensors' reference dicts) and their
    FlatShardOptimizer descriptions."""
    tensors = [t for t in h.model_tensors(torch.float32) if t["name"] != "attn.w"]
    for t in tensors:
        t["group"] = "group0" if t["optimizer"] == "muon" else "group1"
    described = [{"name": t["name"], "shape": list(t["param"].shape),
                  "use_muon": t["optimizer"] == "muon"} for t in tensors]
    return tensors, described


def flat(values, world):
    """The tensors flattened, concatenated and zero padded to a multiple of `world`."""
    cat = torch.cat([v.reshape(-1) for v in values])
    per = -(-cat.numel() // world)
    return torch.nn.functional.pad(cat, (0, per * world - cat.numel())), per


class FlatShardTest(DaemonTest):

    def test_two_ranks_shm_and_grpc(self):
        import torch.multiprocessing as mp
        for transport in ("shm", "grpc"):
            with tempfile.TemporaryDirectory(prefix="flat-shard-") as tmp:
                mp.spawn(_rank, args=(self.daemon.address, tmp, transport), nprocs=WORLD,
                         join=True)
                result = torch.load(os.path.join(tmp, "result.pt"))
            for rank, errors in enumerate(result["errors"]):
                for step, err in enumerate(errors):
                    self.assertLessEqual(err, MASTER_TOLERANCE, f"{transport} rank {rank} "
                                                                f"step {step}")
            self.assertEqual(result["refused"], ["INVALID_ARGUMENT"] * WORLD, transport)
            self.assertEqual(result["unchanged"], [True] * WORLD, transport)
            self.assertEqual(result["step_ids"], [STEPS] * WORLD, transport)

    def test_a_shard_of_the_wrong_size_is_refused(self):
        _, described = model()
        wrong = torch.zeros(10)
        with self.assertRaises(ValueError) as e:
            FlatShardOptimizer(wrong, described, GROUPS, self.daemon.address)
        self.assertIn("a flat parameter of these tensors", str(e.exception))


def _rank(rank, address, tmp, transport):
    import torch.distributed as dist
    os.environ["MUOND_CLIENT_LIB"] = LIB
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=WORLD)
    try:
        tensors, described = model()
        whole, per = flat([t["param"] for t in tensors], WORLD)
        shard = torch.nn.Parameter(whole[rank * per:(rank + 1) * per].clone())
        opt = FlatShardOptimizer(shard, described, GROUPS, address, job_id=f"flat-{transport}",
                                 transport=transport)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 40.0)
        ref = h.reference_for(tensors)
        errors = []
        for step in range(STEPS):
            # Every rank's whole gradients, averaged as the sharded framework's reduce-scatter
            # does; this rank keeps its shard.
            per_rank = [h.gradients(tensors, step, r) for r in range(WORLD)]
            mean = [sum(g[i] for g in per_rank) / WORLD for i in range(len(tensors))]
            flat_mean, _ = flat(mean, WORLD)
            shard.grad = flat_mean[rank * per:(rank + 1) * per].clone()
            lr = {k: v * (1.0 - step / 40.0) for k, v in LR.items()}
            opt.step()
            sched.step()
            ref.step(mean, lr, WD)
            want, _ = flat(ref.masters, WORLD)
            errors.append(h.relative_error(shard.detach(), want[rank * per:(rank + 1) * per]))
        # Rank 1 without a gradient: both raise, nothing changes.
        before = shard.detach().clone()
        shard.grad = None if rank == 1 else torch.zeros_like(shard)
        try:
            opt.step()
            refused = "none"
        except MuondError as e:
            refused = e.code_name
        unchanged = torch.equal(shard.detach(), before) and opt.step_id == STEPS
        results = [None] * WORLD
        dist.all_gather_object(results, (errors, refused, unchanged, opt.step_id))
        opt.close(delete_job=True)
        if rank == 0:
            torch.save({"errors": [r[0] for r in results], "refused": [r[1] for r in results],
                        "unchanged": [r[2] for r in results],
                        "step_ids": [r[3] for r in results]}, os.path.join(tmp, "result.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[3:]])
