"""The plan of a multi-node job (DESIGN.md 4c) as every rank computes it: which node each rank is
on (node_layout), which node owns each tensor or, for an AdamW tensor split by rows, each row
range (ownership_plan and ownership_pieces: the client library's muond_ownership_plan and
muond_ownership_pieces), and the routing of the world's ZeRO partitions to the owners' local
ranks (NodeRouting, see multinode.py). Pure functions of the global job spec and the node map,
except node_layout, which may gather the ranks' GROUP_RANK (a collective).
"""
import ctypes
import os

import torch

from . import _native
from .client import _spec_text


def ownership_plan(spec, nodes):
    """(owner per tensor in job order, FLOPs per node, state bytes per node) of the job spec (dict
    or job.json text) over `nodes` nodes; a tensor split by rows across nodes (ownership_pieces)
    is owned by the node of its first rows here. MuondError INVALID_ARGUMENT when some node would
    own nothing."""
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


def ownership_pieces(spec, nodes):
    """The plan's pieces: [(tensor, first row, end row, node)] by tensor then rows. A tensor not
    split is one piece of all its rows (its first dimension; a 0-d tensor: one row); an AdamW
    tensor larger than a node's share of the state is split by rows across nodes."""
    text = _spec_text(spec)
    fn = _native.function("muond_ownership_pieces")
    total = ctypes.c_size_t()
    _native.check(fn(text, int(nodes), None, None, None, None, 0, ctypes.byref(total)),
                  "muond_ownership_pieces")
    n = max(total.value, 1)
    tensor, node = (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)()
    begin, end = (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)()
    _native.check(fn(text, int(nodes), tensor, begin, end, node, n, ctypes.byref(total)),
                  "muond_ownership_pieces")
    return [(tensor[i], begin[i], end[i], node[i]) for i in range(total.value)]


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


def _rows(shape):
    return int(shape[0]) if len(shape) else 1


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


class NodeRouting:
    """Where every piece of every rank's partition goes. A piece is one span (tensor t, offset,
    length, rank_offset) of a global rank q's partition, cut where t is split by rows across nodes
    (ownership_pieces); it goes to local rank q mod L_n of the node n that owns those rows. The
    receiving rank's spans (its node job's explicit layout) are its pieces in the order (q,
    position in q's partition), which is the all-to-all's output order. A node's job holds a
    unit per (tensor, rows) it owns: the whole tensor, or rows of it (job.json "rows").

    node_of: per global rank; plan: ownership_plan's result; pieces: ownership_pieces' (None:
    every tensor whole on plan's owner); rank: this process's global rank. Attributes of this
    rank: node, local_rank, node_job_id (set by node_spec's caller), send_splits and recv_splits
    (elements per peer rank), send_elements, sent_elements_remote and recv_elements_remote
    (without the pieces to itself)."""

    def __init__(self, spec, partitions, node_of, plan, rank, pieces=None):
        self.spec = spec
        tensors = spec["tensors" if "tensors" in spec else "matrices"]
        shapes = [t["shape"] for t in tensors]
        self.owner = list(plan[0])
        if pieces is None:
            pieces = [(t, 0, _rows(shapes[t]), o) for t, o in enumerate(self.owner)]
        self.node_of = list(node_of)
        self.nodes = max(node_of) + 1
        self.members = [[q for q in range(len(node_of)) if node_of[q] == n]
                        for n in range(self.nodes)]
        # units: (tensor, first row, end row, node), by tensor then rows; a node's in that order
        self.units = [tuple(int(x) for x in p) for p in pieces]
        self.units_of = [[u for u, p in enumerate(self.units) if p[3] == n]
                         for n in range(self.nodes)]
        self.index_in_node = {}
        for units in self.units_of:
            for i, u in enumerate(units):
                self.index_in_node[u] = i
        # per tensor: (first element, end element, unit) of its units
        self._cuts = [[] for _ in shapes]
        for u, (t, begin, end, _) in enumerate(self.units):
            row = _numel(shapes[t]) // _rows(shapes[t])
            self._cuts[t].append((begin * row, end * row, u))
        world = len(partitions)
        # received[d]: (q, unit, offset in the unit, length) in arrival order; sent: this rank's
        # (d, rank_offset, length)
        self.received = [[] for _ in range(world)]
        sent = []
        for part in partitions:
            for t, offset, length, rank_offset in part.spans:
                for lo, hi, u in self._cuts[t]:
                    a, b = max(lo, offset), min(hi, offset + length)
                    if a >= b:
                        continue
                    n = self.units[u][3]
                    d = self.members[n][part.rank % len(self.members[n])]
                    self.received[d].append((part.rank, u, a - lo, b - a))
                    if part.rank == rank:
                        sent.append((d, rank_offset + (a - offset), b - a))
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

    def split_tensors(self):
        """Indices of the tensors split by rows across nodes."""
        counts = {}
        for t, _, _, _ in self.units:
            counts[t] = counts.get(t, 0) + 1
        return sorted(t for t, c in counts.items() if c > 1)

    def node_spans(self, local_rank, node=None):
        """(tensor index in the node's job, offset, length) of a local rank's spans."""
        node = self.node if node is None else node
        d = self.members[node][local_rank]
        return tuple((self.index_in_node[u], offset, length)
                     for _, u, offset, length in self.received[d])

    def node_spec(self, node, global_job_id):
        """The job spec (dict) of `node`'s daemon: the tensors (or rows of tensors) it owns, its
        local ranks with the explicit layout, and the "multinode" block. Sets node_job_id for
        this rank's node."""
        spec = dict(self.spec)
        key = "tensors" if "tensors" in spec else "matrices"
        tensors = spec[key]
        job_id = f"{global_job_id}.node{node}"
        if node == self.node:
            self.node_job_id = job_id
        held = []
        for u in self.units_of[node]:
            t, begin, end, _ = self.units[u]
            tensor = dict(tensors[t])
            rows = _rows(tensor["shape"])
            if (begin, end) != (0, rows):
                tensor["shape"] = [end - begin] + list(tensor["shape"][1:])
                tensor["rows"] = {"offset": begin, "of": rows}
            held.append(tensor)
        spec.update({"job_id": job_id, "world_size": len(self.members[node]), "zero_stage": 0,
                     key: held,
                     "multinode": {"global_job_id": global_job_id, "node": node,
                                   "nodes": self.nodes}})
        names = [t["name"] for t in held]
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

