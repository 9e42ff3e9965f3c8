#!/usr/bin/python3
"""Unused parameters in apply mode: a parameter whose p.grad is None on every rank in a step is
skipped as torch.optim.AdamW skips it (no decay, no moment or momentum update, its step count
unchanged, the parameter untouched), through muond's presence mask; one whose gradient is None on
some ranks only counts as zeros there, as a reduce takes it. Compared with ApplyReference fed
None for the skipped tensors.

Usage: unused_params_test.py MUOND_BIN LIBMUOND_CLIENT [unittest names...]
  - SingleRankTest: p.grad set by hand (shm and gRPC), and a model whose forward skips a branch
    in some steps, streamed during backward (the mask guessed for the parts that leave during
    backward is wrong on the steps where it changes: those go whole).
  - DistributedTest: two gloo ranks, a tensor absent on one rank, then on both.
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
from apply_harness import GROUPS, MASTER_TOLERANCE, DaemonTest  # noqa: E402
from muon_offload import MuonWithAuxAdam  # noqa: E402

torch.set_num_threads(1)
DaemonTest.muond = MUOND
LR = {"group0": GROUPS["muon"]["lr"], "group1": GROUPS["adamw"]["lr"]}
WD = {"group0": GROUPS["muon"]["weight_decay"], "group1": GROUPS["adamw"]["weight_decay"]}
# Per step, the tensors without a gradient (model_tensors' names).
MASKS = [(), ("embed.w", "mlp.w"), ("mlp.w",), (), ("head.b", "attn.w"), ()]


def run_masks(test, opt, params, tensors, masks, grads_of):
    """Steps with the tensors of masks[t] left without a gradient; the parameters follow the
    reference's and a skipped one stays bit for bit. Returns the reference."""
    ref = h.reference_for(tensors, init=[t["param"].float() for t in tensors])
    for step, mask in enumerate(masks):
        grads = grads_of(step)
        before = {n: params[n].detach().clone() for n in mask}
        for (n, p), g in zip(params.items(), grads):
            p.grad = None if n in mask else g
        opt.step()
        ref.step([None if t["name"] in mask else g for t, g in zip(tensors, grads)], LR, WD)
        for t, m in zip(tensors, ref.masters):
            err = h.relative_error(params[t["name"]].detach(), m)
            test.assertLessEqual(err, MASTER_TOLERANCE, f"step {step} {t['name']}")
        for n in mask:
            test.assertTrue(torch.equal(params[n].detach(), before[n]), f"step {step}: {n} moved")
    return ref


class SingleRankTest(DaemonTest):

    def test_grad_none_is_skipped_shm_and_grpc(self):
        for transport in ("shm", "grpc"):
            params, kinds, tensors = h.optimizer_model(torch.float32)
            opt = h.apply_optimizer(params, kinds, address=self.daemon.address,
                                    job_id=f"unused-{transport}", transport=transport)
            ref = run_masks(self, opt, params, tensors, MASKS,
                            lambda step: h.gradients(tensors, step))
            self.assertEqual(opt.step_id, len(MASKS))
            path = self.daemon.path(f"unused-{transport}.safetensors")
            opt.export(path)
            self.assertMastersMatch(h.read_safetensors(path), ref, transport)
            opt.close(delete_job=True)

    def test_unused_branch_streamed_during_backward(self):
        torch.manual_seed(3)
        a = torch.nn.Linear(16, 24, bias=False)
        b = torch.nn.Linear(24, 24, bias=False)
        head = torch.nn.Linear(24, 4)
        named = {"a.w": a.weight, "b.w": b.weight, "head.w": head.weight, "head.b": head.bias}
        tensors = [{"name": n, "param": p.detach().clone(),
                    "optimizer": "muon" if n in ("a.w", "b.w") else "adamw",
                    "group": "group0" if n in ("a.w", "b.w") else "group1"} for n, p in
                   named.items()]
        ref = h.reference_for(tensors)
        opt = MuonWithAuxAdam([
            dict(params=[("a.w", a.weight), ("b.w", b.weight)], use_muon=True,
                 lr=LR["group0"], weight_decay=WD["group0"]),
            dict(params=[("head.w", head.weight), ("head.b", head.bias)], use_muon=False,
                 lr=LR["group1"], betas=h.ADAMW["betas"], eps=h.ADAMW["eps"],
                 weight_decay=WD["group1"])],
            mode="apply", address=self.daemon.address, job_id="unused-branch", transport="shm",
            bucket_bytes=1024)
        self.assertTrue(opt.stream)
        for step in range(6):
            x = torch.randn(8, 16)
            hidden = a(x)
            if step % 3 != 1:  # b unused on steps 1 and 4
                hidden = b(hidden)
            opt.zero_grad(set_to_none=True)
            head(torch.tanh(hidden)).square().mean().backward()
            self.assertEqual(b.weight.grad is None, step % 3 == 1)
            grads = [None if p.grad is None else p.grad.clone() for p in named.values()]
            opt.step()
            ref.step(grads, LR, WD)
            for t, m in zip(tensors, ref.masters):
                err = h.relative_error(named[t["name"]].detach(), m)
                self.assertLessEqual(err, MASTER_TOLERANCE, f"step {step} {t['name']}")
        opt.close(delete_job=True)


