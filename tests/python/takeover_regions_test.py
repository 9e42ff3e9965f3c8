#!/usr/bin/python3
"""A takeover (a restarted trainer attaching its rank again with takeover=True) releases the old
session's shared-memory regions at once: the daemon's resident memory after the takeover is that
of one session's regions, not two.

Usage: takeover_regions_test.py MUOND_BIN LIBMUOND_CLIENT DATA_DIR [unittest names...]
"""
import sys
import time
import unittest

import muon_offload_test as base  # noqa: E402  (parses the same arguments, starts nothing)

import torch  # noqa: E402

import muon_offload as mo  # noqa: E402
from muon_offload import MuondError  # noqa: E402

# 256 matrices of 256 x 256, fp32: 64 MiB per buffer, 256 MiB of regions per session (small
# matrices: Newton-Schulz is cheap, the regions are what is measured).
MiB = 1 << 20


def resident_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def settled_rss(pid, seconds=1.0):
    """The daemon's resident memory once it stopped moving (the old regions go when the event
    loop has ended the old session)."""
    deadline = time.time() + seconds
    last = resident_bytes(pid)
    while time.time() < deadline:
        time.sleep(0.1)
        now = resident_bytes(pid)
        last = now
    return last


class TakeoverRegionsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = base.Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.close(unittest.TestCase())

    def test_takeover_releases_the_old_regions_at_once(self):
        pid = self.daemon.proc.pid
        with mo.Client(self.daemon.address) as client:
            spec = {"job_id": "takeover-regions", "world_size": 1, "zero_stage": 0,
                    "matrices": [{"name": f"w{i}", "shape": [256, 256], "dtype": "float32"}
                                 for i in range(256)]}
            token = client.create_job(spec)
            before = settled_rss(pid)
            first = client.attach("takeover-regions", 0, token, transport="shm")
            grads = torch.randn(first.buffer_elements, generator=torch.Generator().manual_seed(1))
            for step in (0, 1):  # both momentum buffers and both region buffers touched
                first.gradient_view(step).copy_(grads)
                first.step_in_place(step)
            one = settled_rss(pid)
            regions = one - before
            # The trainer restarts: the old process is gone without detaching, its handle unused.
            second = client.attach("takeover-regions", 0, token, takeover=True, transport="shm")
            for step in (2, 3):
                second.gradient_view(step).copy_(grads)
                second.step_in_place(step)
            after = settled_rss(pid, 2.0)
            print(f"daemon resident memory: before attach {before / MiB:.0f} MiB, one session "
                  f"{one / MiB:.0f} MiB (+{regions / MiB:.0f} MiB), after the takeover "
                  f"{after / MiB:.0f} MiB")
            self.assertGreater(regions, 200 * MiB, "the regions are resident (mlocked)")
            # Two sessions' regions would be +2x; one session's within 25%.
            self.assertLess(after - before, regions * 1.25,
                            "the old session's regions were not released at the takeover")
            with self.assertRaises(MuondError):
                first.step_in_place(4)  # the old session is over
            second.close()
            first.close()
            client.delete_job("takeover-regions", token)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:], verbosity=2)
