#!/usr/bin/python3
"""Update mode's max_grad_norm: the streamed clipping route (optim.py, DESIGN.md 4d).

muond sums the Muon matrices' squares as they stream in, adds the AdamW tensors' share that goes
with the rank's last part, clips the Muon gradients (the clip decided when the step is sealed;
the matrices computed before that with clip 1 are recomputed) and returns the whole sum, by which step() clips the AdamW gradients in-process. On
stream_exact_test.py's model (16 tensors, 6 Muon matrices, 4 KiB buckets: every matrix leaves
during backward, asserted), one rank:
  - every step clips (max_grad_norm below every step's norm): stream=True is bit for bit
    stream=False through the same route, over shared memory and over gRPC, with 0 fallbacks; the
    same in the delayed mode (delay=1: AdamW clipped when the step in flight is installed);
  - the route is stock clipping: against clip_grad_norm_ over every parameter with stream=False
    (torch's float32 norm against muond's float64 one: equal to rounding), and against the
    in-process backend (backend="local") with the same max_grad_norm;
  - a norm within max_grad_norm changes nothing: bit for bit the run without max_grad_norm;
  - a NaN in an AdamW gradient (which only the share carries to muond) refuses the step on every
    path with nothing changed, and the retry with clean gradients commits;
  - bad values: max_grad_norm < 0 or NaN (ValueError; a job.json with max_grad_norm < 0:
    INVALID_ARGUMENT from the daemon), a negative share (INVALID_ARGUMENT) and a share on a job
    that does not clip (FAILED_PRECONDITION) at the session, a multi-node update-mode optimizer
    with max_grad_norm (ValueError).
Two gloo ranks (the daemon's sum over both ranks' partitions, rank 0's AdamW share) are
stream_exact_worker.py's case "clip".

Usage: update_clip_test.py MUOND_BIN LIBMUOND_CLIENT DATA_DIR [unittest names...]
"""
import os
import sys
import unittest
import warnings

import muon_offload_test as base  # noqa: F401  (parses the same arguments, starts nothing)
from muon_offload_test import DaemonCase

import torch  # noqa: E402

from muon_offload import MuondError, MuonWithAuxAdam  # noqa: E402
from muon_offload.client import Client  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stream_exact_worker as sew  # noqa: E402

BUCKET = 4096
STEPS = 4
CLIP = 0.05  # every step's norm is above it (asserted)


def run(address, stream, transport="shm", steps=STEPS, max_grad_norm=CLIP, stock=None,
        backend="muond", delay=0, poison=()):
    """Trains sew.Net in update mode; returns (parameters, stats). stock: clip_grad_norm_ over
    every parameter by that norm before step() (with max_grad_norm None). poison: the steps
    tried first with a NaN in an AdamW gradient (the refusal is recorded, then the step runs
    clean with the same batch)."""
    model = sew.Net(5)
    kw = dict(address=address, transport=transport) if backend == "muond" else {}
    opt = MuonWithAuxAdam(sew.groups(model), backend=backend, stream=stream, bucket_bytes=BUCKET,
                          max_grad_norm=max_grad_norm, delay=delay, delay_warmup=1, **kw)
    stats = {"streamed_before_step": [], "norms": [], "refused": []}
    gen = torch.Generator().manual_seed(1005)
    try:
        for t in range(steps):
            tokens = sew.batch(gen)
            if t in poison:
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
                opt.zero_grad(set_to_none=True)
                sew.loss_of(model, tokens).backward()
                model.norm.weight.grad[3] = float("nan")  # AdamW: only the share carries it
                try:
                    opt.step()
                except MuondError as e:
                    stats["refused"].append((e.code_name, str(e)))
                    stats.setdefault("unchanged", []).append(all(
                        torch.equal(before[n], p) for n, p in model.named_parameters()))
            opt.zero_grad(set_to_none=True)
            sent = opt._stream.buckets_sent if opt._stream else 0
            sew.loss_of(model, tokens).backward()
            stats["streamed_before_step"].append(
                (opt._stream.buckets_sent if opt._stream else 0) - sent)
            if stock is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), stock)
            opt.step()
            stats["norms"].append(opt.last_grad_norm)
        opt.drain()
        stats["fallbacks"] = opt.stream_fallbacks
        return {n: p.detach().clone() for n, p in model.named_parameters()}, stats
    finally:
        if backend == "muond":
            opt.close(delete_job=True)


