#!/usr/bin/python3
"""MuonWithAuxAdam(mode="apply") training a small model on cuda:0 against the same run on the CPU
(same initial weights, same batches, same daemon), at world 1 and world 2, with the
shared-memory transport: its buffers registered with CUDA, copies to and from the device
asynchronous.

Usage: cuda_apply_test.py MUOND_BIN LIBMUOND_CLIENT [unittest names...]
  - CudaModelTest.test_world_1: one rank, whole steps and gradients streamed during backward.
  - CudaModelTest.test_world_2: two spawned ranks on the one GPU, ZeRO stage 2, the same cases.
    The process group is gloo: NCCL refuses two ranks of one communicator on one device, and
    gloo (torch 1.13) runs the collectives the package uses (all_to_all_single, all_gather,
    all_reduce) on CUDA tensors by staging them through host memory.
Each case asserts: every parameter within TOLERANCE (relative, Frobenius) of the CPU run's, the
losses likewise, the parameters moved, both gradient buffers of the session registered with
CUDA (no registration refused as overlapping, 712), no CUDA error left pending, and (world 2)
both ranks holding the same parameters.
  - CudaRuntimeRegistrarTest: the CUDA runtime behaves as the fake of cuda_registration_test.py
    says (an overlapping registration refused with 712 and left pending until cleared, an
    unknown pointer's unregistration refused), and two buffers sharing a page both register.
Skipped, saying "no CUDA device", where torch sees no GPU.
"""
import json
import os
import sys
import tempfile
import unittest
import warnings
import zlib

MUOND, LIB = sys.argv[1], sys.argv[2]
os.environ["MUOND_CLIENT_LIB"] = LIB
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import apply_harness as h  # noqa: E402
from apply_harness import DaemonTest  # noqa: E402
from muon_offload import MuonWithAuxAdam  # noqa: E402
from muon_offload.cuda_pinning import CudaRuntimeRegistrar, PinnedHostRanges  # noqa: E402

torch.set_num_threads(1)
DaemonTest.muond = MUOND
STEPS = 6
VOCAB, WIDTH, HIDDEN, BATCH = 32, 16, 24, 8
# fp32 on both sides: cuBLAS and the CPU sum the matmuls in other orders, so gradients differ in
# their last bits, and Newton-Schulz carries that on; a defect (a wrong or stale buffer) moves a
# parameter by a whole step, ~lr relative.
TOLERANCE = 1e-3
# name, transport, stream
CASES = [("shm-whole", "shm", False), ("shm-streamed", "shm", True)]
NO_CUDA = "no CUDA device: apply mode on cuda:0 runs where torch sees a GPU"


class TinyModel(torch.nn.Module):
    """Embedding, two linear layers with a norm between: Muon matrices, AdamW for the rest."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, targets):
        x = self.norm(torch.relu(self.hidden(self.embed(tokens))))
        return torch.nn.functional.cross_entropy(self.out(x), targets)


def batch(step, rank, device):
    g = torch.Generator().manual_seed(100 * step + rank + 1)
    tokens = torch.randint(0, VOCAB, (BATCH,), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH,), generator=g)
    return tokens.to(device), targets.to(device)


def train(device, address, job_id, transport, stream, rank=0):
    """STEPS steps of TinyModel on `device` through muond; returns (final parameters on the CPU,
    losses, initial parameters, what the CUDA registration did)."""
    torch.manual_seed(0)
    model = TinyModel()  # the same initial weights on every device and rank
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(device)
    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if p.dim() == 2 and not n.startswith("embed")]
    other = [(n, p) for n, p in named if p.dim() != 2 or n.startswith("embed")]
    opt = MuonWithAuxAdam([dict(params=muon, use_muon=True, lr=0.02, weight_decay=0.01),
                           dict(params=other, use_muon=False, lr=3e-3, betas=(0.9, 0.95),
                                eps=1e-8, weight_decay=0.0)],
                          mode="apply", address=address, job_id=job_id, transport=transport,
                          stream=stream)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = model(*batch(step, rank, device))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        pinning = registration(opt, device)
    pinning["warnings"] = [str(w.message) for w in caught if "muon_offload" in str(w.message)]
    final = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    opt.close(delete_job=True)
    return final, losses, initial, pinning


def registration(opt, device):
    """Whether the session's two gradient buffers (one mapping) and two update buffers are in
    CUDA registrations, and the CUDA error pending after the steps (None: not readable)."""
    if device == "cpu":
        return {}
    s, pins = opt.session, opt.offload._pins
    out = {}
    for kind in ("gradient", "update"):
        views = [s.raw_view(kind, step) for step in (0, 1)]
        out[kind] = pins is not None and all(pins.registered(v.data_ptr(), v.numel())
                                             for v in views)
    torch.cuda.synchronize()
    out["pending_error"] = CudaRuntimeRegistrar().clear_error()
    return out


def compare(cpu, cuda):
    """{name: relative error} of the CUDA run's final parameters against the CPU run's."""
    return {n: h.relative_error(cuda[n], cpu[n]) for n in cpu}


def case_result(cpu_run, cuda_run):
    (cpu, cpu_losses, initial, _), (cuda, cuda_losses, _, pinning) = cpu_run, cuda_run
    return {"param_errors": compare(cpu, cuda),
            "loss_error": max(abs(a - b) / abs(a) for a, b in zip(cpu_losses, cuda_losses)),
            "moved": min(h.relative_error(cpu[n], initial[n]) for n in cpu),
            "pinning": pinning,
            "checksum": [zlib.crc32(cuda[n].numpy().tobytes()) for n in sorted(cuda)]}


def run_world_2(rank, world, address, tmp, lib):
    """One of two spawned ranks: every case on the CPU, then on cuda:0; rank 0 writes
    result.json with both ranks' numbers."""
    import torch.distributed as dist
    os.environ["MUOND_CLIENT_LIB"] = lib
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    try:
        mine = {}
        for name, transport, stream in CASES:
            cpu = train("cpu", address, f"w2-cpu-{name}", transport, stream, rank)
            cuda = train("cuda:0", address, f"w2-cuda-{name}", transport, stream, rank)
            mine[name] = case_result(cpu, cuda)
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(every, f)
    finally:
        dist.destroy_process_group()


