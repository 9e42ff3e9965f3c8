#!/usr/bin/python3
"""fp16 loss scaling with the optimizer in muond: muon_offload.DynamicLossScaler (DeepSpeed's
semantics) and the job option "nonfinite": "skip".

Usage: loss_scaling_test.py MUOND_BIN LIBMUOND_CLIENT [unittest names...]
  - ScalerTest (no daemon): growth after scale_window good steps, hysteresis, the minimum scale,
    consecutive hysteresis, bad arguments, state_dict round trip.
  - SkipTest: MuonWithAuxAdam(mode="apply", loss_scaler=...) over shared memory (streamed and
    whole) and gRPC: a step whose gradients hold an Inf is skipped (no error, parameters and
    muond's state unchanged, step id advanced, opt.last_step_skipped, the scale halved), and the
    next good step equals the reference that never saw the bad step; without a scaler the step is
    refused as before. Update mode with nonfinite="skip": the Muon and AdamW parameters stay.
"""
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
from muon_offload import DynamicLossScaler, MuondError, MuonWithAuxAdam  # noqa: E402

torch.set_num_threads(1)
DaemonTest.muond = MUOND


class ScalerTest(unittest.TestCase):
    def test_grows_after_a_window_of_good_steps(self):
        s = DynamicLossScaler(init_scale=8.0, scale_window=3, hysteresis=1)
        seen = []
        for _ in range(7):
            s.update(False)
            seen.append(s.scale)
        # DeepSpeed counts from last_overflow_iter = -1: x2 after the iterations where
        # cur_iter - last_overflow_iter is a multiple of the window (iterations 2 and 5).
        self.assertEqual(seen, [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0])

    def test_overflow_halves_and_restarts_the_window(self):
        s = DynamicLossScaler(init_scale=64.0, scale_window=2, hysteresis=1)
        s.update(True)
        self.assertEqual(s.scale, 32.0)
        s.update(False)  # 1 good step since the overflow
        self.assertEqual(s.scale, 32.0)
        s.update(False)  # 2: the window is full
        self.assertEqual(s.scale, 64.0)
        self.assertEqual(s.overflows, 1)

    def test_hysteresis_delays_the_decrease(self):
        s = DynamicLossScaler(init_scale=64.0, scale_window=100, hysteresis=3)
        s.update(True)
        s.update(True)
        self.assertEqual(s.scale, 64.0, "the first hysteresis - 1 overflows use up the allowance")
        s.update(True)
        self.assertEqual(s.scale, 32.0)
        s.update(True)
        self.assertEqual(s.scale, 16.0, "the allowance is spent until a window of good steps")
        s.update(False)
        s.update(True)
        self.assertEqual(s.scale, 8.0, "one good step does not restore it by default")

    def test_consecutive_hysteresis_restores_on_any_good_step(self):
        s = DynamicLossScaler(init_scale=64.0, scale_window=100, hysteresis=2,
                              consecutive_hysteresis=True)
        s.update(True)
        self.assertEqual(s.scale, 64.0)
        s.update(False)
        s.update(True)
        self.assertEqual(s.scale, 64.0)
        s.update(True)
        self.assertEqual(s.scale, 32.0)

    def test_minimum_scale(self):
        s = DynamicLossScaler(init_scale=4.0, min_scale=2.0, hysteresis=1)
        for _ in range(4):
            s.update(True)
        self.assertEqual(s.scale, 2.0)
        strict = DynamicLossScaler(init_scale=2.0, min_scale=2.0, hysteresis=1,
                                   raise_error_at_min_scale=True)
        with self.assertRaises(FloatingPointError):
            strict.update(True)

    def test_bad_arguments(self):
        for kw in ({"init_scale": 0}, {"init_scale": float("inf")}, {"scale_factor": 1.0},
                   {"scale_window": 0}, {"hysteresis": 0}, {"hysteresis": True},
                   {"init_scale": 1.0, "min_scale": 2.0}):
            with self.assertRaises(ValueError, msg=str(kw)):
                DynamicLossScaler(**kw)

    def test_state_dict_round_trip(self):
        s = DynamicLossScaler(init_scale=1024.0, scale_window=5, hysteresis=2)
        for overflow in (True, False, True, True, False):
            s.update(overflow)
        t = DynamicLossScaler()
        t.load_state_dict(s.state_dict())
        self.assertEqual(t.state_dict(), s.state_dict())
        with self.assertRaises(KeyError):
            t.load_state_dict({"scale": 1.0})