class UpdateClipTest(DaemonCase):
    TMP_PREFIX = "update-clip-"

    def assert_identical(self, a, b, what):
        for name in a:
            self.assertTrue(torch.equal(a[name], b[name]),
                            f"{what}: {name} differs by {(a[name] - b[name]).abs().max().item()}")

    def assert_close(self, a, b, what, rtol=1e-4, atol=1e-6):
        for name in a:
            self.assertTrue(torch.allclose(a[name], b[name], rtol=rtol, atol=atol),
                            f"{what}: {name} differs by {(a[name] - b[name]).abs().max().item()}")

    def streamed_against_whole(self, transport, **kw):
        whole, whole_stats = run(self.daemon.address, False, transport, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, stats = run(self.daemon.address, True, transport, **kw)
        self.assert_identical(got, whole, f"update/{transport}")
        self.assertEqual(stats["fallbacks"], 0, stats)
        self.assertFalse([w for w in caught if "changed between backward" in str(w.message)])
        # (The delayed mode sends each step whole at step(), after its warm-up step.)
        streamed = stats["streamed_before_step"][:1 if kw.get("delay") else STEPS]
        self.assertTrue(all(n > 0 for n in streamed), stats)
        # Every step clipped, and both runs saw the same norms.
        norms = [n for n in stats["norms"] if n is not None]
        self.assertTrue(norms and all(n > CLIP for n in norms), stats["norms"])
        self.assertEqual(stats["norms"], whole_stats["norms"])
        return got

    def test_streams_bit_for_bit_over_shared_memory(self):
        self.streamed_against_whole("shm")

    def test_streams_bit_for_bit_over_grpc(self):
        self.streamed_against_whole("grpc")

    def test_delayed_mode(self):
        self.streamed_against_whole("shm", delay=1)

    def test_is_stock_clipping_and_the_local_backend(self):
        got, stats = run(self.daemon.address, True)
        stock, _ = run(self.daemon.address, False, max_grad_norm=None, stock=CLIP)
        self.assert_close(got, stock, "against clip_grad_norm_")
        local, local_stats = run(self.daemon.address, False, backend="local")
        self.assert_close(got, local, "against backend='local'")
        for a, b in zip(stats["norms"], local_stats["norms"]):
            self.assertAlmostEqual(a, b, delta=1e-6 * b)
        # And the clip made a difference (the same loop unclipped ends elsewhere).
        free, _ = run(self.daemon.address, True, max_grad_norm=None)
        self.assertFalse(all(torch.allclose(got[n], free[n], rtol=1e-3, atol=1e-5) for n in got))

    def test_a_norm_within_the_max_changes_nothing(self):
        loose, stats = run(self.daemon.address, True, max_grad_norm=1e6)
        free, _ = run(self.daemon.address, True, max_grad_norm=None)
        self.assert_identical(loose, free, "max_grad_norm above every norm")
        self.assertTrue(all(n is not None and n < 1e6 for n in stats["norms"]), stats)

    def test_a_nan_in_an_adamw_gradient_refuses_the_step(self):
        for transport in ("shm", "grpc"):
            with self.subTest(transport=transport):
                got, stats = run(self.daemon.address, True, transport, poison=(1, 2))
                ref, _ = run(self.daemon.address, True, transport)
                self.assertEqual(len(stats["refused"]), 2, stats["refused"])
                for code, message in stats["refused"]:
                    self.assertEqual(code, "INVALID_ARGUMENT", message)
                    self.assertIn("outside the job", message)
                    self.assertIn("is nan, a non-finite gradient", message)
                self.assertEqual(stats["unchanged"], [True, True])
                self.assert_identical(got, ref, "after the refused tries")

    def test_bad_values_are_refused(self):
        model = sew.Net(5)
        for bad in (-1.0, float("nan"), float("inf"), "1"):
            with self.subTest(max_grad_norm=bad):
                with self.assertRaisesRegex(ValueError, "max_grad_norm must be a finite number"):
                    MuonWithAuxAdam(sew.groups(model), address=self.daemon.address,
                                    max_grad_norm=bad)
        opt = MuonWithAuxAdam(sew.groups(model), address=self.daemon.address, max_grad_norm=1.0)
        try:
            with self.assertRaises(MuondError) as e:
                opt.session.set_outside_sum_sq(-1.0)
            self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
            self.assertIn("must be >= 0", str(e.exception))
            opt.session.set_outside_sum_sq(float("nan"))  # sent: the daemon's rule decides
        finally:
            opt.close(delete_job=True)
        plain = MuonWithAuxAdam(sew.groups(model), address=self.daemon.address)
        try:
            with self.assertRaises(MuondError) as e:
                plain.session.set_outside_sum_sq(1.0)
            self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
            self.assertIn("does not clip in mode 'update'", str(e.exception))
        finally:
            plain.close(delete_job=True)
        # A job.json with a negative max_grad_norm, straight to the daemon.
        client = Client(self.daemon.address)
        with self.assertRaises(MuondError) as e:
            client.create_job({"job_id": "bad-clip", "max_grad_norm": -2,
                               "matrices": [{"name": "w", "shape": [4, 8]}]})
        self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
        self.assertIn("max_grad_norm -2", str(e.exception))

    def test_multi_node_update_mode_refuses_max_grad_norm(self):
        from muon_offload.multinode import MultiNodeMuonWithAuxAdam
        model = sew.Net(5)
        with self.assertRaisesRegex(ValueError, "clips globally over the nodes in mode='apply'"):
            MultiNodeMuonWithAuxAdam(sew.groups(model), max_grad_norm=1.0)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:])
