#!/usr/bin/python3
"""Apply mode (DESIGN.md 4b) through the C ABI against a real daemon: muond owns the fp32 masters,
the Muon momentum and the AdamW state and returns new parameters; everything is compared with
muon_offload.reference.ApplyReference (torch.optim.AdamW(foreach=False) and the reference Muon
math on masters of its own). The optimizer's side: apply_optimizer_test.py.

Usage: apply_mode_test.py MUOND_BIN LIBMUOND_CLIENT [unittest names...]
Each test class starts its own muond and stops it with SIGTERM, expecting exit 0.
  - SessionTrajectoryTest: 20 steps, one thread per rank: worlds 1..4, ZeRO stages 0/1/2/3 and
    an explicit layout, gRPC and shared memory, float32 and bfloat16 parameters (and mixed param
    dtypes through the span calls); masters (export) within 1e-6 relative per tensor, bf16
    parameters the reference's rounding where the masters agree bitwise.
  - RefusalTest: steps before the initial weights, ranks disagreeing on lr, non-finite
    gradients (nothing changes), global clipping whether or not it triggers.
"""
import os
import sys
import unittest

MUOND, LIB = sys.argv[1], sys.argv[2]
os.environ["MUOND_CLIENT_LIB"] = LIB
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import apply_harness as h  # noqa: E402
from apply_harness import DaemonTest, SessionJob  # noqa: E402

torch.set_num_threads(1)
DaemonTest.muond = MUOND
STEPS = 20


