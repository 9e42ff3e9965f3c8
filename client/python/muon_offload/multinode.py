"""Many nodes (DESIGN.md 4c): MuonWithAuxAdam over a torch.distributed world that spans nodes, one
muond daemon per node. Daemons never talk to each other; the trainer's own process group moves
the data.

    opt = MultiNodeMuonWithAuxAdam(groups, zero_stage=2)   # torchrun: GROUP_RANK says the node

The world's ZeRO partitions stay as in one node (stage 1/2/3 of the global job spec over all W
ranks). From the global spec and the node count, every rank computes the same ownership plan
(muond_ownership_plan in the client library: tensor -> node, Newton-Schulz FLOPs and state bytes
balanced). Node n's daemon holds a job of its own ("<global job id>.node<n>", spec field
"multinode") with only the tensors n owns, attached by n's local ranks with an explicit span
layout: the piece of tensor t in global rank r's partition goes to local rank r mod L_n of the
owner node (L_n: its local ranks), and local rank j's spans are the pieces it receives in the
order (source rank, position in the source's partition). So one all-to-all over the world group
(all_to_all_single with split sizes) writes every piece straight into the receiving rank's
shared-memory gradient buffer, the rank pushes it to its daemon, and the inverse all-to-all
returns the results (updates, or in apply mode the new parameters) into each rank's partition.

Per step and rank r: the forward all-to-all sends e * (P_r - S_r) bytes and receives
e * (Q_r - S_r); the inverse sends and receives the reverse. P_r: the elements of r's partition
(without padding), Q_r: the elements r's node daemon serves r (its spans in the node job), S_r:
the elements routed from r to itself, e: the element size. So sent = received =
e * (P_r + Q_r - 2 S_r) per step. bytes_per_step() reports what the last step passed to
all_to_all_single; expected_bytes() evaluates the formula from the plan.

Atomic steps across nodes (two-phase, job_prepare.cc in the daemon): a node's daemon computes the
step, returns the results and keeps the step prepared. The ranks then agree (one all-reduce over
the world of a failure flag and, in apply mode, of every group's lr and weight decay and the
gradient divisor: a node's daemon checks that its own ranks agree on them, and this checks that
the nodes do; a disagreement refuses the step on every node with INVALID_ARGUMENT naming the group
and the values); when every rank's node succeeded and the values agree each rank commits its node's job
(CommitStep; the first commit changes the state, later ones answer OK) before the inverse
all-to-all; when any failed, every rank aborts its node's step (AbortStep: state bit-identical,
not fenced) and every rank raises the same MuondError naming the first failing rank and node. A
rank that dies, or a broken process group, shows as a failed collective: each survivor aborts
its node's step and raises the same ABORTED error. Recovery after a dead daemon or rank:
restart it, then load_checkpoint() (the newest step every node has).

Checkpoints: save_checkpoint() has each node's local rank 0 save its node's job; state_dict()
names the per-node generations ({"muond": {"global_job_id", "next_step", "nodes": [{"node",
"job_id", "generation", "step"}]}}); load_checkpoint() picks the newest step every node has.

Changing the number of nodes (re-sharding): export_state(dir) has every node's local rank 0
write its node job's whole optimizer state by tensor name into one directory (a shared
filesystem, or the files gathered there); state_dict() then names the export ({"muond":
{"global_job_id", "next_step", "export_dir", "nodes": [...]}}). A new optimizer over the new set
of nodes, created with import_dir=dir, has each node's job take the tensors it now owns from
there (every tensor of it present, of one step) and continues bit-identically;
load_state_dict() of the exported state_dict restores the trainer's own (AdamW) state and checks
the step.

Finding the local daemon: `address` is this process's node-local daemon (None: its default
socket). The node of each rank: `node_map` (list, global rank -> node) or torchrun's GROUP_RANK
(LOCAL_RANK, when set, must agree with the rank's place among its node's ranks in rank order).

Global clipping (apply mode, max_grad_norm): the norm spans the nodes, so no node clips by its own
(a node job with max_grad_norm refuses a step that does not carry the global clip). Each node
computes the step with clip 1 and returns its raw sum of squares; the agreement adds them up (one
slot per node in its all-reduce, summed in node order, so every rank gets the same bits); when
the global norm calls for clipping, every node recomputes the step with the global sum before
anything commits (_clip_globally), at the cost of a second pass on those steps only.

Routing on the collective's device: with a gloo process group the all-to-alls move host tensors
straight into and out of the node's shared-memory buffers. With an NCCL group (CUDA trainers) the
ZeRO reduce-scatter, both all-to-alls and the all-gather run on the GPU (route_device, by
default the current CUDA device): the received pieces are copied from the GPU into the node's
region, and the results from the region to the GPU, one copy each way. route_device="cpu" stages
the same way on the host with gloo (how that path is tested without GPUs).

Limits: one dtype for every job tensor; no init_from; CPU parameters in update mode, as
MuonWithAuxAdam.
"""
import ctypes

