#!/usr/bin/python3
"""MuonWithAuxAdam as torch.optim code expects it: state_dict() at any time, load_state_dict()
across jobs, and LR schedulers.

Usage: state_anytime_test.py MUOND_BIN LIBMUOND_CLIENT [unittest names...]
  - StateDictTest: state_dict() between any two steps (no save_checkpoint() first) returns the
    job's state by tensor name, which torch.save/torch.load keep; loading it back into the same
    job, into a job of another id, and into a job of another ZeRO stage continues the same
    trajectory bit for bit; a state that does not fit the job is refused with the job left as it
    was (its next steps are those it would have taken); update mode's AdamW state travels too;
    a world-1 job's state continues in a world-2 job of two gloo ranks.
  - FrozenTest: parameters with requires_grad=False are not job tensors (apply and update
    mode): they never change and the others follow the reference of a model without them.
  - SchedulerTest: LambdaLR (cosine with warm-up), OneCycleLR and StepLR on apply mode: the lr
    (and a weight decay changed between steps) each group holds at step() are the ones used,
    against the in-process reference.
"""
import io
import math
import os
import sys
import unittest

MUOND, LIB = sys.argv[1], sys.argv[2]
os.environ["MUOND_CLIENT_LIB"] = LIB
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import apply_harness as h  # noqa: E402
from apply_harness import (GROUPS, MASTER_TOLERANCE, DaemonTest, apply_optimizer,  # noqa: E402
                           optimizer_model)
from muon_offload import MuondError, MuonWithAuxAdam  # noqa: E402

torch.set_num_threads(1)
DaemonTest.muond = MUOND


