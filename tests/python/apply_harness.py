"""What the apply-mode tests (apply_mode_test.py, apply_optimizer_test.py) share: a daemon of their
own (DaemonTest, with the comparisons), a small model with tensors of every kind, deterministic gradients, a safetensors reader, the comparisons, and
SessionJob, which drives an apply-mode job through client.Session objects, one thread per rank,
with muon_offload.reference.ApplyReference beside it.

Importable by the spawned torch.distributed workers: nothing here runs at import but path setup.
"""
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402

import muon_offload as mo  # noqa: E402
from muon_offload.zero import (Partition, copy_from_buffer,  # noqa: E402
                               copy_into_buffer)
from muon_offload import MuondError, MuonWithAuxAdam  # noqa: E402

MASTER_TOLERANCE = 1e-6  # relative (Frobenius) per tensor, fp32 masters
MUON_CONFIG = {"momentum": 0.95, "nesterov": True, "ns_method": "standard", "ns_steps": 5,
               "compute_dtype": "float32", "scale_mode": "original"}
ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8}
GROUPS = {"muon": {"lr": 0.02, "weight_decay": 0.1}, "adamw": {"lr": 0.01, "weight_decay": 0.01}}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class Daemon:
    """A muond on a private socket and state directory (metrics off), stopped with SIGTERM."""

    def __init__(self, muond, args=(), env=None):
        """args: more muond flags; env: more environment variables (test hooks)."""
        self.tmp = tempfile.TemporaryDirectory(prefix="muond-apply-")
        self.address = f"unix://{self.tmp.name}/muond.sock"
        self.log_path = os.path.join(self.tmp.name, "muond.log")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([muond, "--listen", self.address, "--state-dir",
                                      os.path.join(self.tmp.name, "state"), "--threads", "1",
                                      "--metrics-address", "off", *args], stderr=self.log,
                                     env=dict(os.environ, **(env or {})))
        deadline = time.time() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"muond exited {self.proc.returncode}:\n{self.read_log()}")
            try:
                with mo.Client(self.address) as c:
                    c.health(0.5)
                return
            except MuondError:
                if time.time() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"muond did not become healthy:\n{self.read_log()}")
                time.sleep(0.1)

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def read_log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        """SIGTERM; returns the exit code (the log goes to stderr unless it is 0)."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.log.close()
        if code != 0:
            sys.stderr.write(self.read_log())
        self.tmp.cleanup()
        return code


class DaemonTest(unittest.TestCase):
    """A daemon per test class (DaemonTest.muond: the muond binary, set by the test module), and
    the comparisons the apply-mode tests assert with."""
    muond = None

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(cls.muond)

    @classmethod
    def tearDownClass(cls):
        code = cls.daemon.stop()
        assert code == 0, f"muond exited {code} on SIGTERM, not 0"

    def assertRanksOk(self, errors, what):
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            r, e = failed[0]
            raise AssertionError(f"{what}: rank {r} failed: {e}") from e

    def assertRefused(self, errors, code_name, *phrases):
        """Every rank got MuondError `code_name`; the messages together hold each phrase."""
        for r, e in enumerate(errors):
            self.assertIsInstance(e, MuondError, f"rank {r}: {e!r}")
            self.assertEqual(e.code_name, code_name, f"rank {r}: {e}")
        text = " ".join(e.message for e in errors)
        for p in phrases:
            self.assertIn(p, text)

    def assertMastersMatch(self, masters, ref, what):
        for name, err in master_errors(masters, ref).items():
            self.assertLessEqual(err, MASTER_TOLERANCE, f"{what}: master '{name}' relative error")

    def assertParamsMatch(self, job, ref, what):
        """fp32 parameters are the masters; bf16 ones within half an ulp of the reference's."""
        for t, p, m in zip(ref.tensors, job.params, ref.masters):
            if p.dtype == torch.float32:
                err = relative_error(p, m)
                self.assertLessEqual(err, MASTER_TOLERANCE, f"{what}: '{t['name']}' {err}")
            else:
                self.assertLessEqual(relative_error(p, m), 2.0 ** -8, f"{what}: {t['name']}")


# ----- model, gradients, files -----

