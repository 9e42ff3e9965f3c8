#!/usr/bin/python3
"""MuonWithAuxAdam(mode="apply") (DESIGN.md 4b) against a real daemon, compared with
muon_offload.reference.ApplyReference. The C ABI's side: apply_mode_test.py.

Usage: apply_optimizer_test.py MUOND_BIN LIBMUOND_CLIENT [unittest names...]
Each test class with a daemon starts its own muond and stops it with SIGTERM, expecting exit 0.
  - OptimizerTest: one rank: trajectories with an LR scheduler and a gradient divisor, no
    optimizer state in the trainer, refusals, init_from, the checkpoint round trip and export.
  - DistributedTest: over torch.distributed (gloo, 4 spawned processes): worlds 2, 3 and 4,
    stages 1, 2 and 3, both transports, bf16 and fp32, refusals on two ranks.
  - ExampleTest: client/examples/train_tiny_gpt.py --mode apply (bf16 and fp32).
  - CudaParamsTest: parameters on a CUDA device (skipped without one).
Without a daemon: ApplyReferenceTest (the reference against the formulas) and CollectivesTest
(the package's reduce-scatter and all-gather on gloo).
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
from apply_harness import (GROUPS, MASTER_TOLERANCE, DaemonTest, apply_optimizer,  # noqa: E402
                           optimizer_model)
from muon_offload import MuondError  # noqa: E402

torch.set_num_threads(1)
DaemonTest.muond = MUOND
STEPS = 20


class ApplyReferenceTest(unittest.TestCase):
    """The reference itself against the formulas of DESIGN.md 4b written out in float64."""

    def test_adamw_and_muon_tensors_follow_the_formulas(self):
        tensors = h.model_tensors()
        ref = h.reference_for(tensors)
        w = [t["param"].double() for t in tensors]
        m = [torch.zeros_like(x) for x in w]
        v = [torch.zeros_like(x) for x in w]
        momentum = [torch.zeros(t["param"].shape) for t in tensors]
        b1, b2 = h.ADAMW["betas"]
        for step in range(5):
            lr, wd = h.lr_at(step)
            grads = h.gradients(tensors, step)
            ref.step(grads, lr, wd, grad_divisor=2.0)
            for i, t in enumerate(tensors):
                g = grads[i].double() / 2
                rate, decay = lr[t["group"]], wd[t["group"]]
                if t["optimizer"] == "muon":
                    u = h.mo.muon_update(g.float(), momentum[i], num_heads=t["num_heads"] if
                                         "num_heads" in t else 1).double()
                    w[i] = w[i] * (1 - rate * decay) - rate * u
                else:
                    w[i] = w[i] * (1 - rate * decay)
                    m[i] = b1 * m[i] + (1 - b1) * g
                    v[i] = b2 * v[i] + (1 - b2) * g * g
                    mh, vh = m[i] / (1 - b1 ** (step + 1)), v[i] / (1 - b2 ** (step + 1))
                    w[i] = w[i] - rate * mh / (vh.sqrt() + h.ADAMW["eps"])
                err = h.relative_error(ref.masters[i], w[i])
                self.assertLess(err, 1e-6, f"step {step} {t['name']}")
        # fp32: master + momentum per Muon tensor, master + m + v (+ step) per AdamW tensor.
        floor = sum(t["param"].numel() * 4 * (2 if t["optimizer"] == "muon" else 3)
                    for t in tensors)
        self.assertGreaterEqual(ref.state_bytes(), floor)
        self.assertLess(ref.state_bytes(), floor + 64)

    def test_clipping_is_clip_grad_norm(self):
        tensors = h.model_tensors()
        for max_norm, triggers in ((1.0, True), (1e9, False)):
            ref = h.reference_for(tensors, max_grad_norm=max_norm)
            plain = h.reference_for(tensors)
            grads = h.gradients(tensors, 0)
            norm = torch.cat([g.double().reshape(-1) for g in grads]).norm().item()
            ref.step(grads, *h.lr_at(0))
            plain.step([g * min(1.0, max_norm / (norm + 1e-6)) for g in grads], *h.lr_at(0))
            self.assertAlmostEqual(ref.last_grad_norm, norm, delta=norm * 1e-6)
            self.assertEqual(norm > max_norm, triggers)
            for a, b in zip(ref.masters, plain.masters):
                self.assertLess(h.relative_error(a, b), 1e-6)


class CollectivesTest(unittest.TestCase):
    """The reduce-scatter and all-gather of the package on gloo, 3 spawned ranks, no daemon."""

    def test_reduce_scatter_and_all_gather(self):
        import json

        import torch.multiprocessing as mp

        import apply_dist_worker
        with tempfile.TemporaryDirectory(prefix="apply-collectives-") as tmp:
            mp.spawn(apply_dist_worker.run_collectives, args=(3, tmp, LIB), nprocs=3, join=True)
            with open(os.path.join(tmp, "collectives.json")) as f:
                results = json.load(f)
        self.assertEqual(len(results), 3)
        for rank, checks in enumerate(results):
            self.assertEqual(len(checks), 4)
            for name, ok in checks.items():
                self.assertTrue(ok, f"rank {rank} {name}")


class OptimizerTest(DaemonTest):
    """MuonWithAuxAdam(mode="apply"), one rank without torch.distributed."""

    def trajectory(self, name, dtype, transport, steps=STEPS, divisor=1.0):
        params, kinds, tensors = optimizer_model(dtype)
        opt = apply_optimizer(params, kinds, address=self.daemon.address, job_id=name,
                              transport=transport, grad_divisor=divisor)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 40.0)
        ref = h.reference_for(tensors, init=[t["param"].float() for t in tensors])
        for step in range(steps):
            lrs = {"group0": opt.param_groups[0]["lr"], "group1": opt.param_groups[1]["lr"]}
            wds = {"group0": GROUPS["muon"]["weight_decay"],
                   "group1": GROUPS["adamw"]["weight_decay"]}
            if dtype == h.MIXED:
                grads = [g * divisor for g in h.param_gradients(tensors, step)]
            else:
                grads = h.gradients(tensors, step, dtype=dtype, scale=divisor)
            for p, g in zip(params.values(), grads):
                p.grad = g
            opt.step()
            sched.step()
            ref.step(grads, lrs, wds, grad_divisor=divisor)
            for t, m in zip(tensors, ref.masters):
                p = params[t["name"]].detach()
                tol = MASTER_TOLERANCE if p.dtype == torch.float32 else 2.0 ** -8
                self.assertLessEqual(h.relative_error(p, m), tol, f"{name} {step} {t['name']}")
        self.assertEqual(opt.step_id, steps)
        self.assertEqual(len(opt.state), 0, "apply mode keeps no optimizer state in the trainer")
        path = self.daemon.path(f"{name}.safetensors")
        opt.export(path)
        masters = h.read_safetensors(path)
        self.assertEqual(set(masters), set(params))
        self.assertMastersMatch(masters, ref, name)
        for n, p in params.items():
            self.assertTrue(torch.equal(p.detach(), masters[n].to(p.dtype)), n)
        return opt, params, tensors

    def test_float32_shm_with_scheduler(self):
        opt, _, _ = self.trajectory("opt-f32-shm", torch.float32, "shm")
        self.assertTrue(opt.session.is_shm)
        opt.close(delete_job=True)

    def test_bfloat16_grpc_with_divisor(self):
        opt, params, _ = self.trajectory("opt-bf16-grpc", torch.bfloat16, "grpc", divisor=64.0)
        self.assertFalse(opt.session.is_shm)
        self.assertTrue(all(p.dtype == torch.bfloat16 for p in params.values()))
        opt.close(delete_job=True)

    def test_mixed_dtypes_shm_and_grpc(self):
        """bfloat16 weights with float32 norms, bias and scale (the common setup): one job whose
        buffers are float32; every parameter keeps its dtype, the float32 ones are the masters,
        the bfloat16 ones the masters rounded."""
        for transport in ("shm", "grpc"):
            opt, params, _ = self.trajectory(f"opt-mixed-{transport}", h.MIXED, transport,
                                             divisor=8.0)
            self.assertEqual(opt.session.is_shm, transport == "shm")
            self.assertEqual({n: p.dtype for n, p in params.items() if p.dtype == torch.float32},
                             {n: torch.float32 for n in h.MIXED_FLOAT32})
            self.assertEqual(opt.spec["tensors"][0]["dtype"], "float32")
            self.assertEqual(opt.dtype, torch.float32)
            opt.close(delete_job=True)

    def test_refused_step_changes_nothing(self):
        params, kinds, tensors = optimizer_model(torch.bfloat16)
        opt = apply_optimizer(params, kinds, address=self.daemon.address, job_id="opt-refuse")
        for step in range(2):
            for p, g in zip(params.values(), h.gradients(tensors, step, dtype=torch.bfloat16)):
                p.grad = g
            opt.step()
        before = {n: p.detach().clone() for n, p in params.items()}
        params["embed.w"].grad[3, 3] = float("nan")
        with self.assertRaises(MuondError) as e:
            opt.step()
        self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
        self.assertIn("'embed.w'", e.exception.message)
        self.assertEqual(opt.step_id, 2)
        for n, p in params.items():
            self.assertTrue(torch.equal(p.detach(), before[n]), n)
        # Without a gradient the tensor is skipped (unused_params_test.py), not refused.
        params["embed.w"].grad[3, 3] = 0.0
        params["head.b"].grad = None
        opt.step()
        self.assertEqual(opt.step_id, 3)
        self.assertTrue(torch.equal(params["head.b"].detach(), before["head.b"]))
        self.assertFalse(torch.equal(params["embed.w"].detach(), before["embed.w"]))
        opt.close(delete_job=True)

    def test_init_from_an_exported_model(self):
        """A second job starts from the first one's export (init_from): no upload, its masters
        are the exported float32 values, not the trainer's bf16 rounding of them."""
        params, kinds, tensors = optimizer_model(torch.bfloat16)
        first = apply_optimizer(params, kinds, address=self.daemon.address, job_id="opt-export")
        for step in range(3):
            for p, g in zip(params.values(), h.gradients(tensors, step, dtype=torch.bfloat16)):
                p.grad = g
            first.step()
        path = self.daemon.path("opt-export.safetensors")
        first.export(path)
        first.close(delete_job=True)
        masters = h.read_safetensors(path)
        second = apply_optimizer(params, kinds, address=self.daemon.address, job_id="opt-init",
                                 init_from=path)
        self.assertEqual(second.spec["init_from"], path)
        ref = h.reference_for(tensors, init=[masters[t["name"]] for t in tensors])
        wds = {"group0": GROUPS["muon"]["weight_decay"], "group1": GROUPS["adamw"]["weight_decay"]}
        lrs = {"group0": GROUPS["muon"]["lr"], "group1": GROUPS["adamw"]["lr"]}
        for step in range(3, 6):
            grads = h.gradients(tensors, step, dtype=torch.bfloat16)
            for p, g in zip(params.values(), grads):
                p.grad = g
            second.step()
            ref.step(grads, lrs, wds)
        out = self.daemon.path("opt-init.safetensors")
        second.export(out)
        self.assertMastersMatch(h.read_safetensors(out), ref, "init_from")
        second.close(delete_job=True)

    def test_checkpoint_round_trip(self):
        params, kinds, tensors = optimizer_model(torch.bfloat16)
        opt = apply_optimizer(params, kinds, address=self.daemon.address, job_id="opt-ckpt",
                              max_grad_norm=5.0)

        def step(t):
            for p, g in zip(params.values(), h.gradients(tensors, t, dtype=torch.bfloat16)):
                p.grad = g
            opt.step()

        for t in range(3):
            step(t)
        saved_params = {n: p.detach().clone() for n, p in params.items()}
        opt.save_checkpoint()
        sd = opt.state_dict()
        self.assertEqual(sd["muond"]["next_step"], 3)
        self.assertEqual(sd["state"], {})
        first = []
        for t in range(3, 6):
            step(t)
            first.append({n: p.detach().clone() for n, p in params.items()})
        first_masters = self.daemon.path("ckpt-first.safetensors")
        opt.export(first_masters)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved_params[n])
        opt.load_state_dict(sd)
        self.assertEqual(opt.step_id, 3)
        for i, t in enumerate(range(3, 6)):
            step(t)
            for n, p in params.items():
                self.assertTrue(torch.equal(p.detach(), first[i][n]), f"step {t}: {n}")
        again = self.daemon.path("ckpt-again.safetensors")
        opt.export(again)
        a, b = h.read_safetensors(first_masters), h.read_safetensors(again)
        for n in a:
            self.assertTrue(torch.equal(a[n], b[n]), n)
        opt.close(delete_job=True)


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device: the CUDA path of apply mode "
                     "(shared memory registered with cudaHostRegister, asynchronous copies) "
                     "runs where torch sees a GPU")