class SkipTest(DaemonTest):
    def run_with_skip(self, name, dtype, transport, stream):
        params, kinds, tensors = optimizer_model(dtype)
        scaler = DynamicLossScaler(init_scale=256.0, scale_window=1000, hysteresis=1)
        opt = apply_optimizer(params, kinds, address=self.daemon.address, job_id=name,
                              transport=transport, stream=stream, loss_scaler=scaler)
        self.assertEqual(opt.spec["nonfinite"], "skip")
        ref = h.reference_for(tensors, init=[t["param"].float() for t in tensors])
        lrs = {"group0": GROUPS["muon"]["lr"], "group1": GROUPS["adamw"]["lr"]}
        wds = {"group0": GROUPS["muon"]["weight_decay"], "group1": GROUPS["adamw"]["weight_decay"]}
        schedule = [False, False, True, False, True, False]
        good = 0
        for step, overflow in enumerate(schedule):
            scale = scaler.scale
            grads = h.gradients(tensors, good, dtype=dtype, scale=scale)
            if overflow:
                grads[-1].view(-1)[-1] = float("inf")
            before = {n: p.detach().clone() for n, p in params.items()}
            for p, g in zip(params.values(), grads):
                p.grad = g
            opt.step()
            self.assertEqual(opt.last_step_skipped, overflow, f"{name} step {step}")
            self.assertEqual(opt.step_id, step + 1)
            if overflow:
                self.assertEqual(scaler.scale, scale / 2)
                for n, p in params.items():
                    self.assertTrue(torch.equal(p.detach(), before[n]), f"{name} {step} {n}")
                continue
            self.assertEqual(scaler.scale, scale)
            ref.step(grads, lrs, wds, grad_divisor=scale)
            good += 1
            for t, m in zip(tensors, ref.masters):
                p = params[t["name"]].detach()
                tol = MASTER_TOLERANCE if dtype == torch.float32 else 2.0 ** -8
                self.assertLessEqual(h.relative_error(p, m), tol, f"{name} {step} {t['name']}")
        self.assertEqual(scaler.overflows, schedule.count(True))
        opt.close(delete_job=True)

    def test_float32_shm_streamed(self):
        self.run_with_skip("skip-f32-shm", torch.float32, "shm", stream=True)

    def test_float32_shm_whole(self):
        self.run_with_skip("skip-f32-shm-whole", torch.float32, "shm", stream=False)

    def test_bfloat16_grpc(self):
        self.run_with_skip("skip-bf16-grpc", torch.bfloat16, "grpc", stream=True)

    def test_without_a_scaler_the_step_is_refused(self):
        params, kinds, tensors = optimizer_model(torch.float32)
        opt = apply_optimizer(params, kinds, address=self.daemon.address, job_id="skip-refuse")
        self.assertNotIn("nonfinite", opt.spec)
        for p, g in zip(params.values(), h.gradients(tensors, 0)):
            p.grad = g
        p.grad.view(-1)[0] = float("nan")
        with self.assertRaises(MuondError) as e:
            opt.step()
        self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
        self.assertEqual(opt.step_id, 0)
        opt.close(delete_job=True)

    def test_scaler_needs_apply_mode_and_skip(self):
        params, kinds, _ = optimizer_model(torch.float32)
        with self.assertRaises(ValueError):
            MuonWithAuxAdam([dict(params=list(params.values()), use_muon=False)],
                            address=self.daemon.address, loss_scaler=DynamicLossScaler())
        with self.assertRaises(ValueError):
            apply_optimizer(params, kinds, address=self.daemon.address, job_id="skip-bad",
                            loss_scaler=DynamicLossScaler(), nonfinite="refuse")
        with self.assertRaises(ValueError):
            apply_optimizer(params, kinds, address=self.daemon.address, job_id="skip-bad2",
                            nonfinite="ignore")

    def test_update_mode_skip_leaves_every_parameter(self):
        torch.manual_seed(3)
        w = torch.nn.Parameter(torch.randn(16, 12))
        b = torch.nn.Parameter(torch.randn(12))
        opt = MuonWithAuxAdam([dict(params=[w], use_muon=True, lr=0.02),
                               dict(params=[b], use_muon=False, lr=1e-3)],
                              address=self.daemon.address, job_id="skip-update",
                              nonfinite="skip")
        for step in range(3):
            w.grad = torch.randn(16, 12)
            b.grad = torch.randn(12)
            if step == 1:
                w.grad[0, 0] = float("inf")
            before = (w.detach().clone(), b.detach().clone())
            opt.step()
            self.assertEqual(opt.last_step_skipped, step == 1)
            changed = not torch.equal(w.detach(), before[0])
            self.assertEqual(changed, step != 1, f"step {step}")
            self.assertEqual(not torch.equal(b.detach(), before[1]), step != 1, f"step {step}")
        self.assertEqual(opt.step_id, 3)
        self.assertEqual(opt.state[b]["step"], 2, "AdamW skipped the skipped step too")
        opt.close(delete_job=True)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[3:], verbosity=2)
