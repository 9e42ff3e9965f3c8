#!/usr/bin/python3
"""Streamed steps are exact whatever the trainer does between backward and step()
(muon_offload/streaming.py GradientStream.edited, optim.py's fallback; DESIGN.md 4d's tries).

A real nn.Module (an embedding, three pre-norm MLP blocks, a head: 16 tensors, 6 of them Muon
matrices of 18 KiB), a real backward, 4 KiB buckets so that each matrix leaves during backward
(asserted), one rank on shared memory and over gRPC, update and apply mode; each case bit for bit
against the same loop with stream=False:
  - gradients edited after backward: clip_grad_norm_, an in-place unscale, p.grad = p.grad * 0.5,
    p.grad.data.mul_() and an edit through a view of .data (neither bumps p.grad._version): each
    step falls back (opt.stream_fallbacks counts exactly the edited steps, a warning names the
    first edited tensor once);
  - untouched gradients, and DynamicLossScaler's scaled backward with an overflow step: nothing
    falls back, the parts leave during backward;
  - a try refused for a NaN in the gradient backward produces last (after a pause in which the
    earlier matrices are computed and announced) and a dropped try (update mode: a Muon gradient
    missing at step(); apply mode: a divisor changed at step() and refused), each retried with
    another batch, 20 times; again on a device slower than backward (SlowDeviceRetryTest: the
    retry's step() comes before its matrices are computed again, where the failed try's
    progress words were once read as the retry's);
  - torch.cuda.amp.GradScaler refused at scaler.step(opt) naming DynamicLossScaler, nothing
    applied; an FSDP FlatParameter refused at construction;
  - delay_warmup counts committed steps only.
Worlds of 2 gloo ranks (DDP with gradient_as_bucket_view False and True, an edit on one rank
only) are in stream_exact_worker.py.

Usage: stream_exact_test.py MUOND_BIN LIBMUOND_CLIENT DATA_DIR [unittest names...]
"""
import json
import os
import subprocess
import sys
import time
import unittest
import warnings
from unittest import mock

import muon_offload_test as base  # noqa: F401  (parses the same arguments, starts nothing)
from muon_offload_test import DaemonCase

import torch  # noqa: E402

from muon_offload import DynamicLossScaler, MuondError, MuonWithAuxAdam  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stream_exact_worker as sew  # noqa: E402
from streaming_test import free_port  # noqa: E402

BUCKET = 4096
STEPS = 4


def run(address, mode, stream, transport="shm", steps=STEPS, edit=None, scaler=None,
        tries=None, model_seed=5):
    """Trains sew.Net for `steps` steps; returns (parameters, stats). edit(t, model, opt): what
    the trainer does between backward and step(). tries(t, model, opt, batch): a failing try of
    step t before the real one (it raises MuondError from step()). scaler: a DynamicLossScaler
    factory (apply mode); the loss of step 2 overflows."""
    model = sew.Net(model_seed)
    kw = dict(loss_scaler=scaler()) if scaler else {}
    opt = MuonWithAuxAdam(sew.groups(model), address=address, mode=mode, stream=stream,
                          transport=transport, bucket_bytes=BUCKET, **kw)
    stats = {"streamed_before_step": [], "refused": 0, "skipped": 0}
    gen = torch.Generator().manual_seed(1000 + model_seed)
    try:
        for t in range(steps):
            if tries is not None:
                opt.zero_grad(set_to_none=True)
                try:
                    tries(t, model, opt, sew.batch(gen))
                except MuondError as e:
                    stats["refused"] += 1
                    stats.setdefault("codes", []).append(e.code_name)
                else:
                    raise AssertionError(f"step {t}: the failing try went through")
            opt.zero_grad(set_to_none=True)
            sent = opt._stream.buckets_sent if opt._stream else 0
            loss = sew.loss_of(model, sew.batch(gen))
            if scaler is not None:
                if t == 2:
                    loss = loss * float("inf")  # an overflow: the step is skipped
                opt.loss_scaler.backward(loss)
            else:
                loss.backward()
            stats["streamed_before_step"].append(
                (opt._stream.buckets_sent if opt._stream else 0) - sent)
            if edit is not None:
                edit(t, model, opt)
            opt.step()
            stats["skipped"] += int(opt.last_step_skipped)
        stats["fallbacks"] = opt.stream_fallbacks
        stats["steps_taken"] = opt._steps_taken
        return {n: p.detach().clone() for n, p in model.named_parameters()}, stats
    finally:
        opt.close(delete_job=True)


