#!/usr/bin/python3
"""QK-Clip (MuonClip, DESIGN.md 4e) on the daemon's masters, against a float64 reference written
here from the formula (not from the product's code).

Usage: qk_clip_test.py MUOND_BIN LIBMUOND_CLIENT [unittest names...]
  - ReferenceClipTest (no daemon): the reference's clip of hand-computed cases.
  - HelpersTest (no daemon): head_max_logits (GQA, causal), the MultiheadAttention hook (its
    logits softmax to the module's own attention weights), MaxLogitRecorder.
  - TrajectoryTest: 20 steps of a model with a GQA pair (H=8, G=2), an MHA pair (H=G=4), a Muon
    matrix outside any pair and an AdamW vector; the max logits cross the threshold on some heads
    at some steps, equal it on others (not clipped) and stay under it elsewhere, and differ by
    rank (the daemon takes the maximum). ZeRO stages 0/1/2/3, worlds 1/2/4, both transports. The
    daemon's masters (export) and every rank's returned parameters match the reference within the
    fp32 bound (1e-6 relative per tensor); the heads clipped and the largest logit are counted.
  - RestartTest: 10 steps, the daemon stopped and started again on its state directory, 10 more:
    the masters bit-identical to 20 steps without the restart.
  - RefusalTest: a step without max logits, with a wrong count or a non-finite value, each
    refused naming the pair (the client refuses before sending; the daemon's own check is in
    tests/unit/common/job_spec_qk_clip_test.cc and the job tests); jobs the daemon refuses to
    create; a refused step (non-finite gradient) leaves every master bit-identical.
  - OptimizerTest: MuonWithAuxAdam(mode="apply", qk_clip=...) with step(max_logits=...) and with
    set_max_logits() before backward (the streamed path), against the same reference.
"""
import math
import os
import sys
import tempfile
import unittest

MUOND, LIB = sys.argv[1], sys.argv[2]
os.environ["MUOND_CLIENT_LIB"] = LIB
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import apply_harness as h  # noqa: E402
from apply_harness import MASTER_TOLERANCE, DaemonTest, SessionJob  # noqa: E402
from muon_offload import MuondError  # noqa: E402

torch.set_num_threads(1)
DaemonTest.muond = MUOND
STEPS = 20
TAU, ALPHA = 10.0, 0.5
D, IN = 4, 24
PAIRS = [{"q": "gqa.q", "k": "gqa.k", "q_heads": 8, "kv_heads": 2, "head_dim": D},
         {"q": "mha.q", "k": "mha.k", "q_heads": 4, "kv_heads": 4, "head_dim": D}]
QK_CLIP = {"threshold": TAU, "alpha": ALPHA, "pairs": PAIRS}


def tensors(seed=3):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.5).float()

    return [{"name": "gqa.q", "param": rnd(8 * D, IN), "optimizer": "muon", "group": "muon"},
            {"name": "gqa.k", "param": rnd(2 * D, IN), "optimizer": "muon", "group": "muon"},
            {"name": "mha.q", "param": rnd(4 * D, IN), "optimizer": "muon", "group": "muon"},
            {"name": "mha.k", "param": rnd(4 * D, IN), "optimizer": "muon", "group": "muon"},
            {"name": "mlp.w", "param": rnd(IN, 40), "optimizer": "muon", "group": "muon"},
            {"name": "norm", "param": rnd(IN), "optimizer": "adamw", "group": "adamw"}]


def base_logits(step):
    """Per pair, the step's per-head maximum over the ranks: 5, 7.5, 10 (= tau: not clipped),
    12.5 or 15 by head and step, so heads cross tau at some steps and not at others."""
    out = []
    for p in PAIRS:
        out.append([5.0 + 2.5 * ((step * 7 + hd * 3) % 5) for hd in range(p["q_heads"])])
    return out


def rank_logits(step, rank, world):
    """What rank `rank` saw: the maximum on one rank per head, less on the others."""
    flat = []
    for values in base_logits(step):
        flat += [v - 2.0 * ((hd + rank) % world) for hd, v in enumerate(values)]
    return flat


