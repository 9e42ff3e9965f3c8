#!/usr/bin/python3
"""Gradients streamed during backward, steps in parts, results as they come, and the delayed
update (muon_offload/streaming.py, common/shm_protocol.h kSubmitStepPart) against real daemons.

Usage: streaming_test.py MUOND_BIN LIBMUOND_CLIENT DATA_DIR [unittest names...]
"""
import faulthandler
import json
import os
import socket
import subprocess
import sys
import textwrap
import unittest
import warnings

import muon_offload_test as base  # noqa: E402  (parses the same arguments, starts nothing)
from muon_offload_test import DaemonCase

import torch  # noqa: E402

import muon_offload as mo  # noqa: E402
from muon_offload import MuondError, MuonWithAuxAdam, reference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import streaming_worker as sw  # noqa: E402


def free_port():
    """A TCP port nobody listens on now (the gloo rendezvous of streaming_worker.py)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BitIdentityTest(DaemonCase):
    """Streaming gives the bits of step() without streaming: worlds 1/2/4, every stage, both
    modes, shared memory and gRPC, two micro-batches per step (accumulating()), 2 KiB buckets."""

    def run_world(self, world, port):
        out = os.path.join(self.tmp.name, f"world{world}.json")
        proc = subprocess.run([sys.executable, os.path.join(HERE, "streaming_worker.py"),
                               self.daemon.address, str(world), out, str(port)],
                              capture_output=True, text=True, timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        with open(out) as f:
            results = json.load(f)
        self.assertEqual(len(results), 4 * len(sw.STAGES[world]))
        for r in results:
            with self.subTest(**{k: r[k] for k in ("world", "stage", "mode", "transport")}):
                self.assertTrue(r["identical"], f"max difference {r['max_diff']}")
                self.assertGreater(r["moved"], 1e-3, "the parameters did not train")
                if r["transport"] == "grpc":
                    self.assertEqual(r["early_parts"], 0, "gRPC sends the step whole")
        return results

    def test_world_1(self):
        results = self.run_world(1, free_port())
        for r in results:
            if r["transport"] == "shm":  # the parts really left during backward
                self.assertGreater(r["early_parts"], 0, r)

    def test_world_2(self):
        results = self.run_world(2, free_port())
        self.assertTrue(any(r["early_parts"] > 0 for r in results if r["transport"] == "shm"))

    def test_world_4(self):
        self.run_world(4, free_port())


def lagged_reference(mode, steps, warmup, seed_batches, predict=False):
    """Independent of the product's optimizer: the Muon reference math and torch's AdamW on a
    master copy, gradients taken on a copy that lags as delay=1 says. history[k] is the masters
    after k steps; forward t runs on history[t] while synchronous (t <= warmup), on
    history[t - 1] once delayed, and with predict on history[t - 1] + (history[t - 1] -
    history[t - 2]) from the second delayed step on (the last installed update taken as the
    expected value of the one in flight)."""
    masters = sw.make_model()
    muon_names = ("l1.w", "l2.w", "l3.w")
    adam = torch.optim.AdamW([masters[n] for n in masters if n not in muon_names], lr=0.01,
                             betas=(0.9, 0.95), eps=1e-10, weight_decay=0.01)
    momentum = {n: torch.zeros_like(masters[n]) for n in muon_names}
    history = [{n: p.detach().clone() for n, p in masters.items()}]  # history[k]: after k steps
    for t in range(steps):
        if t <= warmup:
            at = history[t]
        elif predict and t >= warmup + 2:
            last, before = history[t - 1], history[t - 2]
            at = {n: last[n] + (last[n] - before[n]) for n in last}
        else:
            at = history[t - 1]
        view = {n: torch.nn.Parameter(v.clone()) for n, v in at.items()}
        sw.loss_of(view, seed_batches(t)).backward()
        with torch.no_grad():
            for n in muon_names:
                u = reference.muon_update(view[n].grad, momentum[n], 0.95, True, "standard", 5,
                                          "original", 1)
                masters[n].mul_(1 - 0.05 * 0.1)
                masters[n].sub_(u * 0.05)
            for n in masters:
                if n not in muon_names:
                    masters[n].grad = view[n].grad.clone()
            adam.step()
        history.append({n: p.detach().clone() for n, p in masters.items()})
    return history


class DelayedTest(DaemonCase):
    """delay=1: the trajectory of an in-process reference that applies each update one step
    late; drain() (and save_checkpoint()) installs the step in flight."""

    STEPS, WARMUP = 6, 2

    @staticmethod
    def batch(t):
        return torch.randint(0, 16, (32,), generator=torch.Generator().manual_seed(77 + t))

    def run_delayed(self, mode, predict, transport="shm"):
        m = sw.make_model()
        opt = MuonWithAuxAdam(sw.groups(m), address=self.daemon.address, mode=mode,
                              transport=transport, delay=1, delay_warmup=self.WARMUP,
                              predict=predict)
        in_flight = []
        for t in range(self.STEPS):
            sw.loss_of(m, self.batch(t)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            in_flight.append(opt._in_flight)
        forward = {n: p.detach().clone() for n, p in m.items()}  # what forward 6 would see
        opt.drain()
        self.assertIsNone(opt._in_flight)
        self.assertIsNone(opt._true, "drain() leaves the parameters without the prediction")
        saved = opt.save_checkpoint()
        self.assertEqual(saved["step"], self.STEPS, "a saved state is a whole step")
        opt.close(delete_job=True)
        return {n: p.detach() for n, p in m.items()}, in_flight, forward

    def check(self, mode, predict):
        got, in_flight, forward = self.run_delayed(mode, predict)
        self.assertEqual(in_flight[:self.WARMUP], [None] * self.WARMUP, "warmup is synchronous")
        self.assertEqual(in_flight[self.WARMUP:], list(range(self.WARMUP, self.STEPS)),
                         "after warmup step() returns with its step in flight")
        history = lagged_reference(mode, self.STEPS, self.WARMUP, self.batch, predict)
        want = history[-1]
        sync = lagged_reference(mode, self.STEPS, self.STEPS, self.batch)[-1]
        other = lagged_reference(mode, self.STEPS, self.WARMUP, self.batch, not predict)[-1]
        for n in want:
            # DESIGN.md's fp32 bound on Newton-Schulz, a few steps: far below the difference
            # between the delayed and the synchronous trajectories.
            diff = float((got[n] - want[n]).abs().max())
            self.assertLess(diff, 2e-5, f"{mode} {n}: delayed run vs lagged reference")
        gap = max(float((want[n] - sync[n]).abs().max()) for n in want)
        self.assertGreater(gap, 1e-3, "the delayed and synchronous trajectories must differ")
        gap = max(float((want[n] - other[n]).abs().max()) for n in want)
        self.assertGreater(gap, 1e-3, "with and without the prediction, the trajectories differ")
        # Before drain(), the next forward's parameters: the installed ones (history[5]), plus
        # with predict the last installed update (history[5] - history[4]).
        last, before = history[-2], history[-3]
        for n in forward:
            expect = last[n] + (last[n] - before[n]) if predict else last[n]
            diff = float((forward[n] - expect).abs().max())
            self.assertLess(diff, 2e-5, f"{mode} {n}: the parameters the next forward sees")

    def test_update_mode(self):
        self.check("update", predict=True)

    def test_apply_mode(self):
        self.check("apply", predict=True)

    def test_update_mode_without_prediction(self):
        self.check("update", predict=False)

    def test_apply_mode_without_prediction(self):
        self.check("apply", predict=False)

    def test_bad_delay_values(self):
        m = sw.make_model()
        for kw, text in (({"delay": 2}, "delay must be 0 or 1"),
                         ({"delay_warmup": -1}, "delay_warmup"),
                         ({"bucket_bytes": 0}, "bucket_bytes must be positive")):
            with self.assertRaisesRegex(ValueError, text):
                MuonWithAuxAdam(sw.groups(m), address=self.daemon.address, **kw)


class StepFailureTest(DaemonCase):
    """A step refused after parts went out changes nothing in the trainer, and the next step
    runs; a second backward into streamed gradients sends the step whole."""

    def test_non_finite_gradient_in_a_late_bucket(self):
        for mode in ("update", "apply"):
            with self.subTest(mode=mode):
                m = sw.make_model()
                opt = MuonWithAuxAdam(sw.groups(m), address=self.daemon.address, mode=mode,
                                      bucket_bytes=1)
                sw.loss_of(m, DelayedTest.batch(0)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                before = {n: p.detach().clone() for n, p in m.items()}
                # l1.w is the first layer: its gradient is the last of backward, after the
                # others' parts left.
                handle = m["l1.w"].register_hook(lambda g: g * float("nan"))
                sw.loss_of(m, DelayedTest.batch(1)).backward()
                handle.remove()
                self.assertGreater(opt._stream._posted, 0, "parts left during backward")
                with self.assertRaises(MuondError) as e:
                    opt.step()
                self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
                self.assertIn("non-finite", e.exception.message)
                for n in before:
                    self.assertTrue(torch.equal(before[n], m[n].detach()), n)
                self.assertEqual(opt.step_id, 1)
                opt.zero_grad(set_to_none=True)
                sw.loss_of(m, DelayedTest.batch(1)).backward()
                opt.step()
                self.assertEqual(opt.step_id, 2)
                opt.close(delete_job=True)

    def test_missing_gradient_at_step_drops_the_streamed_parts(self):
        m = sw.make_model()
        opt = MuonWithAuxAdam(sw.groups(m), address=self.daemon.address, bucket_bytes=1)
        before = {n: p.detach().clone() for n, p in m.items()}
        sw.loss_of(m, DelayedTest.batch(0)).backward()
        self.assertGreater(opt._stream._posted, 0)
        m["l2.w"].grad = None
        with self.assertRaises(MuondError) as e:
            opt.step()
        self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
        self.assertIn("'l2.w'", e.exception.message)
        for n in before:
            self.assertTrue(torch.equal(before[n], m[n].detach()), n)
        # The retry of the same step streams again and goes through.
        opt.zero_grad(set_to_none=True)
        sw.loss_of(m, DelayedTest.batch(0)).backward()
        self.assertGreater(opt._stream._posted, 0)
        opt.step()
        self.assertEqual(opt.step_id, 1)
        self.assertFalse(torch.equal(before["l2.w"], m["l2.w"].detach()))
        opt.close(delete_job=True)

    def test_second_backward_after_streaming_falls_back(self):
        """A second backward without accumulating() changes gradients that already streamed: the
        step is sent whole with the accumulated gradients (what stream=False computes), counted
        and warned about, naming accumulating()."""
        results = {}
        for stream in (False, True):
            m = sw.make_model()
            opt = MuonWithAuxAdam(sw.groups(m), address=self.daemon.address, bucket_bytes=1,
                                  stream=stream)
            sw.loss_of(m, DelayedTest.batch(0)).backward()
            sw.loss_of(m, DelayedTest.batch(1)).backward()  # without accumulating()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            results[stream] = {n: p.detach().clone() for n, p in m.items()}
            if stream:
                self.assertEqual(opt.stream_fallbacks, 1)
                self.assertTrue(any("accumulating()" in str(w.message) for w in caught),
                                [str(w.message) for w in caught])
            opt.close(delete_job=True)
        for n in results[False]:
            self.assertTrue(torch.equal(results[False][n], results[True][n]), n)


def two_rank_job(client, name, stage=2):
    spec = {"job_id": name, "world_size": 2, "zero_stage": stage,
            "muon": {"momentum": 0.9, "nesterov": True, "ns_steps": 5},
            "matrices": [{"name": "a", "shape": [16, 24], "dtype": "float32"},
                         {"name": "b", "shape": [24, 24], "dtype": "float32"}]}
    return spec, client.create_job(spec)


class BadPartsTest(DaemonCase):
    """Parts that overlap, lie outside the buffer, cut a span, follow the last part or come from
    another session are refused with the step uncommitted; a rank that dies after some parts
    aborts the step for every rank."""

    def setUp(self):
        self.client = mo.Client(self.daemon.address)

    def tearDown(self):
        self.client.close()

    def attach(self, spec, token):
        sessions = [self.client.attach(spec["job_id"], r, token, transport="shm") for r in (0, 1)]
        for s in sessions:
            s.gradient_view(0).copy_(torch.randn(s.buffer_elements))
        return sessions

    def status(self, job_id, token):
        return self.job_show(job_id, token)

    def expect_refused(self, s, step, code, text):
        with self.assertRaises(MuondError) as e:
            s.wait_parts(step)
        self.assertEqual(e.exception.code_name, code, e.exception.message)
        self.assertIn(text, e.exception.message)

    def span_bytes(self, s, k):
        return s.spans[k][3] * 4, s.spans[k][2] * 4

    def test_overlap_outside_cut_and_after_last(self):
        spec, token = two_rank_job(self.client, "bad-parts")
        r0, r1 = self.attach(spec, token)
        at, n = self.span_bytes(r0, 0)
        size = r0.raw_view("gradient", 0).numel()
        cases = [
            ("overlap", [(at, n, False), (at, n, True)], "INVALID_ARGUMENT",
             "is in two parts of the step"),
            ("outside", [(size, 8, False), (0, size, True)], "INVALID_ARGUMENT",
             "lies outside the rank's"),
            ("cut span", [(at, n - 4, False), (0, size, True)], "INVALID_ARGUMENT",
             "a part holds whole spans"),
            ("missing span", [(at, n, False), (0, 0, True)], "INVALID_ARGUMENT",
             "is in no part of the step"),
            # A step in one submission is the whole buffer.
            ("empty step", [(0, 0, True)], "INVALID_ARGUMENT", "is not the rank's"),
        ]
        self.assertGreater(len(r0.spans), 1)
        for what, parts, code, text in cases:
            with self.subTest(what):
                for off, nbytes, last in parts:
                    r0.post_part(0, off, nbytes, last)
                self.expect_refused(r0, 0, code, text)
                out = self.status("bad-parts", token)
                self.assertIn("next_step: 0", out.replace("next step", "next_step"))
        # After the last part: the rank's step is closed; a further part of it is refused (the
        # client library refuses it before it leaves).
        r0.post_part(0, 0, size, last=True)
        with self.assertRaises(MuondError) as e:
            r0.post_part(0, 0, 8)
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        # Rank 1 had not begun the refused step: its first try learns of the refusal (every
        # part of that try is refused), its second, in one part per span, commits with rank 0's
        # whole submission.
        for attempt in range(2):
            for k in range(len(r1.spans)):
                ak, nk = self.span_bytes(r1, k)
                r1.post_part(0, ak, nk, last=k == len(r1.spans) - 1)
            if attempt == 0:
                self.expect_refused(r1, 0, "INVALID_ARGUMENT", "step 0")
        self.assertFalse(r1.wait_parts(0))
        self.assertFalse(r0.wait_parts(0))
        self.assertIn("next_step: 1", self.status("bad-parts", token).replace("next step",
                                                                              "next_step"))
        for s in (r0, r1):
            s.close()
        self.client.delete_job("bad-parts", token)

    def test_part_from_an_old_session_and_a_rank_that_dies(self):
        spec, token = two_rank_job(self.client, "dying-rank")
        r0, r1 = self.attach(spec, token)
        at, n = self.span_bytes(r0, 0)
        r0.post_part(0, at, n)
        # Rank 1 attaches in another process, posts one part and dies without detaching.
        script = textwrap.dedent(f"""
            import os, sys, torch
            sys.path.insert(0, {os.path.join(base.ROOT, 'client', 'python')!r})
            import muon_offload as mo
            c = mo.Client({self.daemon.address!r})
            s = c.attach("dying-rank", 1, {token!r}, takeover=True, transport="shm")
            s.gradient_view(0).copy_(torch.ones(s.buffer_elements))
            s.post_part(0, s.spans[0][3] * 4, s.spans[0][2] * 4)
            s.progress(0, 0.5)
            os._exit(3)
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=60, env=dict(os.environ))
        self.assertEqual(proc.returncode, 3, proc.stderr)
        # The first rank-1 session was taken over: its parts come from another session.
        with self.assertRaises(MuondError):
            r1.post_part(0, 0, 0, last=True)
            r1.wait_parts(0)
        r0.post_part(0, 0, 0, last=len(r0.spans) == 1)
        if len(r0.spans) > 1:
            for k in range(1, len(r0.spans)):
                ak, nk = self.span_bytes(r0, k)
                r0.post_part(0, ak, nk, last=k == len(r0.spans) - 1)
        with self.assertRaises(MuondError) as e:
            r0.wait_parts(0)
        # ABORTED, or (when its parts came after the abort) the fence the abort left.
        self.assertIn(e.exception.code_name, ("ABORTED", "FAILED_PRECONDITION"))
        self.assertIn("aborted: rank 1 (shared memory) went away during the step",
                      e.exception.message)
        out = self.status("dying-rank", token)
        self.assertIn("fenced", out)
        self.assertIn("next_step: 0", out.replace("next step", "next_step"))
        for s in (r0, r1):
            s.close()
        self.client.delete_job("dying-rank", token)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(int(os.environ.get("STREAMING_TEST_DUMP", "500")), exit=True)
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:])