def model_tensors(dtype=torch.float32, seed=7):
    """Tensors of every kind, in job order: Muon 2-D (one with 2 heads), 3-D experts, 4-D conv;
    AdamW embedding, norm, bias and a 0-d scale. Dicts as ApplyReference takes them."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=0.2):
        return (torch.randn(shape, generator=g) * s).to(dtype)

    return [
        {"name": "attn.w", "param": rnd(24, 16), "optimizer": "muon", "group": "muon",
         "num_heads": 2},
        {"name": "mlp.w", "param": rnd(16, 40), "optimizer": "muon", "group": "muon"},
        {"name": "experts.w", "param": rnd(2, 8, 12), "optimizer": "muon", "group": "muon"},
        {"name": "conv.w", "param": rnd(4, 2, 3, 3), "optimizer": "muon", "group": "muon"},
        {"name": "embed.w", "param": rnd(30, 16), "optimizer": "adamw", "group": "adamw"},
        {"name": "norm.w", "param": (1 + rnd(16, s=0.01).float()).to(dtype),
         "optimizer": "adamw", "group": "adamw"},
        {"name": "head.b", "param": rnd(7), "optimizer": "adamw", "group": "adamw"},
        {"name": "scale", "param": torch.tensor(0.5, dtype=dtype), "optimizer": "adamw",
         "group": "adamw"},
    ]


def gradients(tensors, step, rank=0, dtype=torch.float32, scale=1.0):
    """Rank `rank`'s gradients of step `step`: a function of (step, rank) only, on a grid of
    2^-10 so that sums over up to 4 ranks and bf16 rounding are exact where the tests need it."""
    g = torch.Generator().manual_seed(1000 * step + rank + 1)
    out = []
    for t in tensors:
        x = torch.randn(tuple(t["param"].shape), generator=g) * scale
        out.append((torch.round(x * 1024) / 1024).to(dtype))
    return out


def param_gradients(tensors, step, rank=0):
    """gradients() in each tensor's param dtype (a model of several dtypes)."""
    return [g.to(t["param"].dtype) for g, t in zip(gradients(tensors, step, rank), tensors)]


def summed(per_rank):
    """The sum of the ranks' gradients in rank order, in their dtype (as the package's
    reduce-scatter adds them)."""
    total = [g.clone() for g in per_rank[0]]
    for grads in per_rank[1:]:
        for t, g in zip(total, grads):
            t.add_(g)
    return total


def lr_at(step):
    """A schedule: linear decay of each group's lr (what an LR scheduler sends)."""
    f = 1.0 - step / 40.0
    return ({k: v["lr"] * f for k, v in GROUPS.items()},
            {k: v["weight_decay"] for k, v in GROUPS.items()})


def read_safetensors(path):
    """{name: tensor} of a safetensors file, read with torch."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        data = bytearray(raw[8 + n + b:8 + n + e])
        t = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"])
    return out


def relative_error(got, want):
    got, want = got.double(), want.double()
    denom = want.norm().item()
    return (got - want).norm().item() / (denom if denom > 0 else 1.0)


def master_errors(masters, reference):
    """{name: relative error} of muond's masters against the reference's."""
    return {t["name"]: relative_error(masters[t["name"]], m)
            for t, m in zip(reference.tensors, reference.masters)}


def bf16_rounding_mismatches(params, masters, reference):
    """(mismatches, agreeing) over all tensors: elements where muond's masters equal the
    reference's bit for bit but the bf16 parameter differs from the reference's rounding of it,
    and how many elements agree bitwise."""
    bad = agree = 0
    for t, ref_master, p in zip(reference.tensors, reference.masters, params):
        if p.dtype != torch.bfloat16:
            continue
        m = masters[t["name"]].reshape(-1)
        same = m.view(torch.int32) == ref_master.reshape(-1).view(torch.int32)
        agree += int(same.sum())
        rounded = ref_master.reshape(-1).to(torch.bfloat16).view(torch.int16)
        bad += int((p.reshape(-1).view(torch.int16) != rounded)[same].sum())
    return bad, agree


# ----- MuonWithAuxAdam(mode="apply") -----

def apply_optimizer(params, kinds, **kw):
    """MuonWithAuxAdam(mode="apply") over `params` ({name: parameter}); kinds: {name: "muon" |
    "adamw"}; the module's group hyperparameters."""
    muon = [(n, p) for n, p in params.items() if kinds[n] == "muon"]
    adam = [(n, p) for n, p in params.items() if kinds[n] == "adamw"]
    return MuonWithAuxAdam([
        dict(params=muon, use_muon=True, lr=GROUPS["muon"]["lr"],
             weight_decay=GROUPS["muon"]["weight_decay"], num_heads=1),
        dict(params=adam, use_muon=False, lr=GROUPS["adamw"]["lr"], betas=ADAMW["betas"],
             eps=ADAMW["eps"], weight_decay=GROUPS["adamw"]["weight_decay"])],
        mode="apply", **kw)