class DistributedTest(DaemonTest):

    def test_two_ranks(self):
        import json

        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory(prefix="unused-dist-") as tmp:
            mp.spawn(_rank, args=(self.daemon.address, tmp), nprocs=2, join=True)
            with open(os.path.join(tmp, "result.json")) as f:
                result = json.load(f)
        for step, errors in enumerate(result["errors"]):
            for name, err in errors.items():
                self.assertLessEqual(err, MASTER_TOLERANCE, f"step {step} {name}")
        self.assertTrue(result["skipped_unchanged"])
        self.assertTrue(result["ranks_agree"])


# Per step: {rank: tensors without a gradient on that rank}.
DIST_MASKS = [{}, {1: ("embed.w",)}, {0: ("mlp.w",), 1: ("mlp.w",)}, {0: ("head.b",)}, {}]


def _rank(rank, address, tmp):
    import json

    import torch.distributed as dist
    os.environ["MUOND_CLIENT_LIB"] = LIB
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        params, kinds, tensors = h.optimizer_model(torch.float32)
        opt = h.apply_optimizer(params, kinds, address=address, job_id="unused-dist",
                                zero_stage=2, transport="shm")
        ref = h.reference_for(tensors, init=[t["param"].float() for t in tensors])
        errors, unchanged = [], True
        for step, masks in enumerate(DIST_MASKS):
            per_rank = [h.gradients(tensors, step, r) for r in range(2)]
            mine = masks.get(rank, ())
            before = {n: params[n].detach().clone() for n in params}
            for (n, p), g in zip(params.items(), per_rank[rank]):
                p.grad = None if n in mine else g
            opt.step()
            summed = []
            for i, t in enumerate(tensors):
                present = [per_rank[r][i] for r in range(2) if t["name"] not in masks.get(r, ())]
                summed.append(sum(present[1:], present[0].clone()) if present else None)
            ref.step(summed, LR, WD, grad_divisor=2)
            errors.append({t["name"]: h.relative_error(params[t["name"]].detach(), m)
                           for t, m in zip(tensors, ref.masters)})
            for t, g in zip(tensors, summed):
                if g is None:
                    unchanged = unchanged and torch.equal(params[t["name"]].detach(),
                                                          before[t["name"]])
        sums = [None, None]
        dist.all_gather_object(sums, [float(p.detach().double().sum()) for p in params.values()])
        opt.close(delete_job=True)
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump({"errors": errors, "skipped_unchanged": unchanged,
                           "ranks_agree": sums[0] == sums[1]}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[3:]])