class CudaParamsTest(DaemonTest):
    """MuonWithAuxAdam(mode="apply") with bf16 parameters and gradients on a CUDA device."""

    def test_cuda_bfloat16_shm_and_grpc(self):
        for transport in ("shm", "grpc"):
            params, kinds, tensors = optimizer_model(torch.bfloat16)
            params = {n: torch.nn.Parameter(p.detach().cuda()) for n, p in params.items()}
            opt = apply_optimizer(params, kinds, address=self.daemon.address,
                                  job_id=f"cuda-{transport}", transport=transport)
            ref = h.reference_for(tensors, init=[t["param"].float() for t in tensors])
            wds = {"group0": GROUPS["muon"]["weight_decay"],
                   "group1": GROUPS["adamw"]["weight_decay"]}
            for step in range(8):
                lrs = {"group0": opt.param_groups[0]["lr"], "group1": opt.param_groups[1]["lr"]}
                grads = h.gradients(tensors, step, dtype=torch.bfloat16)
                for p, g in zip(params.values(), grads):
                    p.grad = g.cuda()
                opt.step()
                ref.step(grads, lrs, wds)
                for t, m in zip(tensors, ref.masters):
                    got = params[t["name"]].detach().cpu()
                    self.assertLessEqual(h.relative_error(got, m), 2.0 ** -8, t["name"])
            self.assertEqual(len(opt.state), 0)
            opt.close(delete_job=True)