def roundtrip(sd):
    """What torch.save then torch.load give back."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


class StateDictTest(DaemonTest):
    def step(self, opt, params, tensors, t):
        for p, g in zip(params.values(), h.gradients(tensors, t)):
            p.grad = g
        opt.step()

    def trajectory_then_state(self, job_id, **kw):
        """3 steps, the state_dict (by name), then 2 more steps recorded."""
        params, kinds, tensors = optimizer_model(torch.float32)
        opt = apply_optimizer(params, kinds, address=self.daemon.address, job_id=job_id, **kw)
        for t in range(3):
            self.step(opt, params, tensors, t)
        at3 = {n: p.detach().clone() for n, p in params.items()}
        sd = roundtrip(opt.state_dict())
        self.assertIn("muond_state", sd)
        self.assertNotIn("muond", sd)
        self.assertEqual(sd["muond_state"]["next_step"], 3)
        self.assertEqual(sd["muond_state"]["job_id"], job_id)
        after = []
        for t in range(3, 5):
            self.step(opt, params, tensors, t)
            after.append({n: p.detach().clone() for n, p in params.items()})
        self.params, self.tensors = params, tensors
        return opt, at3, sd, after

    def continue_in(self, opt_kw, job_id, at3, sd, after):
        params, kinds, tensors = optimizer_model(torch.float32)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(at3[n])
        opt = apply_optimizer(params, kinds, address=self.daemon.address, job_id=job_id,
                              **opt_kw)
        opt.load_state_dict(sd)
        self.assertEqual(opt.step_id, 3)
        for i, t in enumerate(range(3, 5)):
            self.step(opt, params, tensors, t)
            for n, p in params.items():
                self.assertTrue(torch.equal(p.detach(), after[i][n]),
                                f"{job_id} step {t} {n}: max diff "
                                f"{(p.detach() - after[i][n]).abs().max()}")
        return opt

    def test_same_job_any_time(self):
        opt, at3, sd, after = self.trajectory_then_state("sd-same")
        params, tensors = self.params, self.tensors
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(at3[n])
        opt.load_state_dict(sd)
        self.assertEqual(opt.step_id, 3)
        for i, t in enumerate(range(3, 5)):
            self.step(opt, params, tensors, t)
            for n, p in params.items():
                self.assertTrue(torch.equal(p.detach(), after[i][n]), f"step {t} {n}")
        opt.close(delete_job=True)

    def test_another_job_id_and_zero_stage(self):
        opt, at3, sd, after = self.trajectory_then_state("sd-from")
        opt.close(delete_job=True)
        other = self.continue_in({}, "sd-other-id", at3, sd, after)
        other.close(delete_job=True)
        staged = self.continue_in({"zero_stage": 3}, "sd-stage3", at3, sd, after)
        self.assertEqual(staged.spec["zero_stage"], 3)
        staged.close(delete_job=True)

    def test_another_world_size(self):
        """A world-1 job's state loaded by two gloo ranks (a world-2 ZeRO-2 job of another id):
        both ranks give the world-1 gradient, so the mean is the same, and the trajectory goes on
        bit for bit."""
        import tempfile

        import torch.multiprocessing as mp
        opt, at3, sd, after = self.trajectory_then_state("sd-world1")
        opt.close(delete_job=True)
        with tempfile.TemporaryDirectory(prefix="sd-world2-") as tmp:
            torch.save({"at3": at3, "sd": sd, "after": after}, os.path.join(tmp, "in.pt"))
            mp.spawn(_world2_rank, args=(self.daemon.address, tmp), nprocs=2, join=True)
            result = torch.load(os.path.join(tmp, "out.pt"))
        self.assertEqual(result["step_id"], [5, 5])
        self.assertEqual(result["mismatches"], [], "steps 3-4 differ from the world-1 job's")

    def test_a_state_that_does_not_fit_leaves_the_job(self):
        opt, at3, sd, after = self.trajectory_then_state("sd-misfit-src")
        opt.close(delete_job=True)
        # A job of another model (one tensor renamed) refuses the state and keeps its own.
        params, kinds, tensors = optimizer_model(torch.float32)
        first = next(iter(params))
        params = {("renamed." + n if n == first else n): p for n, p in params.items()}
        kinds = {("renamed." + n if n == first else n): k for n, k in kinds.items()}
        opt = apply_optimizer(params, kinds, address=self.daemon.address, job_id="sd-misfit")
        twin_params, twin_kinds, _ = optimizer_model(torch.float32)
        twin_params = {("renamed." + n if n == first else n): p for n, p in twin_params.items()}
        twin_kinds = {("renamed." + n if n == first else n): k for n, k in twin_kinds.items()}
        twin = apply_optimizer(twin_params, twin_kinds, address=self.daemon.address,
                               job_id="sd-misfit-twin")
        for t in range(2):
            self.step(opt, params, tensors, t)
            self.step(twin, twin_params, tensors, t)
        with self.assertRaises(MuondError) as e:
            opt.load_state_dict(sd)
        self.assertIn("restored", e.exception.message)
        self.assertEqual(opt.step_id, 2)
        for t in range(2, 4):
            self.step(opt, params, tensors, t)
            self.step(twin, twin_params, tensors, t)
        for n in params:
            self.assertTrue(torch.equal(params[n].detach(), twin_params[n].detach()), n)
        opt.close(delete_job=True)
        twin.close(delete_job=True)

    def test_compressed_state_travels_as_held(self):
        """int8 momentum and AdamW moments (apply mode): state_dict() holds them as the job does
        (the manifest says int8, linear for the momentum and exp_avg, log for exp_avg_sq; the
        payload about a quarter of the float32 export's for those arrays), and loading it into a
        job of another id and ZeRO stage with the same dtypes continues bit for bit; a job holding
        fp32 state takes it too (converted) and steps on."""
        import json
        held = {"momentum_dtype": "int8", "adamw_state_dtype": "int8"}
        opt, at3, sd, after = self.trajectory_then_state("sd-held", **held)
        files = sd["muond_state"]["files"]
        manifest = json.loads(files["sd-held.manifest.json"])
        maps = {t["name"].split("/")[0]: (t["dtype"], t.get("map")) for t in manifest["tensors"]}
        self.assertEqual(maps["master"], ("float32", None))
        self.assertEqual(maps["momentum"], ("int8", "linear"))
        self.assertEqual(maps["exp_avg"], ("int8", "linear"))
        self.assertEqual(maps["exp_avg_sq"], ("int8", "log"))
        import tempfile
        with tempfile.TemporaryDirectory(prefix="sd-held-f32-") as tmp:
            opt._job.client.export_state(opt._job.job_id, opt._job.token, tmp, dtype="float32")
            with open(os.path.join(tmp, "sd-held.manifest.json")) as f:
                f32 = json.load(f)
            self.assertEqual({t["dtype"] for t in f32["tensors"]}, {"float32"})
            with self.assertRaises(MuondError) as e:
                opt._job.client.export_state(opt._job.job_id, opt._job.token, tmp, dtype="fp8")
            self.assertIn("state export dtype 'fp8'", e.exception.message)

        def moment_bytes(m):
            return sum(t["data_offsets"][1] - t["data_offsets"][0] for t in m["tensors"]
                       if not t["name"].startswith("master/"))
        self.assertLess(moment_bytes(manifest), moment_bytes(f32) * 0.26)
        opt.close(delete_job=True)
        other = self.continue_in(dict(held, zero_stage=3), "sd-held-2", at3, sd, after)
        self.assertEqual(other.spec["state"], {"momentum_dtype": "int8", "adamw_dtype": "int8"})
        other.close(delete_job=True)
        params, kinds, tensors = optimizer_model(torch.float32)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(at3[n])
        fp32 = apply_optimizer(params, kinds, address=self.daemon.address, job_id="sd-held-f32")
        fp32.load_state_dict(sd)
        self.assertEqual(fp32.step_id, 3)
        for t in range(3, 5):
            self.step(fp32, params, tensors, t)
        for n, p in params.items():
            self.assertTrue(torch.isfinite(p).all(), n)
            # The converted state is the same state: the next steps land near the int8 job's.
            self.assertLess((p.detach() - after[-1][n]).abs().max().item(), 1e-2, n)
        fp32.close(delete_job=True)

    def test_update_mode_carries_adamw_state(self):
        def make(job_id):
            torch.manual_seed(5)
            w = torch.nn.Parameter(torch.randn(24, 16))
            b = torch.nn.Parameter(torch.randn(16))
            opt = MuonWithAuxAdam([dict(params=[("w", w)], use_muon=True, lr=0.02),
                                   dict(params=[("b", b)], use_muon=False, lr=1e-2)],
                                  address=self.daemon.address, job_id=job_id)
            return opt, w, b

        def step(opt, w, b, t):
            g = torch.Generator().manual_seed(t)
            w.grad = torch.randn(24, 16, generator=g)
            b.grad = torch.randn(16, generator=g)
            opt.step()

        opt, w, b = make("sd-update")
        for t in range(3):
            step(opt, w, b, t)
        at3 = (w.detach().clone(), b.detach().clone())
        sd = roundtrip(opt.state_dict())
        self.assertIn("muond_state", sd)
        after = []
        for t in range(3, 5):
            step(opt, w, b, t)
            after.append((w.detach().clone(), b.detach().clone()))
        opt.close(delete_job=True)
        opt2, w2, b2 = make("sd-update-2")
        with torch.no_grad():
            w2.copy_(at3[0])
            b2.copy_(at3[1])
        opt2.load_state_dict(sd)
        self.assertEqual(opt2.state[b2]["step"], 3)
        for i, t in enumerate(range(3, 5)):
            step(opt2, w2, b2, t)
            self.assertTrue(torch.equal(w2.detach(), after[i][0]), f"step {t} w")
            self.assertTrue(torch.equal(b2.detach(), after[i][1]), f"step {t} b")
        opt2.close(delete_job=True)


def warmup_cosine(warmup, total):
    def f(s):
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))
    return f


def _world2_rank(rank, address, tmp):
    """Rank `rank` of StateDictTest.test_another_world_size."""
    import torch.distributed as dist
    os.environ["MUOND_CLIENT_LIB"] = LIB
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        data = torch.load(os.path.join(tmp, "in.pt"))
        params, kinds, tensors = optimizer_model(torch.float32)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(data["at3"][n])
        opt = apply_optimizer(params, kinds, address=address, job_id="sd-world2", zero_stage=2)
        opt.load_state_dict(data["sd"])
        mismatches = []
        for i, t in enumerate(range(3, 5)):
            for p, g in zip(params.values(), h.gradients(tensors, t)):
                p.grad = g
            opt.step()
            mismatches += [f"step {t} {n}" for n, p in params.items()
                           if not torch.equal(p.detach(), data["after"][i][n])]
        results = [None, None]
        dist.all_gather_object(results, (opt.step_id, mismatches))
        opt.close(delete_job=True)
        if rank == 0:
            torch.save({"step_id": [r[0] for r in results],
                        "mismatches": sum((r[1] for r in results), [])},
                       os.path.join(tmp, "out.pt"))
    finally:
        dist.destroy_process_group()


class SchedulerTest(DaemonTest):
    STEPS = 8

    def run_with(self, name, make_scheduler):
        params, kinds, tensors = optimizer_model(torch.float32)
        opt = apply_optimizer(params, kinds, address=self.daemon.address, job_id=name)
        sched = make_scheduler(opt)
        ref = h.reference_for(tensors, init=[t["param"].float() for t in tensors])
        lrs_seen = []
        for step in range(self.STEPS):
            if step == 5:  # a weight decay changed between steps is used from then on
                opt.param_groups[1]["weight_decay"] = 0.05
            lrs = {"group0": opt.param_groups[0]["lr"], "group1": opt.param_groups[1]["lr"]}
            wds = {"group0": opt.param_groups[0]["weight_decay"],
                   "group1": opt.param_groups[1]["weight_decay"]}
            lrs_seen.append(lrs["group0"])
            grads = h.gradients(tensors, step)
            for p, g in zip(params.values(), grads):
                p.grad = g
            opt.step()
            sched.step()
            ref.step(grads, lrs, wds)
            for t, m in zip(tensors, ref.masters):
                self.assertLessEqual(h.relative_error(params[t["name"]].detach(), m),
                                     MASTER_TOLERANCE, f"{name} step {step} {t['name']}")
        self.assertGreater(len(set(lrs_seen)), 2, f"{name}: the lr never changed")
        opt.close(delete_job=True)
        return lrs_seen

    def test_lambda_lr_cosine_with_warmup(self):
        lrs = self.run_with("sched-lambda", lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, warmup_cosine(3, self.STEPS)))
        self.assertLess(lrs[0], lrs[2])  # warm-up
        self.assertGreater(lrs[3], lrs[-1])  # then decay

    def test_one_cycle_lr(self):
        # Momentum and betas configure the muond job (fixed per job): cycle_momentum=False.
        self.run_with("sched-onecycle", lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=[GROUPS["muon"]["lr"], GROUPS["adamw"]["lr"]],
            total_steps=self.STEPS, cycle_momentum=False))

    def test_step_lr(self):
        lrs = self.run_with("sched-step", lambda opt: torch.optim.lr_scheduler.StepLR(
            opt, step_size=2, gamma=0.5))
        self.assertEqual(lrs[2], lrs[0] * 0.5)


class FrozenTest(DaemonTest):
    """Parameters with requires_grad=False are not job tensors: the job holds the others only,
    the frozen ones never change, and the rest follow the reference of a model without them."""

    def run_frozen(self, mode):
        params, kinds, tensors = optimizer_model(torch.float32)
        names = list(params)
        muon_frozen = next(n for n in names if kinds[n] == "muon")
        adam_frozen = next(n for n in names if kinds[n] == "adamw")
        for n in (muon_frozen, adam_frozen):
            params[n].requires_grad_(False)
        frozen_before = {n: params[n].detach().clone() for n in (muon_frozen, adam_frozen)}
        if mode == "apply":
            opt = apply_optimizer(params, kinds, address=self.daemon.address,
                                  job_id=f"frozen-{mode}")
            job_names = [t["name"] for t in opt.spec["tensors"]]
        else:
            muon = [(n, p) for n, p in params.items() if kinds[n] == "muon"]
            adam = [(n, p) for n, p in params.items() if kinds[n] == "adamw"]
            opt = MuonWithAuxAdam([dict(params=muon, use_muon=True, lr=0.02),
                                   dict(params=adam, use_muon=False, lr=1e-3)],
                                  address=self.daemon.address, job_id=f"frozen-{mode}")
            job_names = [m["name"] for m in opt.spec["matrices"]]
        self.assertNotIn(muon_frozen, job_names)
        self.assertNotIn(adam_frozen, job_names)
        live = [t for t in tensors if t["name"] not in frozen_before]
        ref = h.reference_for(live, init=[t["param"].float() for t in live]) \
            if mode == "apply" else None
        lrs = {"group0": GROUPS["muon"]["lr"], "group1": GROUPS["adamw"]["lr"]}
        wds = {"group0": GROUPS["muon"]["weight_decay"], "group1": GROUPS["adamw"]["weight_decay"]}
        for step in range(3):
            grads = h.gradients(tensors, step)
            for (n, p), g in zip(params.items(), grads):
                p.grad = None if n in frozen_before else g
            opt.step()
            if ref is not None:
                ref.step([g for t, g in zip(tensors, grads) if t["name"] not in frozen_before],
                         lrs, wds)
                for t, m in zip(live, ref.masters):
                    self.assertLessEqual(h.relative_error(params[t["name"]].detach(), m),
                                         MASTER_TOLERANCE, f"step {step} {t['name']}")
        for n, before in frozen_before.items():
            self.assertTrue(torch.equal(params[n].detach(), before), n)
        self.assertTrue(all(params[n].requires_grad is False for n in frozen_before))
        opt.close(delete_job=True)

    def test_apply_mode(self):
        self.run_frozen("apply")

    def test_update_mode(self):
        self.run_frozen("update")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[3:], verbosity=2)