class SessionTrajectoryTest(DaemonTest):
    """Apply-mode trajectories through the C ABI against the reference."""

    def trajectory(self, name, dtype, world, stage, transports, layout=None, float32_init=False,
                   grad_divisor=1.0, param_dtypes=None, spans_api=False):
        # float32_init: the masters start from float32 values the parameters only round.
        tensors = h.model_tensors(torch.float32 if float32_init else dtype)
        job = SessionJob(self.daemon.address, name, tensors, dtype, world, stage, transports,
                         layout=layout, param_dtypes=param_dtypes, spans_api=spans_api)
        init = [t["param"] if float32_init else p for t, p in zip(tensors, job.params)]
        ref = h.reference_for(tensors, init=[p.float() for p in init])
        self.assertRanksOk(job.upload(float32=float32_init), f"{name} upload")
        exported = os.path.join(self.daemon.tmp.name, f"{name}.safetensors")
        for step in range(STEPS):
            lr, wd = h.lr_at(step)
            grads = h.gradients(tensors, step, dtype=dtype)
            scaled = [g.float().mul(grad_divisor) for g in grads] if grad_divisor != 1 else grads
            sent = [g.to(d) for g, d in zip(scaled, job.dtypes)]
            self.assertRanksOk(job.step(lambda r: sent, lr, wd, grad_divisor), f"{name} {step}")
            ref.step([g.to(d) for g, d in zip(grads, job.dtypes)], lr, wd)
            self.assertParamsMatch(job, ref, f"{name} step {step}")
            masters = job.export(exported)
            self.assertMastersMatch(masters, ref, f"{name} step {step}")
            bad, agree = h.bf16_rounding_mismatches(job.params, masters, ref)
            self.assertEqual(bad, 0, f"{name} step {step}: bf16 parameters that are not the "
                             "reference's rounding of bitwise-equal masters")
        for t, p in zip(tensors, job.params):  # what the ranks got is muond's masters, rounded
            self.assertTrue(torch.equal(p, masters[t["name"]].to(p.dtype)), t["name"])
        as_bf16 = job.export(exported, "bfloat16")
        for t in tensors:
            self.assertEqual(as_bf16[t["name"]].dtype, torch.bfloat16)
            self.assertTrue(torch.equal(as_bf16[t["name"]], masters[t["name"]].to(torch.bfloat16)))
            self.assertEqual(list(masters[t["name"]].shape), list(t["param"].shape))
        job.close()
        return agree

    def test_world1_stage0_shm_float32(self):
        self.trajectory("w1-s0-shm-f32", torch.float32, 1, 0, ("shm",))

    def test_world1_stage0_grpc_bfloat16(self):
        agree = self.trajectory("w1-s0-grpc-bf16", torch.bfloat16, 1, 0, ("grpc",))
        self.assertGreater(agree, 0)

    def test_world2_stage1_grpc_bfloat16_float32_init(self):
        # Over gRPC float32 initial values reach the masters unrounded (shared memory rounds
        # them to the param dtype on the client).
        self.trajectory("w2-s1-grpc-bf16", torch.bfloat16, 2, 1, ("grpc",), float32_init=True)

    def test_world2_stage1_shm_float32_divisor(self):
        self.trajectory("w2-s1-shm-f32", torch.float32, 2, 1, ("shm",), grad_divisor=4.0)

    def test_world3_stage2_shm_float32(self):
        self.trajectory("w3-s2-shm-f32", torch.float32, 3, 2, ("shm",))

    def test_world3_stage3_grpc_bfloat16(self):
        self.trajectory("w3-s3-grpc-bf16", torch.bfloat16, 3, 3, ("grpc",))

    def test_world4_stage3_shm_float32(self):
        self.trajectory("w4-s3-shm-f32", torch.float32, 4, 3, ("shm",))

    def test_world4_stage2_both_transports_bfloat16(self):
        self.trajectory("w4-s2-mixed-bf16", torch.bfloat16, 4, 2, ("shm", "grpc"))

    def test_world2_explicit_layout(self):
        # Uneven: rank 0 owns the first half of every tensor, rank 1 the rest (0-d: rank 0).
        layout = [[], []]
        for t in h.model_tensors():
            n = t["param"].numel()
            first = max(1, n // 2) if n > 1 else 1
            layout[0].append({"matrix": t["name"], "offset": 0, "length": first})
            if n > first:
                layout[1].append({"matrix": t["name"], "offset": first, "length": n - first})
        self.trajectory("w2-explicit-f32", torch.float32, 2, None, ("grpc", "shm"), layout=layout)

    def test_world2_stage3_mixed_param_dtypes_through_spans(self):
        tensors = h.model_tensors()
        dtypes = [torch.bfloat16 if t["optimizer"] == "muon" else torch.float32 for t in tensors]
        self.trajectory("w2-s3-spans-mixed", torch.bfloat16, 2, 3, ("shm", "grpc"),
                        param_dtypes=dtypes, spans_api=True)


class RefusalTest(DaemonTest):
    """Refused steps change nothing; global clipping equals the reference whether or not it
    triggers."""

    def job(self, name, world=2, stage=2, max_grad_norm=None, transports=("shm", "grpc")):
        tensors = h.model_tensors()
        job = SessionJob(self.daemon.address, name, tensors, torch.float32, world, stage,
                         transports, max_grad_norm=max_grad_norm)
        return job, h.reference_for(tensors, max_grad_norm=max_grad_norm)

    def good_step(self, job, ref, step, what):
        lr, wd = h.lr_at(step)
        grads = h.gradients(job.tensors, step)
        self.assertRanksOk(job.step(lambda r: grads, lr, wd), what)
        ref.step(grads, lr, wd)
        self.assertParamsMatch(job, ref, what)

    def test_steps_before_the_initial_weights(self):
        job, ref = self.job("refuse-no-weights")
        lr, wd = h.lr_at(0)
        grads = h.gradients(job.tensors, 0)
        self.assertRefused(job.step(lambda r: grads, lr, wd), "FAILED_PRECONDITION",
                           "initial weights of ranks 0, 1")
        self.assertRanksOk(job.upload(ranks=[0]), "rank 0 upload")
        self.assertRefused(job.step(lambda r: grads, lr, wd), "FAILED_PRECONDITION",
                           "initial weights of rank 1 ")
        self.assertRanksOk(job.upload(ranks=[1]), "rank 1 upload")
        for step in range(3):  # step 0 as if nothing had been refused
            self.good_step(job, ref, step, f"step {step} after the refusals")
        job.close()

    def test_ranks_disagreeing_on_lr(self):
        job, ref = self.job("refuse-lr")
        self.assertRanksOk(job.upload(), "upload")
        self.good_step(job, ref, 0, "step 0")
        before = job.export(self.daemon.path("lr-before.safetensors"))
        lr, wd = h.lr_at(1)
        other = dict(lr, muon=lr["muon"] * 2)
        grads = h.gradients(job.tensors, 1)
        errors = job.step(lambda r: grads, lambda r: other if r == 1 else lr, wd)
        self.assertRefused(errors, "INVALID_ARGUMENT", "disagree", "lr of group 'muon'")
        self.assertEqual(job.step_id, 1)
        after = job.export(self.daemon.path("lr-after.safetensors"))
        for name in before:
            self.assertTrue(torch.equal(before[name], after[name]), name)
        for step in range(1, 4):
            self.good_step(job, ref, step, f"step {step} after the refusal")
        job.close()

    def test_non_finite_gradient_changes_nothing(self):
        job, ref = self.job("refuse-nan", world=3, stage=3)
        self.assertRanksOk(job.upload(), "upload")
        for step in range(2):
            self.good_step(job, ref, step, f"step {step}")
        before = job.export(self.daemon.path("nan-before.safetensors"))
        lr, wd = h.lr_at(2)
        for bad_tensor, value in ((4, float("nan")), (1, float("inf"))):
            grads = h.gradients(job.tensors, 2)
            poisoned = [g.clone() for g in grads]
            poisoned[bad_tensor].view(-1)[-1] = value  # the last element: the last rank's chunk
            errors = job.step(lambda r: poisoned, lr, wd)
            self.assertRefused(errors, "INVALID_ARGUMENT", "non-finite",
                               f"'{job.tensors[bad_tensor]['name']}'")
            after = job.export(self.daemon.path("nan-after.safetensors"))
            for name in before:
                self.assertTrue(torch.equal(before[name], after[name]), name)
        for step in range(2, 5):
            self.good_step(job, ref, step, f"step {step} after the refusals")
        job.close()

    def clipped_trajectory(self, name, max_grad_norm, scales):
        job, ref = self.job(name, max_grad_norm=max_grad_norm)
        plain, plain_ref = self.job(name + "-plain")
        self.assertRanksOk(job.upload(), "upload")
        self.assertRanksOk(plain.upload(), "upload")
        norms = []
        for step, scale in enumerate(scales):
            lr, wd = h.lr_at(step)
            grads = h.gradients(job.tensors, step, scale=scale)
            for j, r in ((job, ref), (plain, plain_ref)):
                self.assertRanksOk(j.step(lambda _: grads, lr, wd), f"{name} step {step}")
                r.step(grads, lr, wd)
                self.assertParamsMatch(j, r, f"{name} step {step}")
            norms.append(ref.last_grad_norm)
        masters = job.export(self.daemon.path(f"{name}.safetensors"))
        self.assertMastersMatch(masters, ref, name)
        result = [p.clone() for p in job.params], [p.clone() for p in plain.params], norms
        job.close()
        plain.close()
        return result

    def test_clipping_that_triggers_on_some_steps(self):
        scales = [1.0, 0.01, 3.0, 0.01, 1.0, 0.02]
        clipped, plain, norms = self.clipped_trajectory("clip-some", 2.0, scales)
        triggered = [n > 2.0 for n in norms]
        self.assertIn(True, triggered, norms)
        self.assertIn(False, triggered, norms)
        self.assertFalse(all(torch.equal(a, b) for a, b in zip(clipped, plain)))

    def test_clipping_that_never_triggers_changes_no_bit(self):
        clipped, plain, norms = self.clipped_trajectory("clip-never", 1e6, [1.0, 2.0, 0.5, 1.0])
        self.assertTrue(all(n < 1e6 for n in norms), norms)
        for a, b in zip(clipped, plain):
            self.assertTrue(torch.equal(a, b))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[3:]])