class DistributedTest(DaemonTest):
    """MuonWithAuxAdam(mode="apply") in 4 spawned gloo processes (apply_dist_worker.py)."""

    def test_worlds_2_3_4(self):
        import json

        import torch.multiprocessing as mp

        import apply_dist_worker
        with tempfile.TemporaryDirectory(prefix="apply-dist-") as tmp:
            mp.spawn(apply_dist_worker.run, args=(4, self.daemon.address, tmp, LIB), nprocs=4,
                     join=True)
            with open(os.path.join(tmp, "result.json")) as f:
                result = json.load(f)
        self.assertEqual(sorted(result["cases"]), sorted(apply_dist_worker.CASE_NAMES))
        for name, case in result["cases"].items():
            self.assertEqual(case["steps"], apply_dist_worker.STEPS, name)
            for step, errors in enumerate(case["param_errors"]):
                for tensor, err in errors.items():
                    self.assertLessEqual(err, case["tolerance"], f"{name} step {step} {tensor}")
            for tensor, err in case["master_errors"].items():
                self.assertLessEqual(err, MASTER_TOLERANCE, f"{name}: master {tensor}")
            self.assertEqual(case["bf16_mismatches"], 0, name)
            self.assertTrue(case["ranks_agree"], f"{name}: the ranks' parameters differ")
            worst = max(max(e.values()) for e in case["param_errors"])
            print(f"\n  {name}: {case['steps']} steps, largest parameter error {worst:.2e}, "
                  f"largest master error {max(case['master_errors'].values()):.2e}",
                  file=sys.stderr)
        refusals = result["refusals"]
        self.assertEqual(refusals["lr"]["code_name"], "INVALID_ARGUMENT", refusals)
        self.assertIn("disagree", refusals["lr"]["message"])
        self.assertEqual(refusals["nan"]["code_name"], "INVALID_ARGUMENT", refusals)
        self.assertIn("non-finite", refusals["nan"]["message"])
        self.assertTrue(refusals["unchanged"], refusals)


