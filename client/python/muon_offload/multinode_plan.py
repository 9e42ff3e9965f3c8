"""The plan of a multi-node job (DESIGN.md 4c) as every rank computes it: which node each rank is
on (node_layout), which node owns each tensor (ownership_plan, the client library's
muond_ownership_plan), and the routing of the world's ZeRO partitions to the owners' local ranks
(NodeRouting, see multinode.py). Pure functions of the global job spec and the node map, except
node_layout, which may gather the ranks' GROUP_RANK (a collective).
"""
import ctypes
import os

import torch

from . import _native
from .client import _spec_text


def ownership_plan(spec, nodes):
    """(owner per tensor in job order, Newton-Schulz FLOPs per node, state bytes per node) of the
    job spec (dict or job.json text) over `nodes` nodes. MuondError INVALID_ARGUMENT when some
    node would own no tensor."""
    text = _spec_text(spec)
    fn = _native.function("muond_ownership_plan")
    total = ctypes.c_size_t()
    _native.check(fn(text, int(nodes), None, 0, ctypes.byref(total), None, None),
                  "muond_ownership_plan")
    owner = (ctypes.c_int32 * max(total.value, 1))()
    flops = (ctypes.c_double * nodes)()
    size = (ctypes.c_double * nodes)()
    _native.check(fn(text, int(nodes), owner, total.value, ctypes.byref(total), flops, size),
                  "muond_ownership_plan")
    return list(owner[:total.value]), list(flops), list(size)


def node_layout(ranks, node_map=None):
    """The node of every global rank (list). node_map: given explicitly; else torchrun's
    GROUP_RANK of every rank (gathered). Nodes must be numbered 0..N-1, each with a rank;
    LOCAL_RANK, when set, must be the rank's place among its node's ranks in rank order."""
    if node_map is None:
        if "GROUP_RANK" not in os.environ:
            raise ValueError("multi-node: pass node_map (global rank -> node) or run under "
                             "torchrun (GROUP_RANK)")
        mine = int(os.environ["GROUP_RANK"])
        node_map = [mine]
        if ranks.size > 1:
            node_map = [None] * ranks.size
            ranks.dist.all_gather_object(node_map, mine, group=ranks.group)
    node_map = [int(n) for n in node_map]
    if len(node_map) != ranks.size:
        raise ValueError(f"node_map has {len(node_map)} entries for {ranks.size} ranks")
    if sorted(set(node_map)) != list(range(max(node_map) + 1)):
        raise ValueError(f"nodes must be numbered 0..N-1, each with a rank; node_map {node_map}")
    local = [q for q in range(ranks.size) if node_map[q] == node_map[ranks.rank]].index(ranks.rank)
    env = os.environ.get("LOCAL_RANK")
    if env is not None and int(env) != local:
        raise ValueError(f"rank {ranks.rank}: LOCAL_RANK {env} but the rank is local rank "
                         f"{local} of node {node_map[ranks.rank]} (ranks of a node in rank order)")
    return node_map


class NodeRouting:
    """Where every piece of every rank's partition goes. A piece is one span (tensor t, offset,
    length, rank_offset) of a global rank q's partition; it goes to local rank q mod L_n of the
    owner node n of t. The receiving rank's spans (its node job's explicit layout) are its pieces
    in the order (q, position in q's partition), which is the all-to-all's output order.

    node_of: per global rank; owner: per tensor; rank: this process's global rank. Attributes of
    this rank: node, local_rank, node_job_id (set by node_spec's caller), send_splits and
    recv_splits (elements per peer rank), send_elements, sent_elements_remote and
    recv_elements_remote (without the pieces to itself)."""

    def __init__(self, spec, partitions, node_of, plan, rank):
        self.spec = spec
        self.owner = list(plan[0])
        self.node_of = list(node_of)
        self.nodes = max(node_of) + 1
        self.members = [[q for q in range(len(node_of)) if node_of[q] == n]
                        for n in range(self.nodes)]
        self.tensors_of = [[t for t, o in enumerate(self.owner) if o == n]
                           for n in range(self.nodes)]
        self.index_in_node = {}
        for tensors in self.tensors_of:
            for i, t in enumerate(tensors):
                self.index_in_node[t] = i
        world = len(partitions)
        # received[d]: (q, t, offset, length) in arrival order; sent: this rank's (d, piece)
        self.received = [[] for _ in range(world)]
        sent = []
        for part in partitions:
            for t, offset, length, rank_offset in part.spans:
                n = self.owner[t]
                d = self.members[n][part.rank % len(self.members[n])]
                self.received[d].append((part.rank, t, offset, length))
                if part.rank == rank:
                    sent.append((d, rank_offset, length))
        sent.sort(key=lambda x: x[0])  # stable: partition order within a destination
        self.sent = sent
        self.rank = rank
        self.node = node_of[rank]
        self.local_rank = self.members[self.node].index(rank)
        self.node_job_id = None
        self.send_splits = [0] * world
        for d, _, length in sent:
            self.send_splits[d] += length
        self.recv_splits = [0] * world
        for q, _, _, length in self.received[rank]:
            self.recv_splits[q] += length
        self.send_elements = sum(self.send_splits)
        self.sent_elements_remote = self.send_elements - self.send_splits[rank]
        self.recv_elements_remote = sum(self.recv_splits) - self.recv_splits[rank]

    def node_spans(self, local_rank, node=None):
        """(tensor index in the node's job, offset, length) of a local rank's spans."""
        node = self.node if node is None else node
        d = self.members[node][local_rank]
        return tuple((self.index_in_node[t], offset, length)
                     for _, t, offset, length in self.received[d])

    def node_spec(self, node, global_job_id):
        """The job spec (dict) of `node`'s daemon: the tensors it owns, its local ranks with the
        explicit layout, and the "multinode" block. Sets node_job_id for this rank's node."""
        spec = dict(self.spec)
        key = "tensors" if "tensors" in spec else "matrices"
        tensors = spec[key]
        job_id = f"{global_job_id}.node{node}"
        if node == self.node:
            self.node_job_id = job_id
        spec.update({"job_id": job_id, "world_size": len(self.members[node]), "zero_stage": 0,
                     key: [tensors[t] for t in self.tensors_of[node]],
                     "multinode": {"global_job_id": global_job_id, "node": node,
                                   "nodes": self.nodes}})
        names = [tensors[t]["name"] for t in self.tensors_of[node]]
        spec["layout"] = [[{"matrix": names[m], "offset": o, "length": n}
                           for m, o, n in self.node_spans(j, node)]
                          for j in range(len(self.members[node]))]
        return spec

    def gather_send(self, part):
        """This rank's send buffer: its pieces of `part` (flat partition) in destination order."""
        if not self.sent:
            return part.new_empty(0)
        return torch.cat([part[ro:ro + length] for _, ro, length in self.sent])

    def scatter_back(self, back, out):
        """The inverse: `back` (send order) into `out` (partition layout)."""
        at = 0
        for _, ro, length in self.sent:
            out[ro:ro + length].copy_(back[at:at + length])
            at += length