@unittest.skipUnless(torch.cuda.is_available(), NO_CUDA)
class CudaRuntimeRegistrarTest(unittest.TestCase):
    """What FakeCudaRuntime (cuda_registration_test.py) assumes of CUDA, on this GPU."""
    ALREADY_REGISTERED, NOT_REGISTERED = 712, 713

    def setUp(self):
        import mmap
        self.page = mmap.PAGESIZE
        self.memory = torch.empty(9 * self.page, dtype=torch.uint8)
        self.base = self.memory.data_ptr() + (-self.memory.data_ptr() % self.page)
        torch.cuda.init()
        self.cuda = CudaRuntimeRegistrar()
        self.assertIsNotNone(self.cuda.clear_error(), "no libcudart with cudaGetLastError found: "
                             "a refused registration would stay pending")

    def test_overlapping_registration_is_refused_and_left_pending(self):
        page, base, cuda = self.page, self.base, self.cuda
        buffer = page + 192  # two buffers back to back: the second starts in the first's page
        self.assertEqual(cuda.register(base, buffer, 0), 0)
        try:
            # No byte in common, one page: refused, and pending until cleared.
            self.assertEqual(cuda.register(base + buffer, buffer, 0), self.ALREADY_REGISTERED)
            self.assertEqual(cuda.clear_error(), self.ALREADY_REGISTERED)
            self.assertEqual(cuda.clear_error(), 0)
            self.assertEqual(cuda.unregister(base + 5 * page), self.NOT_REGISTERED)
            self.assertEqual(cuda.clear_error(), self.NOT_REGISTERED)
        finally:
            self.assertEqual(cuda.unregister(base), 0)
        self.assertEqual(cuda.clear_error(), 0)

    def test_buffers_sharing_a_page_both_register(self):
        buffer = self.page + 192
        pins = PinnedHostRanges(self.cuda, self.page)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertTrue(pins.pin(self.base, buffer))
            self.assertTrue(pins.pin(self.base + buffer, buffer))
        self.assertEqual([str(w.message) for w in caught], [])
        self.assertEqual(pins.ranges(), [(self.base, 2 * self.page, 0),
                                         (self.base + 2 * self.page, self.page, 0)])
        device = (torch.arange(2 * buffer, device="cuda") % 251).to(torch.uint8)
        host = self.memory[self.base - self.memory.data_ptr():][:2 * buffer]
        host[buffer:].copy_(device[buffer:], non_blocking=True)
        host[:buffer].copy_(device[:buffer], non_blocking=True)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(host, device.cpu()))
        pins.release()
        self.assertEqual(pins.ranges(), [])
        self.assertEqual(self.cuda.clear_error(), 0)


@unittest.skipUnless(torch.cuda.is_available(), NO_CUDA)
class CudaModelTest(DaemonTest):

    def assertCase(self, what, result):
        for name, err in result["param_errors"].items():
            self.assertLessEqual(err, TOLERANCE, f"{what}: parameter '{name}'")
        self.assertLessEqual(result["loss_error"], TOLERANCE, f"{what}: losses")
        self.assertGreater(result["moved"], 1e-3, f"{what}: the parameters did not move")
        pinning = result["pinning"]
        for w in pinning["warnings"]:
            self.assertNotIn("cudaError 712", w, f"{what}: a registration overlapped another")
        self.assertTrue(pinning["gradient"], f"{what}: the gradient buffers are not registered "
                        f"with CUDA: {pinning['warnings']}")
        self.assertIn(pinning["pending_error"], (0, None), f"{what}: a CUDA error left pending")
        print(f"\n  {what}: largest parameter error {max(result['param_errors'].values()):.2e}, "
              f"loss error {result['loss_error']:.2e}; update buffers registered: "
              f"{pinning['update']}; pending error readable: "
              f"{pinning['pending_error'] is not None}; warnings: {pinning['warnings']}",
              file=sys.stderr)

    def test_world_1(self):
        torch.backends.cuda.matmul.allow_tf32 = False
        for name, transport, stream in CASES:
            cpu = train("cpu", self.daemon.address, f"w1-cpu-{name}", transport, stream)
            cuda = train("cuda:0", self.daemon.address, f"w1-cuda-{name}", transport, stream)
            self.assertCase(f"world 1 {name}", case_result(cpu, cuda))

    def test_world_2(self):
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory(prefix="cuda-apply-") as tmp:
            mp.spawn(run_world_2, args=(2, self.daemon.address, tmp, LIB), nprocs=2, join=True)
            with open(os.path.join(tmp, "result.json")) as f:
                ranks = json.load(f)
        self.assertEqual(len(ranks), 2)
        for name, _, _ in CASES:
            for rank, result in enumerate(ranks):
                self.assertCase(f"world 2 {name} rank {rank}", result[name])
            self.assertEqual(ranks[0][name]["checksum"], ranks[1][name]["checksum"],
                             f"world 2 {name}: the ranks' parameters differ")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[3:]])
