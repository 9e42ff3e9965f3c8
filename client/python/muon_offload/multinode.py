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
Composition (optim.py's collaborators, the multi-node ones): NodeJobLink (multinode_link.py: the
plan, the node jobs, the attach), NodeRouter with RoutedUpdateStep / RoutedApplyStep
(multinode_route.py: the all-to-alls and the steps), TwoPhaseCommit (multinode_commit.py: the
agreement, commit, abort, global clipping) and NodeCheckpoints (multinode_checkpoints.py).
"""
from .multinode_checkpoints import NodeCheckpoints
from .multinode_commit import TwoPhaseCommit
from .multinode_link import NodeJobLink
from .multinode_route import NodeRouter, RoutedApplyStep, RoutedUpdateStep
from .optim import MuonWithAuxAdam
from .optim_update import AuxAdamW, MuonInstaller


class MultiNodeMuonWithAuxAdam(MuonWithAuxAdam):
    """MuonWithAuxAdam (same arguments and behaviour) over nodes; see the module comment.
    node_map: global rank -> node (None: from GROUP_RANK). Every rank passes its own node's
    daemon as `address`. token: for jobs that exist already (a restarted trainer), the
    node_tokens dict ({node: token}) of the optimizer that created them, with its job_id."""

    def __init__(self, param_groups, *, node_map=None, import_dir=None, route_device=None,
                 **kw):
        self._node_args = node_map, import_dir, route_device
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
        super().__init__(param_groups, **kw)

    # ----- the collaborators -----

    def _make_link(self, options):
        return NodeJobLink(self._ctx, options, *self._node_args)

    def _mode_step(self, options):
        if not self._offloaded:
            return super()._mode_step(options)
        ctx, link = self._ctx, self._job
        self._two_phase = TwoPhaseCommit(ctx, link, self._max_grad_norm)
        self._router = NodeRouter(ctx, link, self._two_phase)
        if options.mode == "apply":
            return RoutedApplyStep(ctx, link, self._streams, self._router, options.grad_divisor,
                                   options.loss_scaler)
        return RoutedUpdateStep(ctx, self._router, AuxAdamW(ctx), MuonInstaller(ctx, link))

    def _make_checkpoints(self, kind=NodeCheckpoints):
        return super()._make_checkpoints(kind)

    # ----- what users and tests read -----

    @property
    def global_job_id(self):
        return self._job.global_job_id

    @property
    def nodes(self):
        return self._job.nodes

    @property
    def node_tokens(self):
        """Every node's token ({node: token}): a restarted trainer passes them back as token=."""
        return self._job.node_tokens

    @property
    def node_token(self):
        return self._job.node_token

    @property
    def _routing(self):
        return self._job.routing

    @property
    def _route_device(self):
        return self._job.route_device

    def bytes_per_step(self):
        """(sent, received) bytes of this rank's two all-to-alls in the last step (gradients out,
        results back), as passed to all_to_all_single, without the pieces a rank routes to
        itself."""
        return self._router.bytes

    def expected_bytes(self):
        """The formula of the module comment from the plan: sent = received =
        e * ((P_r - S_r) + (Q_r - S_r)), P_r this rank's partition, Q_r the elements its node's
        daemon serves it, S_r the elements routed to itself."""
        return self._router.expected_bytes()

    def clipped_steps(self):
        """Steps that global clipping recomputed on every node (apply mode, max_grad_norm)."""
        return self._two_phase.clipped_steps

    # ----- checkpoints (multinode_checkpoints.py) -----

    def export_state(self, out_dir, step=-1, dtype="held"):
        """Collective: every node's job writes its whole optimizer state (live; or its checkpoint
        generation at `step`) into `out_dir` (<node job>.safetensors + .manifest.json, written
        by the node's local rank 0), each array as held or decoded (`dtype` "float32"). Returns (and state_dict() then names) {"global_job_id",
        "next_step", "export_dir", "nodes": [{"node", "job_id", "step"}]}."""
        return self._checkpoints.export_state(out_dir, step, dtype)
