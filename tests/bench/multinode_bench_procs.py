#!/usr/bin/python3
"""What runs inside the emulated nodes of multinode_netns_bench.py (its module comment has the
design and the model): hidden sub-commands the driver starts in a node's namespace.

  --_tcp-recv HOST PORT           accepts one connection and reads it to EOF (the link rate)
  --_tcp-send HOST PORT BYTES     sends BYTES to it
  --_calibrate ADDRESS JOB DTYPE  a single-rank job of one calibration matrix (the CPU share)
  --_rank CONFIG RANK             one rank of the measured MultiNodeMuonWithAuxAdam world
"""
import json
import os
import socket
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
# Qwen3-0.6B-like dimensions: hidden, query (16 heads of 128), key/value (8 heads of 128), MLP.
HIDDEN, Q_DIM, KV_DIM, MLP_DIM = 1024, 2048, 1024, 3072
CALIBRATION_SHAPE = (MLP_DIM, HIDDEN)
CALIBRATION_STEPS = 3


def layer_shapes(layers):
    out = []
    for layer in range(layers):
        p = f"layers.{layer}."
        out += [(p + "q", (Q_DIM, HIDDEN)), (p + "k", (KV_DIM, HIDDEN)),
                (p + "v", (KV_DIM, HIDDEN)), (p + "o", (HIDDEN, Q_DIM)),
                (p + "gate", (MLP_DIM, HIDDEN)), (p + "up", (MLP_DIM, HIDDEN)),
                (p + "down", (HIDDEN, MLP_DIM))]
    return out


def import_client():
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    import muon_offload
    return muon_offload