class StreamExactCase(DaemonCase):
    TMP_PREFIX = "stream-exact-"

    def assert_identical(self, a, b, what):
        for name in a:
            self.assertTrue(torch.equal(a[name], b[name]),
                            f"{what}: {name} differs by {(a[name] - b[name]).abs().max().item()}")

    def compare(self, mode, edit, transport="shm", expect_fallbacks=None, **kw):
        """The loop with stream=True against stream=False; returns the streamed run's stats."""
        ref, _ = run(self.daemon.address, mode, False, transport, edit=edit, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, stats = run(self.daemon.address, mode, True, transport, edit=edit, **kw)
        self.assert_identical(got, ref, f"{mode}/{transport}")
        # Apply mode streams from step 1: step 0 uploads the initial weights first.
        first = 1 if mode == "apply" else 0
        self.assertTrue(all(n > 0 for n in stats["streamed_before_step"][first:]),
                        f"parts did not leave during backward: {stats}")
        if expect_fallbacks is not None:
            self.assertEqual(stats["fallbacks"], expect_fallbacks, stats)
        elif transport == "shm" or mode == "update":  # every edited step that streamed
            self.assertEqual(stats["fallbacks"], STEPS - first, stats)
        edited = [w for w in caught if "changed between backward and step()" in str(w.message)]
        self.assertEqual(len(edited), 1 if stats["fallbacks"] else 0,
                         [str(w.message) for w in caught])
        return stats


def clip(t, model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def unscale(t, model, opt):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)  # what an unscale does, in place


def replace(t, model, opt):
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad * 0.5


def data_mul(t, model, opt):
    before = [p.grad._version for p in model.parameters()]
    for p in model.parameters():
        p.grad.data.mul_(0.5)
    assert [p.grad._version for p in model.parameters()] == before, "the version moved"


def view_edit(t, model, opt):
    g = model.blocks[1].fc1.weight.grad
    version = g._version
    g.data.view(-1)[:7].zero_()
    assert g._version == version, "the version moved"


def only_step(t):
    """An edit at step t only (of one tensor, through a view of .data)."""
    def edit(s, model, opt):
        if s == t:
            view_edit(s, model, opt)
    return edit


class EditTest(StreamExactCase):
    """Gradients edited after backward: every edited step is sent whole, bit for bit."""

    def test_clip_grad_norm(self):
        for mode in ("update", "apply"):
            with self.subTest(mode=mode):
                self.compare(mode, clip)

    def test_clip_grad_norm_grpc(self):
        for mode in ("update", "apply"):
            with self.subTest(mode=mode):
                self.compare(mode, clip, transport="grpc")

    def test_in_place_unscale(self):
        for mode in ("update", "apply"):
            with self.subTest(mode=mode):
                self.compare(mode, unscale)

    def test_replaced_gradient(self):
        for mode in ("update", "apply"):
            with self.subTest(mode=mode):
                self.compare(mode, replace)

    def test_edits_the_version_counter_misses(self):
        for mode in ("update", "apply"):
            for edit in (data_mul, view_edit):
                with self.subTest(mode=mode, edit=edit.__name__):
                    self.compare(mode, edit)

    def test_one_edited_step_of_four(self):
        for mode in ("update", "apply"):
            with self.subTest(mode=mode):
                self.compare(mode, only_step(1), expect_fallbacks=1)

    def test_untouched_gradients_never_fall_back(self):
        for mode in ("update", "apply"):
            for transport in ("shm", "grpc"):
                with self.subTest(mode=mode, transport=transport):
                    self.compare(mode, None, transport=transport, expect_fallbacks=0)

    def test_loss_scaler_streams(self):
        """DynamicLossScaler: the divisor sent during backward is the scale the loss was scaled
        with, so no step falls back; the overflowed step 2 is skipped on both paths."""
        def scaler():
            return DynamicLossScaler(init_scale=2.0 ** 10, hysteresis=1)
        stats = self.compare("apply", None, expect_fallbacks=0, scaler=scaler)
        self.assertEqual(stats["skipped"], 1, stats)
        self.assertEqual(stats["steps_taken"], STEPS - 1, "a skipped step is not a committed one")


def nan_last(pause):
    """A try whose gradient backward produces last (blocks[0].fc1.weight's, a Muon matrix) is NaN,
    produced `pause` seconds after the rest: the earlier matrices are computed and announced by
    then."""
    def attempt(t, model, opt, tokens):
        w = model.blocks[0].fc1.weight

        def poison(g):
            time.sleep(pause)
            return g * float("nan")
        handle = w.register_hook(poison)
        try:
            sew.loss_of(model, tokens).backward()
        finally:
            handle.remove()
        opt.step()
    return attempt


def dropped(t, model, opt, tokens):
    """Update mode: the step's parts leave during backward, then a Muon gradient is missing at
    step(): the try is dropped."""
    sew.loss_of(model, tokens).backward()
    model.blocks[2].fc2.weight.grad = None
    opt.step()


def dropped_apply(t, model, opt, tokens):
    """Apply mode: every part leaves during backward, then step() is given a divisor the daemon
    refuses: the streamed try is dropped (its hyperparameters changed) and the whole send
    refused."""
    sew.loss_of(model, tokens).backward()
    opt.step(grad_divisor=0.0)


class RetryTest(StreamExactCase):
    """A refused or dropped streamed try, retried with another batch: nothing of it is used."""

    def retried(self, mode, tries, steps=20, fallbacks=0):
        ref, ref_stats = run(self.daemon.address, mode, False, tries=tries, steps=steps)
        got, stats = run(self.daemon.address, mode, True, tries=tries, steps=steps)
        self.assertEqual(ref_stats["refused"], steps)
        self.assertEqual(stats["refused"], steps)
        self.assert_identical(got, ref, mode)
        self.assertEqual(stats["fallbacks"], fallbacks, stats)
        self.assertEqual(stats["steps_taken"], steps, "failed tries are not committed steps")

    def test_refused_try(self):
        for mode in ("update", "apply"):
            with self.subTest(mode=mode):
                self.retried(mode, nan_last(self.PAUSE), steps=self.TRIES)

    def test_dropped_try(self):
        self.retried("update", dropped, steps=self.TRIES)
        # Step 0 uploads the weights and does not stream: every later try streamed and dropped.
        self.retried("apply", dropped_apply, steps=self.TRIES, fallbacks=self.TRIES - 1)

    PAUSE = 0.25
    TRIES = 20


class SlowDeviceRetryTest(RetryTest):
    """RetryTest on a device slower than the trainer's backward (the simulated backend spending
    its modelled time, 0.1 GFLOP/s: about 65 ms a matrix): at the retry's step() the earlier
    matrices are not computed again yet, so a word left by the failed try would be read."""

    PAUSE = 0.6
    TRIES = 6  # each try waits for the slow device; 6 fail every case without the fix

    @classmethod
    def setUpClass(cls):
        cls.daemon = base.Daemon(["--backend", "simulated", "--sim-sleep", "true",
                                  "--sim-compute-gflops", "0.1"])
        cls.tmp = base.tempfile.TemporaryDirectory(prefix=cls.TMP_PREFIX)


class RouteTest(StreamExactCase):
    """Routes refused with a clear message, nothing applied."""

    def test_grad_scaler_refused(self):
        model = sew.Net(5)
        opt = MuonWithAuxAdam(sew.groups(model), address=self.daemon.address, mode="apply",
                              bucket_bytes=BUCKET)
        try:
            # Without CUDA the scaler disables itself (and step() is then a plain opt.step()):
            # made as on a CUDA machine, its scale on the CPU.
            with mock.patch("torch.cuda.is_available", return_value=True):
                scaler = torch.cuda.amp.GradScaler()
            scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
            sew.loss_of(model, sew.batch(torch.Generator().manual_seed(1))).backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with self.assertRaisesRegex(TypeError, "DynamicLossScaler"):
                scaler.step(opt)
            self.assertEqual(opt.step_id, 0)
            for n, p in model.named_parameters():
                self.assertTrue(torch.equal(p, before[n]), n)
            opt.step()  # the same gradients go through without the scaler
            self.assertEqual(opt.step_id, 1)
        finally:
            opt.close(delete_job=True)

    def test_fsdp_refused_at_construction(self):
        model = sew.Net(5)
        model.blocks[0].fc1.weight._fsdp_flattened = True  # what FSDP marks its FlatParameters
        with self.assertRaisesRegex(ValueError, "FullyShardedDataParallel.*not supported"):
            MuonWithAuxAdam(sew.groups(model), address=self.daemon.address)


class FingerprintTest(unittest.TestCase):
    """streaming.fingerprint (CRC-32 for CPU tensors) and the device path (_device_fingerprint:
    plain and position-weighted int64 sums of the words, run here on CPU tensors) see every edit
    the check relies on, in every dtype a gradient has, and nothing else."""

    def edits(self, t):
        swapped = t.clone()
        swapped[[3, 7]] = swapped[[7, 3]]
        flipped = t.clone()
        flipped.view(-1).view(torch.uint8)[5] ^= 1  # one bit
        halved = t.clone()
        halved.mul_(0.5)
        zeroed = t.clone()
        zeroed[11] = 0
        last = t.clone()
        last[-1] = 0
        return {"swap": swapped, "bit": flipped, "mul": halved, "zero": zeroed, "last": last}

    def test_every_edit_changes_both_fingerprints(self):
        from muon_offload import streaming
        # 1000 words: a partial period of the position weights only; 3 periods and 17 words:
        # the per-class sums of whole periods and a tail.
        for dtype, n in [(d, n) for d in (torch.float32, torch.bfloat16, torch.float16,
                                          torch.float64) for n in (1000, 3 * 65521 + 17)]:
            t = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype) + 0.25
            for fp, same in ((streaming.fingerprint, lambda a, b: a == b),
                             (streaming._device_fingerprint, streaming._same)):
                with self.subTest(dtype=dtype, n=n, path=fp.__name__):
                    self.assertTrue(same(fp(t), fp(t.clone())), "equal bytes, equal prints")
                    for name, edited in self.edits(t).items():
                        self.assertFalse(same(fp(t), fp(edited)), name)

    def test_non_contiguous_and_empty(self):
        from muon_offload import streaming
        t = torch.randn(8, 6).t()  # a transposed view: fingerprinted as its values in order
        self.assertEqual(streaming.fingerprint(t), streaming.fingerprint(t.contiguous()))
        self.assertTrue(streaming._same(streaming._device_fingerprint(t),
                                        streaming._device_fingerprint(t.contiguous())))
        self.assertEqual(streaming.fingerprint(torch.empty(0)), 0)


class WorldTest(StreamExactCase):
    """Two gloo ranks (stream_exact_worker.py): DDP with gradient_as_bucket_view False and True
    (reduce_gradients=False), and an edit on rank 0 only; both modes, bit for bit against
    stream=False; every rank falls back on exactly the edited steps."""

    def test_two_ranks(self):
        out = os.path.join(self.tmp.name, "world2.json")
        proc = subprocess.run([sys.executable, os.path.join(HERE, "stream_exact_worker.py"),
                               self.daemon.address, out, str(free_port())],
                              capture_output=True, text=True, timeout=900)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        with open(out) as f:
            results = json.load(f)
        self.assertEqual(len(results), len(sew.CASES) * 2)
        for r in results:
            with self.subTest(case=r["case"], mode=r["mode"]):
                self.assertTrue(r["identical"], r)
                self.assertEqual(r["fallbacks"], r["expected_fallbacks"], r)
                self.assertTrue(all(n > 0 for n in r["streamed_before_step"]), r)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:])
