"""The model of multinode_netns_bench.py (its module comment states it): a step's modelled time
at N nodes from the 1-node step's CPU seconds, the busiest node's Newton-Schulz share, the CPU
share of concurrent daemons and the busiest link's bytes over the measured link rate; and the
medians it takes of the ranks' per-step results. Pure functions of the results.
"""
import statistics


def median_step(results):
    """Median over the measured steps of the slowest rank's time, and the per-phase medians
    (each phase: the slowest rank's)."""
    per_step = list(zip(*[res["steps"] for res in results]))
    totals = [max(s["total"] for s in step) for step in per_step]
    names = sorted({k for step in per_step for s in step for k in s} - {"total", "rank_cpu"})
    phases = {k: statistics.median(max(s.get(k, 0.0) for s in step) for step in per_step)
              for k in names}
    return statistics.median(totals), phases


def shared_makespan(loads, speed):
    """When the last of `loads` (seconds alone) ends if the ones still running, k of them,
    each progress at speed[k] (processor sharing)."""
    left = sorted(x for x in loads if x > 0)
    t = 0.0
    while left:
        k = len(left)
        s = speed[min(k, max(speed))]
        dt = left[0] / s
        t += dt
        done = left[0]
        left = [x - done for x in left[1:]]
    return t


def collective_medians(results):
    """The standalone collectives: per repetition the slowest rank's time, median over the
    repetitions, per collective."""
    reps = list(zip(*[res["collectives"] for res in results]))
    if not reps:
        return {}
    return {k: statistics.median(max(x[k] for x in rep) for rep in reps) for k in reps[0][0]
            if k != "cpu"}


def collective_cpu_seconds(results):
    """The ranks' CPU seconds in the standalone collectives (slowest rank, median)."""
    reps = list(zip(*[res["collectives"] for res in results]))
    return statistics.median(max(x["cpu"] for x in rep) for rep in reps) if reps else 0.0


def step_cpu_seconds(results):
    """CPU seconds of one step: per measured step the busiest node's daemon plus its slowest
    rank, the median over the steps."""
    per_step = list(zip(*[res["steps"] for res in results]))
    return statistics.median(max(s["daemon_cpu"] + s["rank_cpu"] for s in step)
                             for step in per_step)


def model(nodes, results, t1_cpu, contention, link):
    rate = link["bytes_per_second"]
    rank0 = results[0]
    flops = rank0["node_flops"]
    # Node n's work: its FLOPs share of the 1-node step's CPU seconds; while k nodes compute,
    # each gets the CPU share s(k) measured around the run (the mean of before and after).
    loads = [t1_cpu * f / sum(flops) for f in flops]
    speed = {k: c["share"] for k, c in contention.items()}
    compute = shared_makespan(loads, speed)
    egress = [0] * nodes
    ingress = [0] * nodes
    for res in results:
        s, r = res["forward_cross_node_bytes"]
        egress[res["node"]] += s
        ingress[res["node"]] += r
    a2a_bytes = max(max(e, i) for e, i in zip(egress, ingress))  # one all-to-all, busiest node
    world = len(results)
    e = rank0["element_bytes"]
    allgather_bytes = (world - 1) * rank0["partition_buffer_elements"] * e if nodes > 1 else 0
    link_a2a = 2 * a2a_bytes / rate
    link_allgather = allgather_bytes / rate
    alone = collective_medians(results)
    gloo_a2a = alone.get("alltoall_forward", 0.0) + alone.get("alltoall_inverse", 0.0)
    gloo_allgather = alone.get("zero_allgather", 0.0)
    # The rate gloo's collectives reach on these links (bytes of the busiest node link / time).
    rate_a2a = 2 * a2a_bytes / gloo_a2a if gloo_a2a else None
    rate_allgather = allgather_bytes / gloo_allgather if gloo_allgather else None
    return {"compute": compute, "compute_cpu_seconds": loads, "cpu_share": speed,
            "max_mean_flops": max(flops) / (sum(flops) / len(flops)),
            "node_link_bytes_alltoall": 2 * a2a_bytes,
            "node_link_bytes_allgather": allgather_bytes,
            "network_link": link_a2a + link_allgather,
            "network_link_alltoall": link_a2a, "network_link_allgather": link_allgather,
            "modelled_link": compute + link_a2a + link_allgather,
            "network": gloo_a2a + gloo_allgather,
            "network_alltoall": gloo_a2a, "network_allgather": gloo_allgather,
            "gloo_rate_alltoall": rate_a2a, "gloo_rate_allgather": rate_allgather,
            "collectives_alone": alone,
            "modelled": compute + gloo_a2a + gloo_allgather}
