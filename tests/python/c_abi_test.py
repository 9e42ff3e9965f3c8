#!/usr/bin/python3
"""Drives a real muond through the client library's C ABI (libmuond_client.so via ctypes).

Checks: job creation and tokens, a three-step trajectory against the reference vectors, error codes
and messages surfacing through muond_last_error, and that the daemon stops cleanly.
Usage: c_abi_test.py MUOND_BIN LIBMUOND_CLIENT DATA_DIR
"""
import ctypes
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

MUOND, LIB, DATA = sys.argv[1], sys.argv[2], sys.argv[3]
INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, UNAUTHENTICATED = 3, 5, 9, 16
PERMISSION_DENIED = 7


class ShardSpan(ctypes.Structure):
    _fields_ = [("matrix", ctypes.c_uint32), ("offset", ctypes.c_uint64),
                ("length", ctypes.c_uint64), ("rank_offset", ctypes.c_uint64)]


class Span(ctypes.Structure):
    _fields_ = [("matrix", ctypes.c_uint32), ("offset", ctypes.c_uint64),
                ("data", ctypes.c_void_p), ("length", ctypes.c_uint64)]


def load_reference():
    with open(os.path.join(DATA, "muon_v1.safetensors"), "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name != "__metadata__":
            b, e = info["data_offsets"]
            out[name] = np.frombuffer(raw[8 + n + b:8 + n + e], dtype=np.float32).reshape(info["shape"])
    return out


class CAbiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="muond-pytest-")
        cls.address = f"unix://{cls.tmp.name}/muond.sock"
        # The daemon logs to a file: a pipe nobody reads would block it once full.
        cls.log_path = os.path.join(cls.tmp.name, "muond.log")
        cls.log = open(cls.log_path, "wb")
        cls.daemon = subprocess.Popen([MUOND, "--listen", cls.address, "--state-dir",
                                       os.path.join(cls.tmp.name, "state"), "--threads", "1"],
                                      stderr=cls.log)
        try:
            cls._connect()
        except BaseException:
            # tearDownClass does not run when setUpClass fails: never leave a daemon behind.
            cls.daemon.kill()
            cls.daemon.wait()
            with open(cls.log_path, errors="replace") as f:
                sys.stderr.write(f.read())
            raise

    @classmethod
    def _connect(cls):
        # Connecting before the socket exists would put gRPC into its reconnect backoff.
        sock = cls.address[len("unix://"):]
        for _ in range(200):
            if os.path.exists(sock) or cls.daemon.poll() is not None:
                break
            time.sleep(0.05)
        lib = ctypes.CDLL(LIB)
        lib.muond_last_error.restype = ctypes.c_char_p
        lib.muond_connect.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
        lib.muond_health.argtypes = [ctypes.c_void_p, ctypes.c_double]
        lib.muond_job_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.muond_job_delete.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
        lib.muond_attach.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                     ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
        lib.muond_session_is_shm.argtypes = [ctypes.c_void_p]
        lib.muond_session_gradient_view.argtypes = [ctypes.c_void_p, ctypes.c_int64,
                                                    ctypes.POINTER(ctypes.c_void_p),
                                                    ctypes.POINTER(ctypes.c_size_t)]
        lib.muond_session_update_view.argtypes = [ctypes.c_void_p, ctypes.c_int64,
                                                  ctypes.POINTER(ctypes.c_void_p),
                                                  ctypes.POINTER(ctypes.c_size_t)]
        lib.muond_step_in_place.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.muond_session_free.argtypes = [ctypes.c_void_p]
        lib.muond_client_free.argtypes = [ctypes.c_void_p]
        lib.muond_session_next_step.argtypes = [ctypes.c_void_p]
        lib.muond_session_next_step.restype = ctypes.c_int64
        lib.muond_step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(Span), ctypes.c_size_t,
                                   ctypes.POINTER(Span), ctypes.c_size_t]
        lib.muond_layout_spans.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ShardSpan),
                                           ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                           ctypes.POINTER(ctypes.c_uint64)]
        lib.muond_session_buffer_elements.argtypes = [ctypes.c_void_p]
        lib.muond_session_buffer_elements.restype = ctypes.c_uint64
        lib.muond_step_buffer.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        cls.lib = lib
        cls.client = ctypes.c_void_p()
        assert lib.muond_connect(cls.address.encode(), ctypes.byref(cls.client)) == 0
        for _ in range(100):
            if lib.muond_health(cls.client, 1.0) == 0:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("muond did not become healthy")
        cls.ref = load_reference()

    @classmethod
    def tearDownClass(cls):
        cls.lib.muond_client_free(cls.client)
        cls.daemon.send_signal(signal.SIGTERM)
        code = cls.daemon.wait(timeout=30)
        cls.log.close()
        if code != 0:
            with open(cls.log_path, errors="replace") as f:
                sys.stderr.write(f.read())
        cls.tmp.cleanup()
        assert code == 0, f"muond exited {code} on SIGTERM, not 0"

    def create(self, job_id, matrices, **muon):
        spec = {"job_id": job_id, "muon": muon, "matrices": matrices}
        token = ctypes.create_string_buffer(65)
        code = self.lib.muond_job_create(self.client, json.dumps(spec).encode(), token, 65)
        self.assertEqual(code, 0, self.lib.muond_last_error())
        return token.value

    def attach(self, job_id, token, transport=b"grpc"):
        session = ctypes.c_void_p()
        code = self.lib.muond_attach(self.client, job_id.encode(), 0, token, 0, transport, ctypes.byref(session))
        self.assertEqual(code, 0, self.lib.muond_last_error())
        return session

    def step(self, session, step, grads):
        ins = (Span * len(grads))()
        outs = (Span * len(grads))()
        updates = []
        for i, g in enumerate(grads):
            g = np.ascontiguousarray(g, dtype=np.float32)
            grads[i] = g
            u = np.empty_like(g)
            updates.append(u)
            ins[i] = Span(i, 0, g.ctypes.data, g.size)
            outs[i] = Span(i, 0, u.ctypes.data, u.size)
        code = self.lib.muond_step(session, step, ins, len(grads), outs, len(grads))
        return code, updates

    def test_reference_trajectory(self):
        cases = ["wide_std", "tall_std"]
        mats = [{"name": c, "shape": list(self.ref[f"{c}/step0/grad"].shape)} for c in cases]
        token = self.create("py-traj", mats)
        session = self.attach("py-traj", token)
        self.assertEqual(self.lib.muond_session_next_step(session), 0)
        for t in range(3):
            code, updates = self.step(session, t, [self.ref[f"{c}/step{t}/grad"].copy() for c in cases])
            self.assertEqual(code, 0, self.lib.muond_last_error())
            for c, u in zip(cases, updates):
                want = self.ref[f"{c}/step{t}/update"].astype(np.float64)
                rel = np.linalg.norm(u - want) / np.linalg.norm(want)
                self.assertLess(rel, 1e-4, f"{c} step {t}")
        self.lib.muond_session_free(session)
        self.assertEqual(self.lib.muond_job_delete(self.client, b"py-traj", token), 0)

    def test_errors_surface_with_codes(self):
        token = self.create("py-errors", [{"name": "w", "shape": [8, 16]}])
        session = ctypes.c_void_p()
        self.assertEqual(self.lib.muond_attach(self.client, b"py-errors", 0, b"f" * 64, 0, None,
                                               ctypes.byref(session)), PERMISSION_DENIED)
        self.assertIn(b"wrong job token", self.lib.muond_last_error())
        self.assertEqual(self.lib.muond_attach(self.client, b"py-errors", 0, b"", 0, None,
                                               ctypes.byref(session)), UNAUTHENTICATED)
        self.assertEqual(self.lib.muond_attach(self.client, b"no-such-job", 0, token, 0, None,
                                               ctypes.byref(session)), NOT_FOUND)
        session = self.attach("py-errors", token)
        g = np.ones((8, 16), dtype=np.float32)
        g[3, 5] = np.nan
        code, _ = self.step(session, 0, [g])
        self.assertEqual(code, INVALID_ARGUMENT)
        self.assertIn(b"non-finite", self.lib.muond_last_error())
        self.assertIn(b"'w'", self.lib.muond_last_error())
        code, _ = self.step(session, 5, [np.ones((8, 16), dtype=np.float32)])
        self.assertEqual(code, FAILED_PRECONDITION)
        self.assertIn(b"out of order", self.lib.muond_last_error())
        code, _ = self.step(session, 0, [np.ones((8, 16), dtype=np.float32)])
        self.assertEqual(code, 0, self.lib.muond_last_error())
        bad = ctypes.create_string_buffer(65)
        self.assertEqual(self.lib.muond_job_create(self.client, b"{not json", bad, 65), INVALID_ARGUMENT)
        self.lib.muond_session_free(session)


    def test_zero2_two_ranks_equal_whole_matrices_bit_for_bit(self):
        """ZeRO-2 with two ranks, each on its own connection and thread, through the C ABI."""
        import threading
        mats = [{"name": "a", "shape": [48, 96]}, {"name": "b", "shape": [96, 40]},
                {"name": "c", "shape": [8, 8]}]
        whole_token = self.create("py-whole", mats)
        whole = self.attach("py-whole", whole_token)
        spec = {"job_id": "py-zero2", "world_size": 2, "zero_stage": 2, "matrices": mats}
        token = ctypes.create_string_buffer(65)
        self.assertEqual(self.lib.muond_job_create(self.client, json.dumps(spec).encode(), token, 65),
                         0, self.lib.muond_last_error())
        # The layout as the library computes it: P = ceil(8512 / 2) = 4256, 'a' straddles the ranks.
        spans = (ShardSpan * 8)()
        total, elements = ctypes.c_size_t(), ctypes.c_uint64()
        self.assertEqual(self.lib.muond_layout_spans(json.dumps(spec).encode(), 1, spans, 8,
                                                     ctypes.byref(total), ctypes.byref(elements)), 0)
        self.assertEqual(elements.value, 4256)
        self.assertEqual([(spans[i].matrix, spans[i].offset, spans[i].length, spans[i].rank_offset)
                          for i in range(total.value)], [(0, 4256, 352, 0), (1, 0, 3840, 352), (2, 0, 64, 4192)])
        self.assertEqual(self.lib.muond_layout_spans(json.dumps(spec).encode(), 2, spans, 8, None, None),
                         INVALID_ARGUMENT)
        clients, sessions = [], []
        for r in range(2):
            c = ctypes.c_void_p()
            self.assertEqual(self.lib.muond_connect(self.address.encode(), ctypes.byref(c)), 0)
            s = ctypes.c_void_p()
            self.assertEqual(self.lib.muond_attach(c, b"py-zero2", r, token.value, 0, b"shm" if r == 0 else b"grpc", ctypes.byref(s)),
                             0, self.lib.muond_last_error())
            self.assertEqual(self.lib.muond_session_buffer_elements(s), 4256)
            clients.append(c)
            sessions.append(s)
        rng = np.random.default_rng(3)
        for t in range(3):
            grads = [rng.standard_normal(m["shape"]).astype(np.float32) for m in mats]
            code, want = self.step(whole, t, [g.copy() for g in grads])
            self.assertEqual(code, 0, self.lib.muond_last_error())
            flat = np.zeros(2 * 4256, dtype=np.float32)
            flat[:8512] = np.concatenate([g.ravel() for g in grads])
            parts = [np.ascontiguousarray(flat[r * 4256:(r + 1) * 4256]) for r in range(2)]
            outs = [np.full(4256, np.nan, dtype=np.float32) for _ in range(2)]
            codes = [None, None]

            def run(r):
                codes[r] = self.lib.muond_step_buffer(sessions[r], t, parts[r].ctypes.data,
                                                      outs[r].ctypes.data)

            threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            self.assertEqual(codes, [0, 0])
            got = np.concatenate(outs)
            expect = np.concatenate([u.ravel() for u in want])
            self.assertEqual(got[:8512].tobytes(), expect.tobytes(), f"step {t}")
            self.assertTrue(np.all(got[8512:] == 0))
        for r in range(2):
            self.lib.muond_session_free(sessions[r])
            self.lib.muond_client_free(clients[r])
        self.lib.muond_session_free(whole)


    def test_zero_copy_views_over_shared_memory(self):
        """numpy arrays over the shm views: gradients written in place, updates read in place,
        bit-identical to the gRPC path."""
        mats = [{"name": "w", "shape": [32, 80]}, {"name": "v", "shape": [80, 24]}]
        grpc_token = self.create("py-view-grpc", mats)
        shm_token = self.create("py-view-shm", mats)
        via_grpc = self.attach("py-view-grpc", grpc_token, b"grpc")
        via_shm = self.attach("py-view-shm", shm_token, b"shm")
        self.assertEqual(self.lib.muond_session_is_shm(via_grpc), 0)
        self.assertEqual(self.lib.muond_session_is_shm(via_shm), 1)
        ptr, size = ctypes.c_void_p(), ctypes.c_size_t()
        self.assertEqual(self.lib.muond_session_gradient_view(via_grpc, 0, ctypes.byref(ptr),
                                                              ctypes.byref(size)), FAILED_PRECONDITION)
        rng = np.random.default_rng(11)
        for t in range(3):
            grads = [rng.standard_normal(m["shape"]).astype(np.float32) for m in mats]
            code, want = self.step(via_grpc, t, [g.copy() for g in grads])
            self.assertEqual(code, 0, self.lib.muond_last_error())
            self.assertEqual(self.lib.muond_session_gradient_view(via_shm, t, ctypes.byref(ptr),
                                                                  ctypes.byref(size)), 0)
            self.assertEqual(size.value, 4 * (32 * 80 + 80 * 24))
            view = np.ctypeslib.as_array((ctypes.c_float * (size.value // 4)).from_address(ptr.value))
            view[:] = np.concatenate([g.ravel() for g in grads])
            self.assertEqual(self.lib.muond_step_in_place(via_shm, t), 0, self.lib.muond_last_error())
            self.assertEqual(self.lib.muond_session_update_view(via_shm, t, ctypes.byref(ptr),
                                                                ctypes.byref(size)), 0)
            got = np.ctypeslib.as_array((ctypes.c_float * (size.value // 4)).from_address(ptr.value))
            self.assertEqual(got.tobytes(), np.concatenate([u.ravel() for u in want]).tobytes())
        self.lib.muond_session_free(via_grpc)
        self.lib.muond_session_free(via_shm)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
