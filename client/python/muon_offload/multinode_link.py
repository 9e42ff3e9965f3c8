"""The node jobs of a multi-node optimizer (DESIGN.md 4c; the protocol is described in
multinode.py): the ownership plan and routing every rank computes, each node's job created by its
local rank 0, every rank attached to its node's daemon with the routed span layout, and where the
all-to-alls run. NodeJobLink is the JobLink (optim_job.py) of MultiNodeMuonWithAuxAdam.
"""
import ctypes

import torch

from . import _native
from ._native import CODES, MuondError
from .client import Client
from .multinode_plan import NodeRouting, node_layout, ownership_pieces, ownership_plan
from .optim_job import JobLink


class NodeJobLink(JobLink):
    """JobLink over nodes. node_map (global rank -> node, None: GROUP_RANK), import_dir (the
    node jobs take their state from an export there), route_device (as given; resolved by
    open()). After open(): routing (NodeRouting; None before), global_job_id (the optimizer's
    job_id), nodes, node_tokens ({node: token}), node_token (this rank's node's),
    route_device (None: host tensors straight into the regions, else the staging device)."""

    def __init__(self, ctx, options, node_map, import_dir, route_device):
        super().__init__(ctx, options)
        self.node_map, self.import_dir = node_map, import_dir
        self.route_device_arg, self.route_device = route_device, None
        self.routing = None
        self.global_job_id = self.nodes = self.node_tokens = self.node_token = None

    def open(self, takeover):
        """Connects (rank 0 checks its daemon's health), then plans the nodes, creates each
        node's job (its local rank 0) and attaches every rank (collectives)."""
        self.client = Client(self.address)
        self.token = self.ctx.ranks.on_rank0(self.create_job)
        self._setup_nodes(takeover)

    def create_job(self):
        # Each node's local rank 0 creates its node's job in _setup_nodes, after the plan.
        self.client.health(5.0)
        return self.token

    def _setup_nodes(self, takeover):
        ctx = self.ctx
        if len({p.dtype for _, p in ctx.job_tensors}) != 1:
            raise ValueError("MultiNodeMuonWithAuxAdam: every tensor of the job must have one "
                             "dtype (the all-to-all moves flat buffers)")
        self.route_device = self._pick_route_device(self.route_device_arg)
        node_of = node_layout(ctx.ranks, self.node_map)
        nodes = max(node_of) + 1
        plan = ownership_plan(self.spec, nodes)
        self.global_job_id = self.job_id
        self.routing = NodeRouting(self.spec, self.partitions, node_of, plan, ctx.rank,
                                   ownership_pieces(self.spec, nodes))
        r = self.routing
        r.node_job_id = f"{self.global_job_id}.node{r.node}"
        self.nodes = r.nodes
        tokens = self.each_rank(lambda: self._node_job_token(r) if r.local_rank == 0 else None)
        # Every node's token (node -> token): a restarted trainer passes them back as token=.
        self.node_tokens = {node_of[q]: t for q, t in enumerate(tokens) if t is not None}
        self.node_token = self.node_tokens[r.node]
        self.each_rank(lambda: self.attach(takeover))
        steps = self.each_rank(lambda: ctx.step_id)
        if len(set(steps)) != 1:
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"global job '{self.global_job_id}': the nodes' jobs expect steps "
                             f"{steps} (by rank); load a checkpoint on every node", "attach")

    def _pick_route_device(self, wanted):
        """Where the all-to-alls run: None (gloo: host tensors straight into and out of the node's
        region) or a device staged through (NCCL: the GPU). `wanted` None: by the backend; "cpu"
        stages on the host with gloo (the tests' staged path); CUDA needs NCCL."""
        ranks = self.ctx.ranks
        nccl = ranks.size > 1 and ranks.dist.get_backend(ranks.group) == "nccl"
        if wanted is None:
            return torch.device("cuda", torch.cuda.current_device()) if nccl else None
        device = torch.device(wanted)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if nccl != (device.type == "cuda") and ranks.size > 1:
            raise ValueError(f"MultiNodeMuonWithAuxAdam: route_device {device} with a "
                             f"{ranks.dist.get_backend(ranks.group)} process group "
                             "(NCCL moves CUDA tensors, gloo host tensors)")
        return device

    def _node_job_token(self, r):
        if self.token is not None:  # a restarted trainer: the jobs exist
            if isinstance(self.token, dict):
                return self.token[r.node]
            return self.token
        return self.client.create_job(r.node_spec(r.node, self.global_job_id),
                                      import_dir=self.import_dir)

    def attach(self, takeover):
        """Attaches this rank to its node's job, its layout checked against the routing."""
        r = self.routing
        if r is None:
            return  # not planned yet: _setup_nodes attaches
        self.session = self.client.attach(r.node_job_id, r.local_rank, self.node_token,
                                          takeover, self.transport)
        want = r.node_spans(r.local_rank)
        if tuple(s[:3] for s in self.session.spans) != tuple(want):
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"job '{r.node_job_id}' local rank {r.local_rank}: the daemon's "
                             "layout differs from this optimizer's routing (another model, world "
                             "or node map?)", "attach")
        self.ctx.step_id = self.session.next_step
        self.on_attach(self.session)

    def each_rank(self, fn):
        """Runs fn on every rank and returns every rank's result (all_gather_object); when it
        raises on any rank, every rank raises the same MuondError naming the first one."""
        ranks = self.ctx.ranks
        result, error = None, None
        try:
            result = fn()
        except MuondError as e:
            error = (e.code, e.message, e.operation)
        except (ValueError, RuntimeError) as e:
            error = (CODES["UNKNOWN"], f"{type(e).__name__}: {e}", "multinode")
        gathered = [(result, error)]
        if ranks.size > 1:
            gathered = [None] * ranks.size
            ranks.dist.all_gather_object(gathered, (result, error), group=ranks.group)
        for q, (_, err) in enumerate(gathered):
            if err is not None:
                code, message, operation = err
                raise MuondError(code, f"rank {q} (node {self._node_of(q)}): {message}",
                                 operation)
        return [res for res, _ in gathered]

    def _node_of(self, rank):
        return self.routing.node_of[rank] if self.routing is not None else "?"

    def list_steps(self):
        """The steps of this node job's checkpoint generations (its local rank 0)."""
        total = ctypes.c_size_t()
        fn = _native.function("muond_checkpoint_list")
        args = (self.client.handle, self.routing.node_job_id.encode(), self.node_token.encode())
        _native.check(fn(*args, None, None, 0, ctypes.byref(total)), "muond_checkpoint_list")
        n = total.value
        steps = (ctypes.c_int64 * max(n, 1))()
        _native.check(fn(*args, None, steps, n, ctypes.byref(total)), "muond_checkpoint_list")
        return [steps[i] for i in range(min(n, total.value))]

    def delete_job(self):
        """After every rank detached (a barrier): each node's local rank 0 deletes its job."""
        if self.routing is None:
            return
        self.ctx.ranks.barrier()
        if self.routing.local_rank == 0:
            self.client.delete_job(self.routing.node_job_id, self.node_token)