import torch

from . import _native
from ._native import CODES, MuondError
from .apply_mode import group_name
from .optim import MuonWithAuxAdam
from .zero import (all_gather_partition_buffers, copy_from_buffer, copy_into_buffer,
                   fill_world_buffer, reduce_scatter_partitions, scatter_world_buffer)
from .multinode_commit import TwoPhaseSteps
from .multinode_plan import NodeRouting, node_layout, ownership_pieces, ownership_plan


def _wire(t):
    # gloo (torch 1.13) moves no bfloat16: bytes instead (split sizes scaled by the caller).
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


class MultiNodeMuonWithAuxAdam(TwoPhaseSteps, MuonWithAuxAdam):
    """MuonWithAuxAdam (same arguments and behaviour) over nodes; see the module comment.
    node_map: global rank -> node (None: from GROUP_RANK). Every rank passes its own node's
    daemon as `address`. token: for jobs that exist already (a restarted trainer), the
    node_tokens dict ({node: token}) of the optimizer that created them, with its job_id."""

    def __init__(self, param_groups, *, node_map=None, import_dir=None, route_device=None,
                 **kw):
        self._node_map_arg = node_map
        self._import_dir = import_dir
        self._route_device_arg = route_device
        self._routing = None
        if kw.get("delay"):
            raise ValueError("MultiNodeMuonWithAuxAdam: delay=1 is not supported over several "
                             "nodes (each step is routed and committed on every node in step())")
        kw.setdefault("stream", False)  # steps are routed whole between the nodes
        if kw.get("init_from") is not None:
            raise ValueError("MultiNodeMuonWithAuxAdam: init_from is not supported over several "
                             "nodes (each node's job holds only its tensors; upload_params "
                             "sends the trainer's parameters)")
        mgn = kw.get("max_grad_norm")
        if mgn and kw.get("mode", "update") != "apply":
            raise ValueError("MultiNodeMuonWithAuxAdam: max_grad_norm clips globally over the "
                             "nodes in mode='apply' only (in mode='update' each node would clip "
                             "by its own tensors' norm)")
        self._max_grad_norm = float(mgn) if mgn else 0.0
        self.last_grad_norm = None
        super().__init__(param_groups, **kw)
        if self.backend == "muond" and self._job_tensors:
            self._setup_nodes(kw.get("takeover", False))

    # ----- set-up (collectives) -----

    def _create_job(self):
        # The base class creates one job on rank 0: here each node's local rank 0 creates its
        # node's job in _setup_nodes, after the plan.
        self.client.health(5.0)
        return self.token

    def _attach(self, takeover):
        if self._routing is None:
            return  # during the base class's construction: _setup_nodes attaches
        r = self._routing
        self.session = self.client.attach(r.node_job_id, r.local_rank, self.node_token,
                                          takeover, self.transport)
        want = r.node_spans(r.local_rank)
        if tuple(s[:3] for s in self.session.spans) != tuple(want):
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"job '{r.node_job_id}' local rank {r.local_rank}: the daemon's "
                             "layout differs from this optimizer's routing (another model, world "
                             "or node map?)", "attach")
        self.step_id = self.session.next_step
        size = self.session.buffer_elements
        if not self.session.is_shm:
            self._recv = torch.zeros(size, dtype=self.dtype)
            self._result = torch.zeros(size, dtype=self.dtype)

    def _setup_nodes(self, takeover):
        if len({p.dtype for _, p in self._job_tensors}) != 1:
            raise ValueError("MultiNodeMuonWithAuxAdam: every tensor of the job must have one "
                             "dtype (the all-to-all moves flat buffers)")
        self._route_device = self._pick_route_device(self._route_device_arg)
        node_of = node_layout(self.ranks, self._node_map_arg)
        nodes = max(node_of) + 1
        plan = ownership_plan(self.spec, nodes)
        self.global_job_id = self.job_id
        self._routing = NodeRouting(self.spec, self.partitions, node_of, plan, self.rank,
                                    ownership_pieces(self.spec, nodes))
        r = self._routing
        r.node_job_id = f"{self.global_job_id}.node{r.node}"
        self.nodes = r.nodes
        tokens = self._each_rank(lambda: self._node_job_token(r) if r.local_rank == 0 else None)
        # Every node's token (node -> token): a restarted trainer passes them back as token=.
        self.node_tokens = {node_of[q]: t for q, t in enumerate(tokens) if t is not None}
        self.node_token = self.node_tokens[r.node]
        self._each_rank(lambda: self._attach(takeover))
        steps = self._each_rank(lambda: self.step_id)
        if len(set(steps)) != 1:
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"global job '{self.global_job_id}': the nodes' jobs expect steps "
                             f"{steps} (by rank); load a checkpoint on every node", "attach")
        self._upload_pending = (self.mode == "apply" and self.step_id == 0
                                and self._import_dir is None)
        self._bytes = self._moved = (0, 0)
        self._clipped_steps = 0

    def _pick_route_device(self, wanted):
        """Where the all-to-alls run: None (gloo: host tensors straight into and out of the node's
        region) or a device staged through (NCCL: the GPU). `wanted` None: by the backend; "cpu"
        stages on the host with gloo (the tests' staged path); CUDA needs NCCL."""
        nccl = self.world_size > 1 and self.ranks.dist.get_backend(self.process_group) == "nccl"
        if wanted is None:
            return torch.device("cuda", torch.cuda.current_device()) if nccl else None
        device = torch.device(wanted)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if nccl != (device.type == "cuda") and self.world_size > 1:
            raise ValueError(f"MultiNodeMuonWithAuxAdam: route_device {device} with a "
                             f"{self.ranks.dist.get_backend(self.process_group)} process group "
                             "(NCCL moves CUDA tensors, gloo host tensors)")
        return device

    def _partition_buffer(self, elements):
        """A zeroed flat buffer of the job's dtype where this rank's partition is routed from."""
        return torch.zeros(elements, dtype=self.dtype, device=self._route_device or "cpu")

    def _route_forward(self, recv, part):
        """The forward all-to-all: this rank's pieces of `part` to the owners' local ranks, this
        rank's received pieces into `recv` (its node region's view): directly (host routing), or
        into a buffer on the route device and then copied into the region (NCCL)."""
        send = self._routing.gather_send(part)
        if self._route_device is None:
            self._all_to_all(recv, send, forward=True)
            return
        staged = torch.empty(recv.numel(), dtype=self.dtype, device=self._route_device)
        self._all_to_all(staged, send, forward=True)
        recv.copy_(staged)

    def _route_back(self, result):
        """The inverse all-to-all: `result` (this rank's results, in its node region) back to the
        ranks whose partitions they belong to; returns them in this rank's send order, on the
        route device."""
        r = self._routing
        device = self._route_device or "cpu"
        if self._route_device is not None:
            result = result.to(device)
        back = torch.empty(r.send_elements, dtype=self.dtype, device=device)
        self._all_to_all(back, result, forward=False)
        return back

    def _node_job_token(self, r):
        if self.token is not None:  # a restarted trainer: the jobs exist
            if isinstance(self.token, dict):
                return self.token[r.node]
            return self.token
        return self.client.create_job(r.node_spec(r.node, self.global_job_id),
                                      import_dir=self._import_dir)

    def _each_rank(self, fn):
        """Runs fn on every rank and returns every rank's result (all_gather_object); when it
        raises on any rank, every rank raises the same MuondError naming the first one."""
        result, error = None, None
        try:
            result = fn()
        except MuondError as e:
            error = (e.code, e.message, e.operation)
        except (ValueError, RuntimeError) as e:
            error = (CODES["UNKNOWN"], f"{type(e).__name__}: {e}", "multinode")
        gathered = [(result, error)]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            self.ranks.dist.all_gather_object(gathered, (result, error), group=self.process_group)
        for q, (_, err) in enumerate(gathered):
            if err is not None:
                code, message, operation = err
                raise MuondError(code, f"rank {q} (node {self._node_of(q)}): {message}",
                                 operation)
        return [res for res, _ in gathered]

    def _node_of(self, rank):
        return self._routing.node_of[rank] if self._routing is not None else "?"

    # ----- one step -----

    def _update_mode_step(self):
        # Over nodes the step is routed whole (no streaming, no delayed update: the routing's
        # all-to-alls and the two-phase commit run in step()).
        # The Muon gradients are reduced as one node's optimizer reduces them (a reduce-scatter:
        # the sum in rank order, then the mean), so both give the same bits.
        self._require_gradients(self._muon, "Muon")
        adam = self._adam_gradients()
        grads = [p.grad for _, p in self._muon]
        part = self._partition_buffer(self.partition.buffer_elements)
        if self.reduce_gradients and self.world_size > 1:
            world = self._partition_buffer(self.world_size * part.numel())
            fill_world_buffer(world, self.partitions, grads)
            reduce_scatter_partitions(world, part, self.process_group)
            part.mul_(1.0 / self.world_size)
        else:
            copy_into_buffer(part, self.partition, grads)
        self._install_muon(self._route_step(part, None))
        self._adam_step(adam)

    def _apply_mode_step(self, grad_divisor):
        self._require_gradients(self._job_tensors, "apply-mode")
        if self._upload_pending:
            self.upload_params()
        divisor = self._step_divisor(grad_divisor)
        grads = [p.grad for _, p in self._job_tensors]
        part = self._partition_buffer(self.partition.buffer_elements)
        if self.reduce_gradients and self.world_size > 1:
            divisor *= self.world_size  # summed over the ranks: muond takes the mean
            world = self._partition_buffer(self.world_size * part.numel())
            fill_world_buffer(world, self.partitions, grads)
            reduce_scatter_partitions(world, part, self.process_group)
        else:
            copy_into_buffer(part, self.partition, grads)
        groups = self.param_groups
        hyper = ([group_name(i) for i in range(len(groups))], [g["lr"] for g in groups],
                 [g["weight_decay"] for g in groups], divisor)
        new = self._route_step(part, hyper)
        params = [p for _, p in self._job_tensors]
        if self.world_size > 1:
            world = self._partition_buffer(self.world_size * part.numel())
            all_gather_partition_buffers(world, new, self.process_group)
            scatter_world_buffer(world, self.partitions, params)
        else:
            copy_from_buffer(new, self.partition, params)

    def upload_params(self):
        """Apply mode, a collective: every rank's partition of the parameters goes to the local
        ranks of the owner nodes (the forward all-to-all) and becomes the masters there."""
        part = self._partition_buffer(self.partition.buffer_elements)
        copy_into_buffer(part, self.partition, [p for _, p in self._job_tensors])
        s = self.session
        recv = s.init_view(self.dtype)[:s.buffer_elements] if s.is_shm else self._recv
        self._route_forward(recv, part)

        def upload():
            if s.is_shm:
                s.init_params_in_place()
            else:
                s.init_params_buffer(recv, float32=self.dtype == torch.float32)
        self._each_rank(upload)
        self._upload_pending = False

    def _all_to_all(self, out, inp, forward):
        r = self._routing
        ins, outs = (r.send_splits, r.recv_splits) if forward else (r.recv_splits, r.send_splits)
        scale = 2 if self.dtype == torch.bfloat16 else 1
        me, element = self.rank, out.element_size()
        sent, received = self._moved
        self._moved = (sent + element * (sum(ins) - ins[me]),
                       received + element * (sum(outs) - outs[me]))
        if self.world_size == 1:
            out.copy_(inp)
            return
        self.ranks.dist.all_to_all_single(_wire(out), _wire(inp), [n * scale for n in outs],
                                          [n * scale for n in ins], group=self.process_group)

    def _route_step(self, part, hyper):
        """Routes this rank's gradient partition (`part`, flat, partition layout) to the owners,
        runs the step on every node atomically and returns this rank's results in the same
        layout. A collective over the world."""
        step, s, r = self.step_id, self.session, self._routing
        self._moved = (0, 0)
        try:
            recv = s.gradient_view(step, self.dtype) if s.is_shm else self._recv
            self._route_forward(recv, part)
        except RuntimeError as e:
            self._lost(step, e)
        clips = hyper is not None and self._max_grad_norm > 0
        error = result = None
        node_sum = 0.0
        try:
            if hyper is not None:
                s.set_hyper(*hyper)
                if clips:
                    s.set_global_clip(1)  # speculate: clip 1, report the node's sum of squares
            result = self._node_step(step, recv)
            node_sum = s.last_step_sum_sq()
        except MuondError as e:
            error = e
        total = self._agree(step, error, hyper, node_sum if clips else None)
        if clips:
            result = self._clip_globally(step, hyper, recv, total, node_sum, result)
        self._commit_everywhere(step)
        try:
            back = self._route_back(result)
        except RuntimeError as e:  # committed everywhere already: only this rank's copy is lost
            raise MuondError(CODES["UNAVAILABLE"],
                             f"global job '{self.global_job_id}' step {step} committed on every "
                             f"node, but returning its results failed ({e}); reload the "
                             "checkpoint", "multinode") from e
        out = torch.zeros_like(part)
        r.scatter_back(back, out)
        self._bytes = self._moved
        return out

    def _node_step(self, step, recv):
        """Runs this rank's part of `step` on its node's daemon (prepared, not committed) and
        returns where its results are."""
        s = self.session
        if s.is_shm:
            s.step_in_place(step)
            return s.update_view(step, self.dtype)
        s.step_buffer(step, recv, self._result)
        return self._result

    def bytes_per_step(self):
        """(sent, received) bytes of this rank's two all-to-alls in the last step (gradients out,
        results back), as passed to all_to_all_single, without the pieces a rank routes to
        itself."""
        return self._bytes

    def expected_bytes(self):
        """The formula of the module comment from the plan: sent = received =
        e * ((P_r - S_r) + (Q_r - S_r)), P_r this rank's partition, Q_r the elements its node's
        daemon serves it, S_r the elements routed to itself."""
        e = torch.empty(0, dtype=self.dtype).element_size()
        r = self._routing
        both = e * (r.sent_elements_remote + r.recv_elements_remote)
        return (both, both)

    # ----- checkpoints -----

    def save_checkpoint(self):
        """Collective: every node's job saves a generation (its local rank 0); returns (and
        state_dict() then names) {"global_job_id", "next_step", "nodes": [...]}."""
        self.ranks.barrier()
        r = self._routing
        saved = self._each_rank(lambda: self.client.checkpoint_save(r.node_job_id, self.node_token)
                                if r.local_rank == 0 else None)
        nodes = [{"node": r.node_of[q], "job_id": f"{self.global_job_id}.node{r.node_of[q]}",
                  "generation": g, "step": st} for q, x in enumerate(saved) if x is not None
                 for g, st in [x]]
        self._checkpoint = {"job_id": self.global_job_id, "global_job_id": self.global_job_id,
                            "next_step": self.step_id, "nodes": nodes,
                            "generation": [n["generation"] for n in nodes],
                            "step": self.step_id}
        return dict(self._checkpoint)

    def load_checkpoint(self, generation=-1, step=-1):
        """Collective: every node loads the generation of the newest step that every node has
        (or of `step`); `generation` must be -1 (generations differ per node). Returns
        (generations by node, next_step)."""
        if generation != -1:
            raise ValueError("over several nodes a checkpoint is chosen by step (generations "
                             "differ per node); pass step= or nothing for the newest common one")
        r = self._routing
        if self.session is not None:
            self.session.close()
            self.session = None
        self._checkpoint = None
        self._upload_pending = False
        self.ranks.barrier()
        listed = self._each_rank(lambda: self._list_steps() if r.local_rank == 0 else None)
        common = set.intersection(*[set(x) for x in listed if x is not None])
        if step != -1:
            common &= {int(step)}
        if not common:
            raise MuondError(CODES["NOT_FOUND"],
                             f"global job '{self.global_job_id}': no checkpoint step "
                             f"{'' if step == -1 else str(step) + ' '}is on every node (steps "
                             f"by node: {[sorted(x) for x in listed if x is not None]})",
                             "load_checkpoint")
        chosen = max(common)
        loaded = self._each_rank(lambda: self.client.checkpoint_load(
            r.node_job_id, self.node_token, -1, chosen) if r.local_rank == 0 else None)
        self.ranks.barrier()
        self._each_rank(lambda: self._attach(False))
        gens = {r.node_of[q]: x[0] for q, x in enumerate(loaded) if x is not None}
        return gens, self.step_id

    def _list_steps(self):
        total = ctypes.c_size_t()
        fn = _native.function("muond_checkpoint_list")
        args = (self.client.handle, self._routing.node_job_id.encode(), self.node_token.encode())
        _native.check(fn(*args, None, None, 0, ctypes.byref(total)), "muond_checkpoint_list")
        n = total.value
        steps = (ctypes.c_int64 * max(n, 1))()
        _native.check(fn(*args, None, steps, n, ctypes.byref(total)), "muond_checkpoint_list")
        return [steps[i] for i in range(min(n, total.value))]

    def export_state(self, out_dir, step=-1):
        """Collective: every node's job writes its whole optimizer state (live; or its checkpoint
        generation at `step`) into `out_dir` (<node job>.safetensors + .manifest.json, written
        by the node's local rank 0). Returns (and state_dict() then names) {"global_job_id",
        "next_step", "export_dir", "nodes": [{"node", "job_id", "step"}]}."""
        self.ranks.barrier()
        r = self._routing
        steps = self._each_rank(lambda: self.client.export_state(
            r.node_job_id, self.node_token, out_dir, 0, step) if r.local_rank == 0 else None)
        nodes = [{"node": r.node_of[q], "job_id": f"{self.global_job_id}.node{r.node_of[q]}",
                  "step": st} for q, st in enumerate(steps) if st is not None]
        if len({n["step"] for n in nodes}) != 1:
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"global job '{self.global_job_id}': the nodes exported different "
                             f"steps {nodes}", "export_state")
        self._checkpoint = {"job_id": self.global_job_id, "global_job_id": self.global_job_id,
                            "next_step": nodes[0]["step"], "export_dir": str(out_dir),
                            "nodes": nodes, "step": nodes[0]["step"]}
        return dict(self._checkpoint)

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        muond = state_dict.pop("muond", None)
        state_dict.pop("step_id", None)
        if muond is not None and "export_dir" in muond:
            # Re-sharded: the node jobs took the daemon side from the export at creation.
            if muond["next_step"] != self.step_id:
                raise ValueError(f"the state_dict is of the export at step {muond['next_step']}; "
                                 f"global job '{self.global_job_id}' expects step {self.step_id}")
            self._install_torch_state(*self._staged_torch_state(state_dict))
            self._checkpoint = dict(muond)
            return self.step_id
        if muond is None or muond.get("global_job_id") != self.global_job_id:
            raise ValueError(f"this state_dict is not of multi-node job '{self.global_job_id}'")
        # torch's part is checked first and installed only once the node jobs loaded theirs: a
        # refused load leaves both as they were (checkpoints.py).
        staged = self._staged_torch_state(state_dict)
        _, next_step = self.load_checkpoint(step=muond["next_step"])
        self._install_torch_state(*staged)
        self._checkpoint = dict(muond)
        return next_step

    def close(self, delete_job=False):
        if self.session is not None:
            self.session.close()
            self.session = None
        if delete_job and self._routing is not None:
            self.ranks.barrier()
            if self._routing.local_rank == 0:
                self.client.delete_job(self._routing.node_job_id, self.node_token)
        if self.client is not None:
            self.client.close()
            self.client = None