class ExampleTest(DaemonTest):
    """client/examples/train_tiny_gpt.py --mode apply: two gloo ranks train through muond next to
    the independent reference; losses agree and the trainer holds no optimizer state."""

    def run_example(self, *args):
        import json
        import subprocess
        example = os.path.join(h.ROOT, "client", "examples", "train_tiny_gpt.py")
        muonctl = os.path.join(os.path.dirname(MUOND), "muonctl")
        with tempfile.TemporaryDirectory(prefix="tiny-gpt-apply-") as tmp:
            out = os.path.join(tmp, "result.json")
            proc = subprocess.run([sys.executable, example, "--address", self.daemon.address,
                                   "--json", out, "--plot", "", "--muonctl", muonctl,
                                   "--mode", "apply", *map(str, args)],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout + proc.stderr)
            self.assertEqual(proc.returncode, 0, f"train_tiny_gpt.py {args} failed")
            with open(out) as f:
                return json.load(f), proc.stdout

    def check(self, result, out, steps, tolerance):
        losses, ref = result["losses"], result["ref_losses"]
        self.assertEqual(len(losses), steps)
        for t in range(steps):
            self.assertLessEqual(abs(losses[t] - ref[t]), tolerance,
                                 f"step {t}: muond {losses[t]} vs reference {ref[t]}")
        self.assertLess(losses[-1], losses[0])
        report = result["state_bytes"]
        self.assertEqual(report["trainer_optimizer_state_bytes"], 0)
        self.assertGreater(report["reference_state_bytes"], 2 * report["trainer_param_bytes"])
        self.assertIsNotNone(report["daemon_job_bytes"], out)
        self.assertGreater(report["daemon_job_bytes"], 0)
        self.assertIn("mode apply", out)
        print(f"\n  example: loss {losses[0]:.4f} -> {losses[-1]:.4f}, max |diff| "
              f"{max(abs(a - b) for a, b in zip(losses, ref)):.3e}; state bytes {report}",
              file=sys.stderr)

    def test_bfloat16_zero2_shm(self):
        result, out = self.run_example("--param-dtype", "bfloat16", "--steps", 8)
        self.check(result, out, 8, 2e-3)
        self.assertIn("in bfloat16", out)
        self.assertIn("shared memory", out)

    def test_float32_zero3_grpc_clipped(self):
        result, out = self.run_example("--param-dtype", "float32", "--steps", 6,
                                       "--zero-stage", 3, "--transport", "grpc",
                                       "--max-grad-norm", 0.5)
        self.check(result, out, 6, 1e-4)
        self.assertIn("ZeRO stage 3", out)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[3:]])