# optimizer_model's dtype for the common mixed model: bfloat16 weights (Muon and the embedding),
# float32 norm, bias and scale.
MIXED = "mixed"
MIXED_FLOAT32 = ("norm.w", "head.b", "scale")


def optimizer_model(dtype):
    """model_tensors as nn.Parameters (num_heads 1: a param group has one num_heads) and the
    reference tensors in the same (job) order: Muon first, then AdamW. dtype MIXED: see there."""
    if dtype == MIXED:
        tensors = [dict(t, num_heads=1) for t in model_tensors(torch.float32)]
        for t in tensors:
            if t["name"] not in MIXED_FLOAT32:
                t["param"] = t["param"].to(torch.bfloat16)
    else:
        tensors = [dict(t, num_heads=1) for t in model_tensors(dtype)]
    tensors.sort(key=lambda t: t["optimizer"] != "muon")
    params = {t["name"]: torch.nn.Parameter(t["param"].clone()) for t in tensors}
    kinds = {t["name"]: t["optimizer"] for t in tensors}
    for t in tensors:
        t["group"] = "group0" if t["optimizer"] == "muon" else "group1"
    return params, kinds, tensors


# ----- an apply-mode job through sessions -----

def job_spec(job_id, tensors, dtype, world=1, stage=0, layout=None, max_grad_norm=None,
             param_dtypes=None, qk_clip=None):
    """The job.json of an apply-mode job of `tensors` (model_tensors) with the module's groups,
    Muon config and AdamW betas/eps. param_dtypes: per tensor (default: `dtype` for all)."""
    names = mo.client.DTYPE_NAMES
    spec_tensors = []
    for i, t in enumerate(tensors):
        pd = param_dtypes[i] if param_dtypes else dtype
        e = {"name": t["name"], "shape": list(t["param"].shape), "dtype": names[pd],
             "param_dtype": names[pd], "optimizer": t["optimizer"], "group": t["group"]}
        if t.get("num_heads", 1) != 1:
            e["num_heads"] = t["num_heads"]
        spec_tensors.append(e)
    spec = {"job_id": job_id, "mode": "apply", "world_size": world, "zero_stage": stage,
            "muon": dict(MUON_CONFIG), "tensors": spec_tensors,
            "groups": [{"name": k, **v} for k, v in GROUPS.items()],
            "adamw": {"betas": list(ADAMW["betas"]), "eps": ADAMW["eps"]}}
    if layout is not None:
        spec["layout"] = layout
        del spec["zero_stage"]
    if max_grad_norm is not None:
        spec["max_grad_norm"] = max_grad_norm
    if qk_clip is not None:
        spec["qk_clip"] = qk_clip
    return spec


def reference_for(tensors, max_grad_norm=None, init=None):
    ref_tensors = [dict(t) for t in tensors]
    if init is not None:
        for t, p in zip(ref_tensors, init):
            t["param"] = p
    cfg = {k: v for k, v in MUON_CONFIG.items() if k != "compute_dtype"}
    return mo.ApplyReference(ref_tensors, betas=ADAMW["betas"], eps=ADAMW["eps"],
                             max_grad_norm=max_grad_norm, **cfg)


def run_ranks(fn, world):
    """Runs fn(rank) on one thread per rank; returns the exceptions (None where it returned)."""
    errors = [None] * world

    def body(r):
        try:
            fn(r)
        except BaseException as e:  # reported to the test, which asserts on it
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


