"""Many nodes emulated on one machine (DESIGN.md 4c): each emulated node has its own muond
(socket, state dir); the ranks of a gloo world are grouped into nodes by an explicit node map.
multinode_worker.py runs the ranks; this module starts the daemons and asserts on the ranks'
result files.

Usage: multinode_test.py MUOND_BIN [unittest args]
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import muon_offload as mo  # noqa: E402
from muon_offload.client import layout_spans  # noqa: E402
from muon_offload.multinode_plan import (ownership_pieces,  # noqa: E402
                                         ownership_plan)
from muon_offload import MuondError  # noqa: E402

MUOND = None
PYTHON = "/usr/bin/python3"


class NodeDaemon:
    """One emulated node's muond: its socket and state directory under `root`."""

    def __init__(self, root, name, extra=(), env=None):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir)
        self.address = f"unix://{self.dir}/muond.sock"
        self.log = os.path.join(self.dir, "muond.log")
        self.argv = [MUOND, "--listen", self.address, "--state-dir",
                     os.path.join(self.dir, "state"), "--threads", "1",
                     "--metrics-address", "off", *extra]
        self.log_file = open(self.log, "ab")
        self.proc = subprocess.Popen(self.argv, stderr=self.log_file,
                                     env=dict(os.environ, **(env or {})))
        deadline = time.time() + 30
        while True:
            try:
                with mo.Client(self.address) as c:
                    c.health(0.5)
                return
            except MuondError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"muond {name} did not start:\n{open(self.log).read()}")
                time.sleep(0.1)

    def stop(self):
        """SIGTERM (this process's daemon, or a restarted one found by its socket's peer)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.log_file.close()
        out = subprocess.run(["pgrep", "-f", "--", f"--listen {self.address}"],
                             capture_output=True, text=True).stdout.split()
        for pid in out:  # a daemon a rank restarted (its own process id, found by its socket)
            os.kill(int(pid), signal.SIGTERM)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiNodeTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="muond-multinode-")
        self.daemons = []

    def tearDown(self):
        for d in self.daemons:
            d.stop()
        if not os.environ.get("MUOND_TEST_KEEP_ROOT"):
            shutil.rmtree(self.root, ignore_errors=True)

    def run_world(self, nodes, scenario, node_extra=None, killed=(), node_env=None, prefix="",
                  **fields):
        """Starts one daemon per node plus the single daemon (unless running), runs the ranks,
        returns their results (rank order; None for the ranks in `killed`, which must die of
        SIGKILL)."""
        if not self.daemons:
            single = NodeDaemon(self.root, f"{prefix}single")
            self.daemons.append(single)
            for n in range(max(nodes) + 1):
                extra = (node_extra or {}).get(n, ())
                self.daemons.append(NodeDaemon(self.root, f"{prefix}node{n}", extra,
                                               (node_env or {}).get(n)))
        single, node_daemons = self.daemons[0], self.daemons[1:]
        out = os.path.join(self.root, "out")
        os.makedirs(out, exist_ok=True)
        cfg = {"world": len(nodes), "nodes": nodes, "single": single.address,
               "addresses": [d.address for d in node_daemons], "port": free_port(), "out": out,
               "scenario": scenario,
               "daemons": [{"argv": d.argv, "log": d.log, "pid": d.proc.pid}
                           for d in node_daemons], **fields}
        path = os.path.join(self.root, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([PYTHON, os.path.join(HERE, "multinode_worker.py"), path,
                                   str(r)], env=env) for r in range(len(nodes))]
        codes = [p.wait(timeout=900) for p in procs]
        results = []
        for r in range(len(nodes)):
            if r in killed:
                results.append(None)
                continue
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
        traces = [f"rank {r}: {res.get('trace')}" for r, res in enumerate(results)
                  if res is not None and "exception" in res]
        self.assertEqual(traces, [], "\n".join(traces))
        self.assertEqual(codes, [-signal.SIGKILL if r in killed else 0
                                 for r in range(len(nodes))])
        return results

    def check_identical(self, nodes, **kw):
        results = self.run_world(nodes, "identical", **kw)
        for r, res in enumerate(results):
            for case, c in res.items():
                self.assertEqual(c["bitwise_steps"], 10, f"rank {r} {case}")
                self.assertEqual(c["nodes"], max(nodes) + 1)
                self.assertEqual(c["job_show"], [f"global_job: {c['global_job']}",
                                                 f"node: {c['node']} of {c['nodes']} (steps "
                                                 "two-phase)"], f"rank {r} {case}")
                self.assertEqual(c["bytes"], c["expected_bytes"], f"rank {r} {case}")
                # The big embedding's AdamW state is more than a node's share: split by rows.
                self.assertEqual(c["split"], ["embed"] if "-split" in case else [],
                                 f"rank {r} {case}")
                self.assertEqual(c["route_device"], "cpu" if case.endswith("-route-cpu")
                                 else "None", f"rank {r} {case}")
        for case in results[0]:  # a rank may hold only what its own node owns; not all of them
            self.assertGreater(sum(res[case]["bytes"][0] for res in results), 0, case)
        print(json.dumps({case: [res[case]["bytes"][0] for res in results]
                          for case in results[0]}), file=sys.stderr)

    def test_two_nodes_of_two_ranks_bit_identical(self):
        self.check_identical([0, 0, 1, 1], bf16=True)  # and apply mode in bfloat16

    def test_reshard_two_to_three_nodes_through_export(self):
        """2 nodes x 2 ranks train 4 steps and export every node's state into one directory;
        jobs on 3 nodes x 2 ranks are created from it and continue: every step bit-identical
        to an uninterrupted run (update mode stage 2, apply mode stage 3)."""
        self.daemons.append(NodeDaemon(self.root, "single"))
        for n in range(3):  # phase 1 uses nodes 0 and 1
            self.daemons.append(NodeDaemon(self.root, f"node{n}"))
        export = os.path.join(self.root, "export")
        first = self.run_world([0, 0, 1, 1], "reshard", export_root=export)
        second = self.run_world([0, 0, 1, 1, 2, 2], "reshard_resume", export_root=export)
        for r, res in enumerate(first):
            for case, c in res.items():
                self.assertEqual(c["bitwise_before"], 4, f"rank {r} {case}")
                self.assertEqual(c["exported"]["next_step"], 4)
                self.assertEqual([n["node"] for n in c["exported"]["nodes"]], [0, 1])
                if case.endswith("apply"):  # the embedding in 2 row ranges, re-cut into 3 after
                    self.assertEqual(sorted(p[2] for p in c["pieces"]), [0, 1], c["pieces"])
        for r, res in enumerate(second):
            for case, c in res.items():
                self.assertEqual(c["resumed_at"], 4, f"rank {r} {case}")
                self.assertEqual(c["nodes"], 3)
                self.assertEqual(c["files"], [f"reshard2-{case}.node{n}.{kind}"
                                              for n in (0, 1)
                                              for kind in ("manifest.json", "safetensors")])
                self.assertEqual(c["bitwise_after"], 4, f"rank {r} {case}")
                if case.endswith("apply"):
                    self.assertEqual(sorted(p[2] for p in c["pieces"]), [0, 1, 2], c["pieces"])
                    self.assertEqual(c["pieces"][-1][1], 1024)

    def test_global_clipping_across_nodes(self):
        """max_grad_norm over 2 nodes x 2 ranks (apply mode, stages 2 and 3, the embedding split
        by rows): the steps whose global norm exceeds it are recomputed on every node with the
        global clip; the result matches torch.nn.utils.clip_grad_norm_ over the whole model
        (ApplyReference) and one daemon clipping by itself. A node job with max_grad_norm refuses
        a step without the global clip (FAILED_PRECONDITION), and a job of one node refuses a
        global clip (INVALID_ARGUMENT)."""
        results = self.run_world([0, 0, 1, 1], "clip")
        for r, res in enumerate(results):
            for case in ("s2", "s3"):
                c = res[case]
                self.assertEqual(c["clipped_steps"], 3, f"rank {r} {case}")
                self.assertEqual(c["split"], ["embed"])
                for got, want in zip(c["norms"], c["ref_norms"]):
                    self.assertAlmostEqual(got, want, delta=1e-5 * want, msg=f"rank {r} {case}")
                self.assertLess(c["max_diff_ref"], 2e-5, f"rank {r} {case}")
                self.assertLess(c["max_diff_single"], 2e-6, f"rank {r} {case}")
        refusals = results[0]["refusals"]
        for transport in ("shm", "grpc"):
            code, message = refusals[f"no_coordinator-{transport}"]
            self.assertEqual(code, "FAILED_PRECONDITION", message)
            self.assertIn("needs a coordinating client that sends the global clip", message)
            code, message = refusals[f"not_a_node-{transport}"]
            self.assertEqual(code, "INVALID_ARGUMENT", message)
            self.assertIn("not a multi-node job with max_grad_norm", message)
            # A NaN sum is refused by the client library before anything is sent.
            code, message = refusals[f"bad_sum-{transport}"]
            self.assertEqual(code, "INVALID_ARGUMENT", message)
            self.assertIn("must be finite and >= 0", message)
        print(json.dumps({case: {k: results[0][case][k] for k in
                                 ("max_diff_ref", "max_diff_single", "bitwise_single", "norms")}
                          for case in ("s2", "s3")}), file=sys.stderr)

    def test_nccl_routing_on_gpus(self):
        """An NCCL world routes on the GPU (reduce-scatter, both all-to-alls and the all-gather
        on CUDA tensors, one copy into and out of each node's region) with the bits of the gloo
        route. Needs 2 CUDA devices (NCCL puts one rank on each); skipped otherwise."""
        import torch
        import torch.distributed as dist
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < 2 or not dist.is_nccl_available():
            reason = f"NCCL routing needs 2 CUDA devices and NCCL (found {found} device(s))"
            print(reason, file=sys.stderr)
            self.skipTest(reason)
        results = self.run_world([0, 1], "nccl", backend="nccl")
        for r, res in enumerate(results):
            self.assertEqual(res["bitwise_steps"], 10, f"rank {r}")
            self.assertEqual(res["route_devices"], ["None", f"cuda:{r}"])

    def test_spec_and_plan_checks(self):
        """No daemon: the "multinode" block's checks and the plan's, through the client library."""
        spec = {"job_id": "j", "matrices": [{"name": "a", "shape": [4, 8]},
                                            {"name": "b", "shape": [8, 8]}]}
        for block, phrase in (({"global_job_id": "g", "node": 2, "nodes": 2},
                               "multinode.node 2 is outside 0..1"),
                              ({"global_job_id": "g", "node": 0}, "multinode.nodes: missing"),
                              ({"global_job_id": "g/x", "node": 0, "nodes": 1},
                               "multinode.global_job_id"),
                              ({"global_job_id": "g", "node": 0, "nodes": 1, "x": 1},
                               "multinode.x")):
            with self.assertRaises(MuondError) as e:
                layout_spans(dict(spec, multinode=block), 0)
            self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
            self.assertIn(phrase, e.exception.message)
        self.assertEqual(layout_spans(dict(spec, multinode={"global_job_id": "g", "node": 1,
                                                            "nodes": 2}), 0)[1], 96)
        owner, flops, size = ownership_plan(spec, 2)
        self.assertEqual(owner, [1, 0])  # b (more FLOPs) first, on node 0
        self.assertEqual(size, [256.0, 128.0])
        with self.assertRaises(MuondError) as e:
            ownership_plan(spec, 3)
        self.assertIn("2 tensors for 3 nodes", e.exception.message)
        # An AdamW tensor larger than a node's share is split by rows: the pieces (tensor, rows,
        # node) cover it once, and muonctl plan prints them.
        big = {"job_id": "b", "mode": "apply", "groups": [{"name": "g", "lr": 0.1}],
               "tensors": [{"name": f"w{i}", "shape": [512, 512], "group": "g"}
                           for i in range(4)]
               + [{"name": "embed", "shape": [20000, 256], "optimizer": "adamw", "group": "g"}]}
        pieces = ownership_pieces(big, 3)
        embed = [p for p in pieces if p[0] == 4]
        self.assertEqual([(p[1], p[2]) for p in embed], [(0, 6894), (6894, 13788), (13788, 20000)])
        self.assertEqual(sorted(p[3] for p in embed), [0, 1, 2])
        self.assertEqual([p[1:3] for p in pieces if p[0] < 4], [(0, 512)] * 4)
        path = os.path.join(self.root, "big.json")
        with open(path, "w") as f:
            json.dump(big, f)
        out = subprocess.run([os.path.join(os.path.dirname(MUOND), "muonctl"), "plan", path, "3"],
                             capture_output=True, text=True, check=True).stdout
        self.assertIn("nodes: 3 (5 tensors)", out)
        self.assertIn("tensor 'embed' split by rows: node ", out)
        self.assertIn("rows [13788, 20000)", out)

    def test_three_nodes_of_two_ranks_bit_identical(self):
        self.check_identical([0, 0, 1, 1, 2, 2])

    def check_fault(self, kind, mode="update", stage=2, code=None, phrase="", node_extra=None,
                    **kw):
        """2 nodes x 2 ranks; a fault in step 3 on node 1: every rank raises the same error, no
        node commits the step, and after recovery (checkpoint of step 2) steps 2..5 are
        bit-identical to the single daemon's."""
        results = self.run_world([0, 0, 1, 1], "fault", node_extra=node_extra, fault=kind,
                                 mode=mode, stage=stage, **kw)
        for r, res in enumerate(results):
            self.assertIsNotNone(res["error"], f"rank {r}")
            if code:
                self.assertEqual(res["error"]["code"], code, f"rank {r}: {res['error']}")
            self.assertIn("committed on no node", res["error"]["message"])
            self.assertIn(phrase, res["error"]["message"])
            self.assertTrue(res["same_error_everywhere"], f"rank {r}")
            self.assertTrue(res["unchanged_step"], f"rank {r}")
            self.assertEqual(res["resumed_at"], res["saved_step"])
            self.assertEqual(res["bitwise_after_recovery"], 4, f"rank {r}")
            probe = res["node_commit_probe"]
            if probe is not None:  # the node's local rank 0: its daemon did not commit the step
                self.assertNotEqual(probe, True, f"rank {r}: node committed the failed step")
                self.assertIn("FAILED_PRECONDITION", probe)
        print(f"{kind}: rank 0: {results[0]['error']}; commit probe: "
              f"{results[0]['node_commit_probe']}", file=sys.stderr)
        return results

    def test_nonfinite_gradient_on_one_node(self):
        self.check_fault("nonfinite", code="INVALID_ARGUMENT", phrase="non-finite")

    def test_nonfinite_gradient_on_one_node_apply_mode(self):
        self.check_fault("nonfinite", mode="apply", stage=3, code="INVALID_ARGUMENT",
                         phrase="non-finite")

    def test_lr_disagreeing_across_nodes(self):
        """Node 1's two ranks send twice the lr of node 0's: each daemon sees its own ranks agree,
        the agreement sees the nodes differ and every rank raises the same INVALID_ARGUMENT
        naming the group, on no node committed."""
        self.check_fault("lr_disagree", mode="apply", stage=2, code="INVALID_ARGUMENT",
                         phrase="the ranks disagree on the group 'group0' lr: from 0.02 to 0.04")

    def check_commit_window(self, mode, stage):
        """Node 1's daemon dies (SIGKILL) or stops (SIGTERM: it saves and exits, refusing the
        call) when the first CommitStep of step 3 reaches it, before or after it commits; node 0
        has committed. Every rank raises the same ABORTED error at once, naming node 1 and each
        node's state; node 0 is back before step 3 (RollbackStep); after node 1's restart,
        load_checkpoint() (the newest step every node saved) continues bit-identically."""
        only = os.environ.get("MUOND_TEST_ONLY_CASE")
        for point in ("commit", "committed"):
            for sig in ("KILL", "TERM"):
                if only and only != f"{point}:{sig}":
                    continue
                with self.subTest(point=point, signal=sig):
                    for d in self.daemons:
                        d.stop()
                    self.daemons = []
                    results = self.run_world(
                        [0, 0, 1, 1], "fault", fault="commit_window", mode=mode, stage=stage,
                        prefix=f"{point}-{sig}-",
                        node_env={1: {"MUOND_TEST_COMMIT_FAULT": f"{point}:{sig}:3"}})
                    for r, res in enumerate(results):
                        err = res["error"]
                        self.assertIsNotNone(err, f"rank {r}")
                        self.assertEqual(err["code"], "ABORTED", err)
                        self.assertIn("step 3 did not commit on every node: the commit failed "
                                      "on node 1", err["message"])
                        self.assertIn("node 0: back before step 3", err["message"])
                        self.assertIn("node 1: not rolled back", err["message"])
                        self.assertIn("load_checkpoint()", err["message"])
                        self.assertTrue(res["same_error_everywhere"], f"rank {r}")
                        self.assertTrue(res["unchanged_step"], f"rank {r}")
                        self.assertLess(res["seconds"], 30, f"rank {r}")
                        if r == 0:  # node 0, rolled back: it must not hold step 3 (node 1
                            # may: a daemon stopping with SIGTERM saved its commit first, and
                            # the error says it was not rolled back)
                            self.assertNotEqual(res["node_commit_probe"], True,
                                                "node 0 still holds step 3")
                        self.assertEqual(res["resumed_at"], res["saved_step"])
                        self.assertEqual(res["bitwise_after_recovery"], 4, f"rank {r}")
                    print(f"commit window {mode} {point}/{sig}: {results[0]['error']['message']} "
                          f"({max(r['seconds'] for r in results):.2f} s); node probes: "
                          f"{[r['node_commit_probe'] for r in results]}", file=sys.stderr)

    def test_commit_window_update_mode(self):
        self.check_commit_window("update", 2)

    def test_commit_window_apply_mode(self):
        self.check_commit_window("apply", 3)

    def test_daemon_killed_mid_step(self):
        self.check_fault("daemon_kill", mode="apply", stage=1, phrase="node 1")

    def test_rank_killed_mid_step(self):
        """Node 1's first rank dies (SIGKILL) inside step 3: the survivors raise the same ABORTED
        error, no node committed; a new world attaches to the node jobs, loads the checkpoint and
        continues bit-identical."""
        cfg = dict(mode="update", stage=2, pg_timeout=60)
        results = self.run_world([0, 0, 1, 1], "rank_kill", killed=(2,), **cfg)
        survivors = [res for res in results if res is not None]
        for res in survivors:
            self.assertEqual(res["error"]["code"], "ABORTED", res["error"])
            self.assertIn("committed on no node", res["error"]["message"])
            self.assertTrue(res["unchanged_step"])
        self.assertEqual(len({res["error"]["message"] for res in survivors}), 1)
        print(f"rank_kill: {survivors[0]['error']}", file=sys.stderr)
        resumed = self.run_world([0, 0, 1, 1], "rank_kill_resume", **cfg)
        for r, res in enumerate(resumed):
            self.assertEqual(res["resumed_at"], 2)
            self.assertEqual(res["bitwise_after_recovery"], 4, f"rank {r}")

    def test_step_timeout_on_one_node(self):
        # Node 1's daemon times the step out (2 s) while its first rank is 4 s late.
        # The late rank's error comes first (rank order): the job fenced by the timeout.
        self.check_fault("timeout", mode="update", stage=3, phrase="step timeout of 2 s expired",
                         timeout_sleep=4, node_extra={1: ("--step-timeout-seconds", "2")})


    def test_tiny_gpt_two_nodes_same_losses(self):
        """client/examples/train_tiny_gpt.py (2 ranks) on one daemon, then on 2 emulated nodes of
        one rank each: the same losses, bit for bit (update and apply mode)."""
        single = NodeDaemon(self.root, "single")
        nodes = [NodeDaemon(self.root, f"node{n}") for n in range(2)]
        self.daemons += [single, *nodes]
        example = os.path.join(ROOT, "client", "examples", "train_tiny_gpt.py")
        for mode in ("update", "apply"):
            losses = []
            for where in (["--address", single.address],
                          ["--node-addresses", ",".join(d.address for d in nodes)]):
                out = os.path.join(self.root, f"{mode}-{len(losses)}.json")
                subprocess.run([PYTHON, example, "--steps", "6", "--plot", "", "--json", out,
                                "--mode", mode, "--transport", "shm", *where], check=True,
                               stdout=subprocess.DEVNULL, timeout=600)
                with open(out) as f:
                    losses.append(json.load(f)["losses"])
            print(f"tiny GPT {mode}: one daemon {losses[0]}, two nodes {losses[1]}",
                  file=sys.stderr)
            self.assertEqual(len(losses[0]), 6)
            self.assertEqual(losses[0], losses[1], mode)
            self.assertLess(losses[0][-1], losses[0][0])


if __name__ == "__main__":
    MUOND = sys.argv.pop(1)
    unittest.main()
