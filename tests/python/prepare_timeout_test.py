#!/usr/bin/python3
"""Two-phase steps (a multi-node job's node part, DESIGN.md 4c). A step that the trainer neither commits
nor aborts is dropped after --prepare-timeout-seconds: the state is unchanged (the job expects the
step again and computes the same result from it), the job is not fenced, a late CommitStep is
refused FAILED_PRECONDITION saying the step was dropped by the prepare timeout, and the daemon logs
it. A step committed in time is not touched by the timeout. RollbackStep undoes a committed step
(RollbackTest).

Usage: prepare_timeout_test.py MUOND_BIN LIBMUOND_CLIENT DATA_DIR [unittest names...]
"""
import os
import sys
import time
import unittest

import muon_offload_test as base  # noqa: E402  (parses the same arguments, starts nothing)

import torch  # noqa: E402

import muon_offload as mo  # noqa: E402
from muon_offload import MuondError, _native  # noqa: E402

TIMEOUT_SECONDS = 1


def node_job(client, name):
    spec = {"job_id": name, "world_size": 1, "zero_stage": 0,
            "muon": {"momentum": 0.9, "nesterov": True, "ns_steps": 5},
            "matrices": [{"name": "a", "shape": [16, 24], "dtype": "float32"}],
            "multinode": {"global_job_id": name + "-global", "node": 0, "nodes": 1}}
    return client.create_job(spec)