def tcp_receive(host, port):
    """Accepts one connection, reads to EOF; prints {"bytes", "seconds"} (first byte to EOF)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    total, first = 0, None
    buf = bytearray(1 << 20)
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        if first is None:
            first = time.perf_counter()
        total += n
    end = time.perf_counter()
    print(json.dumps({"bytes": total, "seconds": end - first}), flush=True)


def tcp_send(host, port, nbytes):
    conn = socket.create_connection((host, port), timeout=60)
    chunk = b"\0" * (1 << 20)
    left = nbytes
    while left > 0:
        conn.sendall(chunk[:min(left, len(chunk))])
        left -= min(left, len(chunk))
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # the receiver closes after reading everything
    conn.close()


def calibration_client(address, job_id, dtype_name):
    """One single-rank job of one CALIBRATION_SHAPE matrix on the daemon at `address`. Protocol
    on stdin/stdout: prints "ready" after a warm-up step; each "go N" line runs N steps and
    prints their times (JSON list); "quit" deletes the job."""
    import torch
    mo = import_client()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    w = torch.nn.Parameter(torch.randn(CALIBRATION_SHAPE, generator=g).to(dtype))
    grad = torch.randn(CALIBRATION_SHAPE, generator=g).to(dtype)
    opt = mo.MuonWithAuxAdam([dict(params=[("w", w)], use_muon=True, lr=0.02,
                                   weight_decay=0.01)],
                             address=address, job_id=job_id, transport="shm", stream=False)
    w.grad = grad
    opt.step()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        times = []
        for _ in range(int(cmd[1])):
            w.grad = grad
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        print(json.dumps(times), flush=True)
    opt.close(delete_job=True)


def rank_main(cfg_path, rank):
    """One rank of the gloo world (inside its node's namespace): writes OUT/rank<R>.json."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    out = os.path.join(cfg["out"], f"rank{rank}.json")
    try:
        result = run_rank(cfg, rank)
    except Exception as e:  # reported to the driver, then the rank fails
        result = {"exception": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)
    sys.exit(0 if "exception" not in result else 1)


def run_rank(cfg, rank):
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    mo = import_client()
    import muon_offload.optim_update as optim_module
    from muon_offload.multinode_plan import ownership_plan

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = cfg["master_addr"]
    os.environ["MASTER_PORT"] = str(cfg["port"])
    dist.init_process_group("gloo", rank=rank, world_size=cfg["world"],
                            timeout=timedelta(seconds=300))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["dtype"]]
    node_of = cfg["node_map"]
    g = torch.Generator().manual_seed(1234)  # the same weights on every rank
    params = [(n, torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype)))
              for n, s in layer_shapes(cfg["layers"])]
    g.manual_seed(100 + rank)  # each rank's own (already reduced) gradients
    grads = [torch.randn(p.shape, generator=g).to(dtype) for _, p in params]
    opt = mo.MultiNodeMuonWithAuxAdam(
        [dict(params=params, use_muon=True, lr=0.02, weight_decay=0.01)],
        node_map=node_of, address=cfg["addresses"][node_of[rank]], zero_stage=2,
        mode="update", transport="shm", job_id=cfg["job_id"], reduce_gradients=False)

    # Phase timers (instrumentation only: the same calls, timed).
    phases = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    real_a2a = opt._router.all_to_all
    opt._router.all_to_all = lambda out, inp, forward: timed(
        "alltoall_forward" if forward else "alltoall_inverse", real_a2a)(out, inp, forward)
    opt.session.step_in_place = timed("daemon_step", opt.session.step_in_place)
    optim_module.all_gather_partitions = timed("zero_allgather",
                                               optim_module.all_gather_partitions)

    daemon_pid = cfg["daemon_pids"][node_of[rank]]
    # The step's data exchanges alone, one repetition after each measured step (so that both
    # see the same conditions on the machine).
    exchanges = standalone_collectives(cfg, opt, real_a2a, params) if cfg["world"] > 1 else None
    steps, collectives = [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        for (_, p), grad in zip(params, grads):
            p.grad = grad
        dist.barrier()
        phases.clear()
        cpu0, daemon0 = time.process_time(), process_cpu_seconds(daemon_pid)
        t0 = time.perf_counter()
        opt.step()
        total = time.perf_counter() - t0
        if i >= cfg["warmup"]:
            # CPU seconds of this rank and of its node's daemon during the step (the daemon's
            # counts every local rank's share: the same number on each of them)
            steps.append(dict(phases, total=total, rank_cpu=time.process_time() - cpu0,
                              daemon_cpu=process_cpu_seconds(daemon_pid) - daemon0))
            if exchanges is not None:
                collectives.append(exchanges())

    r = opt._routing
    e = torch.empty(0, dtype=dtype).element_size()
    bytes_per_step = list(opt.bytes_per_step())
    cross_send = sum(n for q, n in enumerate(r.send_splits) if node_of[q] != r.node)
    cross_recv = sum(n for q, n in enumerate(r.recv_splits) if node_of[q] != r.node)
    result = {"rank": rank, "node": r.node, "steps": steps, "collectives": collectives,
              "element_bytes": e,
              "bytes_per_step": bytes_per_step,
              "expected_bytes": list(opt.expected_bytes()),
              "forward_cross_node_bytes": [e * cross_send, e * cross_recv],
              "partition_buffer_elements": opt.partition.buffer_elements,
              "elements": sum(p.numel() for _, p in params)}
    if rank == 0:
        owner, flops, _ = ownership_plan(opt.spec, r.nodes)
        result["node_flops"] = list(flops)
        result["tensors_per_node"] = [owner.count(n) for n in range(r.nodes)]
    opt.close(delete_job=True)
    dist.destroy_process_group()
    return result


def process_cpu_seconds(pid):
    """User + system CPU seconds of process `pid` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def standalone_collectives(cfg, opt, real_all_to_all, params):
    """Returns a function that runs the step's three data exchanges alone, over the same world
    and links, through the same library calls with the step's sizes (a collective: every rank
    calls it): the forward all-to-all (with gathering the routed pieces of the partition), the
    inverse one (with scattering the results back into partition order) and ZeRO's all-gather
    of the parameters (with copying them into the tensors). Each after an idle pause, as in a
    step where they follow the compute. It returns this rank's seconds in each, and its CPU
    seconds in the three ("cpu")."""
    import torch
    import torch.distributed as dist
    from muon_offload.zero import all_gather_partitions, copy_into_buffer
    r = opt._routing
    tensors = [p for _, p in params]
    part = torch.zeros(opt.partition.buffer_elements, dtype=opt.dtype)
    recv = torch.empty(sum(r.recv_splits), dtype=opt.dtype)
    back = torch.empty(r.send_elements, dtype=opt.dtype)
    out = torch.zeros_like(part)
    cpu = []

    def timed(fn):
        dist.barrier()
        time.sleep(cfg["idle"])
        t0, cpu0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - cpu0)
        return time.perf_counter() - t0

    def forward():
        real_all_to_all(recv, r.gather_send(part), forward=True)

    def inverse():
        real_all_to_all(back, recv, forward=False)
        r.scatter_back(back, out)

    def allgather():
        with torch.no_grad():  # as in opt.step()
            all_gather_partitions(part, opt.partitions, opt.rank, tensors, opt.process_group)

    def once():
        # the current parameters: the all-gather writes back the values they have
        copy_into_buffer(part, opt.partition, tensors)
        cpu.clear()
        rep = {"alltoall_forward": timed(forward), "alltoall_inverse": timed(inverse),
               "zero_allgather": timed(allgather)}
        rep["cpu"] = sum(cpu)
        return rep
    return once


def main(argv):
    if argv[:1] == ["--_tcp-recv"]:
        return tcp_receive(argv[1], int(argv[2]))
    if argv[:1] == ["--_tcp-send"]:
        return tcp_send(argv[1], int(argv[2]), int(argv[3]))
    if argv[:1] == ["--_calibrate"]:
        return calibration_client(argv[1], argv[2], argv[3])
    if argv[:1] == ["--_rank"]:
        return rank_main(argv[1], int(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