def reference_clip(masters, names, logits):
    """DESIGN.md 4e in float64 on the reference's fp32 masters (rounded once, as the masters are
    fp32): returns the query heads clipped."""
    clipped = 0
    for p, s in zip(PAIRS, logits):
        hq, g, d = p["q_heads"], p["kv_heads"], p["head_dim"]
        s = torch.tensor(s, dtype=torch.float64)
        gamma = torch.where(s > TAU, TAU / s, torch.ones_like(s))
        clipped += int((s > TAU).sum())
        q = masters[names.index(p["q"])]
        k = masters[names.index(p["k"])]
        qf = torch.ones(hq, dtype=torch.float64)
        qf[s > TAU] = gamma[s > TAU] ** ALPHA
        kf = torch.ones(g, dtype=torch.float64)
        for kv in range(g):
            low = gamma[kv * (hq // g):(kv + 1) * (hq // g)].min()
            if low < 1:
                kf[kv] = low ** (1 - ALPHA)
        q.copy_((q.double() * qf.repeat_interleave(d)[:, None]).float())
        k.copy_((k.double() * kf.repeat_interleave(d)[:, None]).float())
    return clipped


def gradients(ts, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(t["param"].shape, generator=g).float() for t in ts]


class ReferenceClipTest(unittest.TestCase):
    def test_hand_computed_factors(self):
        names = ["gqa.q", "gqa.k", "mha.q", "mha.k"]
        masters = [torch.ones(8 * D, IN), torch.ones(2 * D, IN), torch.ones(4 * D, IN),
                   torch.ones(4 * D, IN)]
        # GQA: head 1 at 40 (gamma 1/4), head 6 at 12.5 (gamma 0.8); key head 0 serves query
        # heads 0-3 (min gamma 1/4), key head 1 heads 4-7 (min 0.8). MHA: nothing over tau.
        logits = [[1, 40, 3, 4, 5, 6, 12.5, 10], [10, 9, -3, 0]]
        self.assertEqual(reference_clip(masters, names, logits), 2)
        q, k = masters[0], masters[1]
        self.assertAlmostEqual(q[1 * D, 0].item(), 0.5, places=6)          # (1/4)^0.5
        self.assertAlmostEqual(q[6 * D, 0].item(), math.sqrt(0.8), places=6)
        self.assertEqual(q[0, 0].item(), 1.0)
        self.assertEqual(q[7 * D, 0].item(), 1.0)                          # at tau: untouched
        self.assertAlmostEqual(k[0, 0].item(), 0.5, places=6)              # (1/4)^(1-0.5)
        self.assertAlmostEqual(k[D, 0].item(), math.sqrt(0.8), places=6)
        self.assertTrue(torch.equal(masters[2], torch.ones(4 * D, IN)))
        self.assertTrue(torch.equal(masters[3], torch.ones(4 * D, IN)))


class HelpersTest(unittest.TestCase):
    """The trainer-side helpers of muon_offload.qk_clip against attention computed by torch."""

    def test_head_max_logits_grouped_and_causal(self):
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, 8, 5, 4, generator=g)
        k = torch.randn(2, 2, 5, 4, generator=g)
        got = h.mo.head_max_logits(q, k, scale=0.5, causal=True)
        for head in range(8):
            kk = k[:, head // 4]
            logits = (q[:, head] @ kk.transpose(-1, -2)) * 0.5
            logits = logits.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -1e9)
            self.assertAlmostEqual(got[head].item(), logits.max().item(), places=5)

    def test_multihead_attention_hook_sees_the_logits_softmax_takes(self):
        torch.manual_seed(3)
        mha = torch.nn.MultiheadAttention(16, 4, kdim=12, vdim=12, batch_first=True)
        rec = h.mo.MaxLogitRecorder()
        handle = h.mo.watch_multihead_attention(mha, rec)
        x, kv = torch.randn(2, 6, 16), torch.randn(2, 7, 12)
        pad = torch.zeros(2, 7, dtype=torch.bool)
        pad[1, 5:] = True
        _, weights = mha(x, kv, kv, key_padding_mask=pad, need_weights=True,
                         average_attn_weights=False)
        handle.remove()
        maxima = rec.take()[mha.q_proj_weight]
        # The hook's logits, recomputed the same way, softmax to the module's own weights.
        d = mha.head_dim
        q = torch.nn.functional.linear(x, mha.q_proj_weight, mha.in_proj_bias[:16])
        k = torch.nn.functional.linear(kv, mha.k_proj_weight, mha.in_proj_bias[16:32])
        q, k = q.view(2, 6, 4, d).transpose(1, 2), k.view(2, 7, 4, d).transpose(1, 2)
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
        self.assertTrue(torch.allclose(logits.softmax(-1), weights, atol=1e-6))
        self.assertTrue(torch.allclose(maxima, logits.amax(dim=(0, 2, 3)), atol=1e-6))
        pair = h.mo.multihead_attention_pair(mha)
        self.assertEqual((pair["q_heads"], pair["kv_heads"], pair["head_dim"]), (4, 4, 4))
        with self.assertRaises(ValueError):
            h.mo.multihead_attention_pair(torch.nn.MultiheadAttention(16, 4))

    def test_recorder_keeps_the_maximum_until_taken(self):
        rec = h.mo.MaxLogitRecorder()
        rec.record("a", torch.tensor([1.0, 5.0]))
        rec.record("a", torch.tensor([3.0, 2.0]))
        self.assertEqual(rec.take()["a"].tolist(), [3.0, 5.0])
        self.assertEqual(rec.take(), {})


class TrajectoryTest(DaemonTest):
    CASES = [(1, 0, ("grpc",)), (1, 0, ("shm",)), (2, 1, ("shm",)), (2, 2, ("grpc", "shm")),
             (2, 3, ("shm",)), (4, 2, ("grpc",)), (4, 3, ("shm", "grpc"))]

    def run_case(self, world, stage, transports):
        ts = tensors()
        names = [t["name"] for t in ts]
        what = f"world {world} stage {stage} {'/'.join(transports)}"
        job = SessionJob(self.daemon.address, f"qk-{world}-{stage}-{transports[0]}", ts,
                         torch.float32, world, stage, transports, qk_clip=QK_CLIP)
        try:
            self.assertRanksOk(job.upload(), f"{what}: upload")
            ref = h.reference_for(ts)
            clipped = 0
            for step in range(STEPS):
                lr, wd = h.lr_at(step)
                grads = gradients(ts, step)
                errors = job.step(lambda r: grads, lr, wd,
                                  max_logits_of_rank=lambda r: rank_logits(step, r, world))
                self.assertRanksOk(errors, f"{what} step {step}")
                ref.step(grads, lr, wd)
                clipped += reference_clip(ref.masters, names, base_logits(step))
            self.assertGreater(clipped, 0)
            self.assertParamsMatch(job, ref, what)
            with tempfile.TemporaryDirectory() as d:
                exported = job.export(os.path.join(d, "model.safetensors"))
            self.assertMastersMatch(exported, ref, what)
            return clipped
        finally:
            job.close()

    def test_masters_follow_the_reference(self):
        for world, stage, transports in self.CASES:
            with self.subTest(world=world, stage=stage, transports=transports):
                clipped = self.run_case(world, stage, transports)
                print(f"world {world} stage {stage} {'/'.join(transports)}: {STEPS} steps, "
                      f"{clipped} query heads clipped, masters within {MASTER_TOLERANCE:g}")


class RestartTest(unittest.TestCase):
    """Checkpoints hold the clipped masters: 10 steps, SIGTERM (the daemon saves at shutdown),
    a new daemon on the same state directory, 10 more steps; the masters are bit-identical to 20
    steps without the restart."""

    def start(self, state):
        d = h.Daemon.__new__(h.Daemon)  # a Daemon on a state directory that outlives it
        d.tmp = tempfile.TemporaryDirectory(prefix="muond-qk-restart-")
        d.address = f"unix://{d.tmp.name}/muond.sock"
        d.log_path = os.path.join(d.tmp.name, "muond.log")
        d.log = open(d.log_path, "ab")
        d.proc = h.subprocess.Popen([MUOND, "--listen", d.address, "--state-dir", state,
                                     "--threads", "1", "--metrics-address", "off"],
                                    stderr=d.log)
        deadline = h.time.time() + 20
        while True:
            try:
                with h.mo.Client(d.address) as c:
                    c.health(0.5)
                return d
            except MuondError:
                if d.proc.poll() is not None or h.time.time() > deadline:
                    raise RuntimeError(f"muond did not start:\n{d.read_log()}")
                h.time.sleep(0.1)

    def steps(self, job, first, last):
        for step in range(first, last):
            lr, wd = h.lr_at(step)
            grads = gradients(job.tensors, step)
            self.assertRanksOk(job.step(lambda r: grads, lr, wd,
                                        max_logits_of_rank=lambda r: rank_logits(step, r, 2)))

    def assertRanksOk(self, errors):
        failed = [e for e in errors if e is not None]
        if failed:
            raise AssertionError(f"a rank failed: {failed[0]}") from failed[0]

    def test_a_restarted_daemon_continues_bit_identically(self):
        with tempfile.TemporaryDirectory(prefix="muond-qk-state-") as state:
            d = self.start(state)
            whole = SessionJob(d.address, "qk-whole", tensors(), torch.float32, 2, 2, ("shm",),
                               qk_clip=QK_CLIP)
            cut = SessionJob(d.address, "qk-cut", tensors(), torch.float32, 2, 2, ("shm",),
                             qk_clip=QK_CLIP)
            for job in (whole, cut):
                self.assertRanksOk(job.upload())
            self.steps(whole, 0, STEPS)
            want = whole.export(os.path.join(state, "whole.safetensors"))
            self.steps(cut, 0, STEPS // 2)
            token = cut.token
            cut.close(delete=False)
            whole.close()
            self.assertEqual(d.stop(), 0)
            d = self.start(state)
            cut = SessionJob(d.address, "qk-cut", tensors(), torch.float32, 2, 2, ("shm",),
                             qk_clip=QK_CLIP, token=token, first_step=STEPS // 2)
            self.steps(cut, STEPS // 2, STEPS)
            got = cut.export(os.path.join(state, "cut.safetensors"))
            cut.close()
            self.assertEqual(d.stop(), 0)
        for name in want:
            self.assertTrue(torch.equal(want[name], got[name]), name)
        print(f"restart after step {STEPS // 2 - 1}: {len(want)} masters bit-identical after "
              f"{STEPS} steps")


class RefusalTest(DaemonTest):
    def job(self, job_id, qk_clip=QK_CLIP, world=1, stage=0, ts=None):
        return SessionJob(self.daemon.address, job_id, ts or tensors(), torch.float32, world,
                          stage, ("shm",), qk_clip=qk_clip)

    def test_steps_without_valid_max_logits_are_refused(self):
        job = self.job("qk-refuse")
        try:
            self.assertRanksOk(job.upload(), "upload")
            lr, wd = h.lr_at(0)
            grads = gradients(job.tensors, 0)
            before = job.export(os.path.join(self.daemon.tmp.name, "before.safetensors"))
            # No max logits at all: refused by the client before anything is sent.
            errors = job.step(lambda r: grads, lr, wd)
            self.assertRefused(errors, "INVALID_ARGUMENT", "QK-Clip", "gqa.q")
            s = job.sessions[0]
            for bad, phrases in (([1.0] * 11, ("12 in all", "mha.q")),
                                 ([1.0] * 13, ("13 max attention logits", "12 query heads")),
                                 ([1.0] * 5 + [float("nan")] + [1.0] * 6,
                                  ("head 5", "gqa.q", "not finite")),
                                 ([1.0] * 9 + [float("inf")] + [1.0] * 2,
                                  ("head 1", "mha.q", "not finite"))):
                with self.assertRaises(MuondError) as e:
                    s.set_max_logits(bad)
                self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
                for phrase in phrases:
                    self.assertIn(phrase, str(e.exception))
            # A step refused for a non-finite gradient changes nothing, clipped heads included.
            bad_grads = [g.clone() for g in grads]
            bad_grads[0][3, 1] = float("nan")
            errors = job.step(lambda r: bad_grads, lr, wd,
                              max_logits_of_rank=lambda r: [50.0] * 12)
            self.assertRefused(errors, "INVALID_ARGUMENT", "gqa.q")
            after = job.export(os.path.join(self.daemon.tmp.name, "after.safetensors"))
            for name in before:
                self.assertTrue(torch.equal(before[name], after[name]), name)
        finally:
            job.close()

    def test_jobs_it_refuses_to_create(self):
        ts = tensors()
        adamw_q = [dict(t) for t in ts]
        adamw_q[0]["optimizer"], adamw_q[0]["group"] = "adamw", "adamw"
        cases = [
            ("qk_clip.pairs[0].q", "optimized by AdamW", adamw_q, QK_CLIP),
            ("qk_clip.pairs[0].k", "expected [kv_heads * head_dim, in]", ts,
             {**QK_CLIP, "pairs": [{**PAIRS[0], "kv_heads": 4}]}),
            ("qk_clip.pairs[0]", "does not divide q_heads", ts,
             {**QK_CLIP, "pairs": [{**PAIRS[0], "kv_heads": 3}]}),
            ("qk_clip.pairs[1].k", "may be in one pair only", ts,
             {**QK_CLIP, "pairs": [PAIRS[0], {**PAIRS[1], "k": "gqa.k", "kv_heads": 2}]}),
            ("qk_clip.pairs[0].q", "is not a tensor of the job", ts,
             {**QK_CLIP, "pairs": [{**PAIRS[0], "q": "nope"}]}),
            ("qk_clip.threshold", "must be finite and > 0", ts, {**QK_CLIP, "threshold": 0}),
            ("qk_clip.alpha", "must be in [0, 1]", ts, {**QK_CLIP, "alpha": 1.5}),
        ]
        for field, phrase, model, block in cases:
            with self.subTest(field=field):
                spec = h.job_spec(f"qk-bad-{len(field)}", model, torch.float32, qk_clip=block)
                with h.mo.Client(self.daemon.address) as c:
                    with self.assertRaises(MuondError) as e:
                        c.create_job(spec)
                self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
                self.assertIn(field, str(e.exception))
                self.assertIn(phrase, str(e.exception))


class OptimizerTest(DaemonTest):
    """MuonWithAuxAdam(mode="apply", qk_clip=...) on one rank: step(max_logits=...) (the whole
    step in step()) and set_max_logits() after the forward (the backward streams the step)."""

    def run_optimizer(self, streamed):
        ts = tensors()
        names = [t["name"] for t in ts]
        params = {t["name"]: torch.nn.Parameter(t["param"].clone()) for t in ts}
        kinds = {t["name"]: t["optimizer"] for t in ts}
        opt = h.apply_optimizer(
            params, kinds, address=self.daemon.address,
            qk_clip={"threshold": TAU, "alpha": ALPHA,
                     "pairs": [{**p, "q": params[p["q"]], "k": params[p["k"]]} for p in PAIRS]})
        ref = h.reference_for(ts)
        try:
            for step in range(6):
                grads = gradients(ts, step)
                logits = base_logits(step)
                by_q = {params[p["q"]]: torch.tensor(v) for p, v in zip(PAIRS, logits)}
                if streamed:
                    opt.set_max_logits(by_q)  # after the forward, before the backward
                # A "backward": the gradients land as autograd would leave them.
                loss = sum((params[n] * g).sum() for n, g in zip(names, grads))
                loss.backward()
                opt.step() if streamed else opt.step(max_logits=by_q)
                opt.zero_grad(set_to_none=True)
                ref.step(grads, {"muon": 0.02, "adamw": 0.01}, {"muon": 0.1, "adamw": 0.01})
                reference_clip(ref.masters, names, logits)
            for n, m in zip(names, ref.masters):
                err = h.relative_error(params[n].detach(), m.double())
                self.assertLess(err, MASTER_TOLERANCE, n)
            with self.assertRaises(ValueError) as e:
                opt.step(max_logits={params["gqa.q"]: torch.ones(8)})
            self.assertIn("mha.q", str(e.exception))
        finally:
            opt.close(delete_job=True)

    def test_step_max_logits(self):
        self.run_optimizer(streamed=False)

    def test_set_max_logits_before_backward_streams(self):
        self.run_optimizer(streamed=True)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[3:], verbosity=2)