class TwoPhaseCase(unittest.TestCase):
    """A daemon with a short prepare timeout, a client, and the two-phase calls."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = base.Daemon(["--prepare-timeout-seconds", str(TIMEOUT_SECONDS)])

    @classmethod
    def tearDownClass(cls):
        cls.daemon.close(unittest.TestCase())

    def setUp(self):
        self.client = mo.Client(self.daemon.address)

    def tearDown(self):
        self.client.close()

    def commit(self, job, token, step):
        _native.call("muond_step_commit", self.client.handle, job.encode(), token.encode(), step)

    def step(self, session, step, grads):
        out = torch.empty(session.buffer_elements)
        session.step_buffer(step, grads, out)
        return out


class PrepareTimeoutTest(TwoPhaseCase):
    def test_prepared_step_dropped_after_the_timeout(self):
        token = node_job(self.client, "prepared-timeout")
        s = self.client.attach("prepared-timeout", 0, token, transport="grpc")
        grads = torch.randn(s.buffer_elements, generator=torch.Generator().manual_seed(5))
        first = self.step(s, 0, grads)  # computed: prepared, awaiting the trainer's word
        time.sleep(TIMEOUT_SECONDS + 1.0)  # the registry checks every 250 ms
        with self.assertRaises(MuondError) as e:
            self.commit("prepared-timeout", token, 0)
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        self.assertIn("dropped while prepared", e.exception.message)
        self.assertIn(f"prepare timeout of {TIMEOUT_SECONDS} s (--prepare-timeout-seconds)",
                      e.exception.message)
        # State unchanged: step 0 again gives the same update (momentum still zero), commits.
        again = self.step(s, 0, grads)
        self.assertTrue(torch.equal(first, again))
        self.commit("prepared-timeout", token, 0)
        second = self.step(s, 1, grads)  # momentum 0.9 * m + g now: differs from step 0
        self.assertFalse(torch.equal(second, first))
        self.commit("prepared-timeout", token, 1)
        self.assertIn("prepared step 0 dropped: neither committed nor aborted by the trainer "
                      "within the prepare timeout", self.daemon.read_log())
        s.close()
        self.client.delete_job("prepared-timeout", token)

    def test_step_committed_in_time_is_kept(self):
        token = node_job(self.client, "prepared-in-time")
        s = self.client.attach("prepared-in-time", 0, token, transport="grpc")
        grads = torch.randn(s.buffer_elements, generator=torch.Generator().manual_seed(6))
        self.step(s, 0, grads)
        self.commit("prepared-in-time", token, 0)
        time.sleep(TIMEOUT_SECONDS + 1.0)
        self.commit("prepared-in-time", token, 0)  # committed: a second commit answers OK
        with self.assertRaises(MuondError) as e:  # step 1 never ran: nothing to commit
            self.commit("prepared-in-time", token, 1)
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        s.close()
        self.client.delete_job("prepared-in-time", token)


class RollbackTest(TwoPhaseCase):
    """RollbackStep (the commit window across nodes, issue 34): a committed two-phase step is
    undone (the state before it back from the double buffer; the job expects it again and
    computes the same result), a prepared one is dropped, and what can no longer be undone is
    refused FAILED_PRECONDITION with the state unchanged."""

    def rollback(self, job, token, step, reason="test"):
        _native.call("muond_step_rollback", self.client.handle, job.encode(), token.encode(),
                     step, reason.encode())

    def refused(self, fn, phrase):
        with self.assertRaises(MuondError) as e:
            fn()
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION", e.exception.message)
        self.assertIn(phrase, e.exception.message)

    def test_committed_step_rolls_back_and_runs_again_the_same(self):
        job = "rollback-committed"
        token = node_job(self.client, job)
        s = self.client.attach(job, 0, token, transport="grpc")
        g = [torch.randn(s.buffer_elements, generator=torch.Generator().manual_seed(k))
             for k in range(3)]
        self.step(s, 0, g[0])
        self.commit(job, token, 0)
        first = self.step(s, 1, g[1])
        self.commit(job, token, 1)
        self.rollback(job, token, 1, "node 1's commit failed")
        self.rollback(job, token, 1)  # a second rank of the node: OK, nothing more
        self.refused(lambda: self.commit(job, token, 1),
                     "rolled back after its commit: node 1's commit failed")
        self.refused(lambda: self.rollback(job, token, 0), "only the last step committed")
        again = self.step(s, 1, g[1])  # the momentum after step 0 again: the same bits
        self.assertTrue(torch.equal(first, again))
        self.commit(job, token, 1)
        after = self.step(s, 2, g[2])
        self.commit(job, token, 2)
        # A step prepared here but never committed: the rollback drops it.
        self.step(s, 3, g[0])
        self.rollback(job, token, 3)
        self.refused(lambda: self.commit(job, token, 3), "rolled back")
        self.step(s, 3, g[0])
        self.commit(job, token, 3)
        self.assertFalse(torch.equal(after, first))
        self.assertIn("step 1 rolled back after its commit: node 1's commit failed",
                      self.daemon.read_log())
        s.close()
        self.client.delete_job(job, token)

    def test_what_cannot_be_undone_is_refused(self):
        job = "rollback-refused"
        token = node_job(self.client, job)
        s = self.client.attach(job, 0, token, transport="grpc")
        g = torch.randn(s.buffer_elements, generator=torch.Generator().manual_seed(9))
        self.step(s, 0, g)
        self.commit(job, token, 0)
        # A checkpoint of the step was saved: the state on disk holds it.
        self.client.checkpoint_save(job, token)
        self.refused(lambda: self.rollback(job, token, 0), "a checkpoint is saved or loaded")
        # A later step began (it writes the double buffer's other half).
        self.step(s, 1, g)
        self.refused(lambda: self.rollback(job, token, 0), "a later step begins")
        self.commit(job, token, 1)
        expected = self.step(s, 2, g)  # the state is what the refusals left: steps 0 and 1
        self.commit(job, token, 2)
        s.close()
        self.client.delete_job(job, token)
        # The same three steps on a fresh job give the same update: nothing was undone.
        token = node_job(self.client, job)
        s = self.client.attach(job, 0, token, transport="grpc")
        for step in range(2):
            self.step(s, step, g)
            self.commit(job, token, step)
        self.assertTrue(torch.equal(self.step(s, 2, g), expected))
        s.close()
        self.client.delete_job(job, token)
        # A job of one node commits by itself: nothing to roll back.
        plain = self.client.create_job({"job_id": "rollback-plain", "world_size": 1,
                                        "zero_stage": 0,
                                        "matrices": [{"name": "a", "shape": [4, 8]}]})
        self.refused(lambda: self.rollback("rollback-plain", plain, 0), "not a multi-node job")
        self.client.delete_job("rollback-plain", plain)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:], verbosity=2)