class SessionJob:
    """An apply-mode job of model_tensors() driven through the C ABI: one Client and Session per
    rank, one thread per rank per call. Each rank sends exactly its spans of the gradients it is
    given (the reduction is the caller's); params holds what the ranks got back, assembled.

    transports: one per rank ("shm" or "grpc"); spans_api: steps and uploads through
    muond_step/muond_init_params with (tensor, offset, tensor) runs (several dtypes) instead of
    the flat buffers."""

    def __init__(self, address, job_id, tensors, dtype, world=1, stage=0, transports=("grpc",),
                 layout=None, max_grad_norm=None, param_dtypes=None, spans_api=False,
                 qk_clip=None, token=None, first_step=0):
        self.tensors = tensors
        self.dtype = dtype
        self.world = world
        self.dtypes = list(param_dtypes) if param_dtypes else [dtype] * len(tensors)
        self.spans_api = spans_api
        self.spec = job_spec(job_id, tensors, dtype, world, stage, layout, max_grad_norm,
                             param_dtypes, qk_clip)
        self.job_id = job_id
        self.admin = mo.Client(address)
        # token: attach to the job as it exists (a restarted daemon's), at step first_step.
        self.token = token or self.admin.create_job(self.spec)
        self.clients = [mo.Client(address) for _ in range(world)]
        self.sessions = []
        for r in range(world):
            transport = transports[r % len(transports)]
            self.sessions.append(self.clients[r].attach(job_id, r, self.token,
                                                        transport=transport))
        self.params = [t["param"].to(d).clone() for t, d in zip(tensors, self.dtypes)]
        self.step_id = first_step

    def close(self, delete=True):
        for s in self.sessions:
            s.close()
        if delete:
            self.admin.delete_job(self.job_id, self.token)
        for c in self.clients + [self.admin]:
            c.close()

    def _partition(self, r):
        s = self.sessions[r]
        return Partition(r, s.spans, s.buffer_elements)

    def upload(self, ranks=None, float32=False, values=None):
        """Ranks `ranks` (default all) upload their spans of `values` (default: the initial
        parameters, in float32 when `float32`, else the param dtypes). Returns the errors."""
        values = values or [t["param"] for t in self.tensors]
        values = [v.to(torch.float32 if float32 else d).contiguous()
                  for v, d in zip(values, self.dtypes)]
        ranks = range(self.world) if ranks is None else ranks

        def init(r):
            s = self.sessions[r]
            if self.spans_api:
                runs = [(m, o, values[m].reshape(-1)[o:o + n].contiguous())
                        for m, o, n, _ in s.spans]
                s.init_params_spans(runs, float32)
                return
            dtype = torch.float32 if float32 else self.dtype
            buf = torch.zeros(s.buffer_elements, dtype=dtype)
            copy_into_buffer(buf, self._partition(r), values)
            if s.is_shm and not float32:
                s.init_view(dtype)[:s.buffer_elements].copy_(buf)
                s.init_params_in_place()
            else:
                s.init_params_buffer(buf, float32)

        chosen = set(ranks)
        return run_ranks(lambda r: init(r) if r in chosen else None, self.world)

    def step(self, grads_of_rank, lr, weight_decay, grad_divisor=1.0, max_logits_of_rank=None):
        """One step: rank r sends its spans of grads_of_rank(r) (full tensors) with the
        hyperparameters lr/weight_decay ({group: value}, or a function of the rank giving one)
        and, for a QK-Clip job, max_logits_of_rank(r) (the per-head maxima, pair after pair).
        Returns the ranks' errors; on success every rank's new parameters are in self.params and
        the step id advances."""
        out = [None] * self.world
        groups = list(GROUPS)

        def one(r):
            s = self.sessions[r]
            lr_r = lr(r) if callable(lr) else lr
            s.set_hyper(groups, [lr_r[g] for g in groups], [weight_decay[g] for g in groups],
                        grad_divisor)
            if max_logits_of_rank is not None:
                s.set_max_logits(max_logits_of_rank(r))
            grads = [g.contiguous() for g in grads_of_rank(r)]
            if self.spans_api:
                ins = [(m, o, grads[m].reshape(-1)[o:o + n].contiguous()) for m, o, n, _ in s.spans]
                outs = [(m, o, torch.empty(n, dtype=self.dtypes[m])) for m, o, n, _ in s.spans]
                s.step_spans(self.step_id, ins, outs)
                out[r] = outs
                return
            part = self._partition(r)
            if s.is_shm:
                copy_into_buffer(s.gradient_view(self.step_id, self.dtype), part, grads)
                s.step_in_place(self.step_id)
                new = s.update_view(self.step_id, self.dtype).clone()
            else:
                buf = torch.zeros(s.buffer_elements, dtype=self.dtype)
                copy_into_buffer(buf, part, grads)
                new = torch.full((s.buffer_elements,), float("nan"), dtype=self.dtype)
                s.step_buffer(self.step_id, buf, new)
            out[r] = new

        errors = run_ranks(one, self.world)
        if all(e is None for e in errors):
            for r in range(self.world):
                if self.spans_api:
                    for m, o, t in out[r]:
                        self.params[m].view(-1)[o:o + t.numel()].copy_(t)
                else:
                    copy_from_buffer(out[r], self._partition(r), self.params)
            self.step_id += 1
        return errors

    def export(self, path, dtype="float32"):
        self.admin.export(self.job_id, self.token, path, dtype)
        return read_safetensors(path)
