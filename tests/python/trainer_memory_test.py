#!/usr/bin/python3
"""ZeRO's memory promise for the trainer in apply mode: with world 2 and ZeRO stage 2, each rank's
trainer holds its parameters, their gradients and staging of its own partition only. Two gloo
ranks (spawned processes) step a 16 Mi-element fp32 model through muond over shared memory; a
sampler thread reads the process's anonymous memory (/proc/self/smaps_rollup "Anonymous": the
heap and torch's CPU tensors; the shared-memory regions the daemon maps too are shmem, not
counted) every millisecond. The peak growth over the memory before the model existed must stay
under parameters + gradients + 2 partitions + 10 %. Before the windowed collectives the staging
alone was a model-sized world buffer plus gloo's received copy of it (two models).

Usage: trainer_memory_test.py MUOND_BIN LIBMUOND_CLIENT
"""
import json
import os
import sys
import tempfile
import threading
import time
import unittest

MUOND, LIB = sys.argv[1], sys.argv[2]
os.environ["MUOND_CLIENT_LIB"] = LIB
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from apply_harness import DaemonTest  # noqa: E402

DaemonTest.muond = MUOND
SHAPES = [(2048, 2048), (2048, 2048), (2048, 2048), (2048, 2048)]  # 16 Mi elements
STEPS = 3


def anonymous_bytes():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Anonymous line in /proc/self/smaps_rollup")


class Sampler:
    def __init__(self):
        self.peak = anonymous_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, anonymous_bytes())
            time.sleep(0.001)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_bytes())
        return self.peak


def worker(rank, world, address, tmp, lib):
    os.environ["MUOND_CLIENT_LIB"] = lib
    import torch.distributed as dist

    from muon_offload import MuonWithAuxAdam
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                           world_size=world)
    before = anonymous_bytes()
    sampler = Sampler()
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.empty(s).normal_(0.0, 0.02, generator=g)) for s in SHAPES]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = MuonWithAuxAdam([dict(params=params[:3], use_muon=True, lr=0.02),
                           dict(params=params[3:], use_muon=False, lr=1e-3)],
                          address=address, job_id="trainer-memory", mode="apply",
                          zero_stage=2, transport="shm", stream=False)
    for step in range(STEPS):
        for p in params:
            p.grad.normal_(generator=g)
        opt.step()
    peak = sampler.stop()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    partition_bytes = opt.partition.buffer_elements * params[0].element_size()
    result = {"growth": peak - before, "params": param_bytes, "grads": param_bytes,
              "partition": partition_bytes, "workspace": opt.offload.workspace_bytes(),
              "step_id": opt.step_id}
    opt.close(delete_job=True)  # a collective: rank 0 deletes after every rank detached
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


class TrainerMemoryTest(DaemonTest):
    def test_world2_stage2_peak_is_params_grads_and_two_partitions(self):
        import torch.multiprocessing as mp
        # Blocks of 128 KiB and more are mapped and unmapped (glibc's default before its dynamic
        # threshold moves), so anonymous memory is what is allocated, not what the heap kept.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
        with tempfile.TemporaryDirectory(prefix="trainer-memory-") as tmp:
            mp.spawn(worker, args=(2, self.daemon.address, tmp, LIB), nprocs=2, join=True)
            results = []
            for r in range(2):
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    results.append(json.load(f))
        mib = 1 << 20
        for r, res in enumerate(results):
            self.assertEqual(res["step_id"], STEPS)
            bound = (res["params"] + res["grads"] + 2 * res["partition"]) * 1.10
            print(f"\n  rank {r}: peak growth {res['growth'] / mib:.1f} MiB; parameters "
                  f"{res['params'] / mib:.1f} + gradients {res['grads'] / mib:.1f} + 2 partitions "
                  f"{2 * res['partition'] / mib:.1f} MiB, + 10 %: bound {bound / mib:.1f} MiB; "
                  f"staging {res['workspace'] / mib:.1f} MiB", file=sys.stderr)
            self.assertLessEqual(res["workspace"], 2 * res["partition"] + 64 * 4)
            self.assertLessEqual(res["growth"], bound, f"rank {r}")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[3:], verbosity=2)
