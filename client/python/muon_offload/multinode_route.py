"""One step of a multi-node job (DESIGN.md 4c; the protocol and the bytes it moves are described
in multinode.py): the NodeRouter's all-to-alls between every rank's ZeRO partition and the node
jobs' span layouts, the node's part of the step run prepared and committed on every node
(TwoPhaseCommit, multinode_commit.py), and the two modes' steps over it (RoutedUpdateStep,
RoutedApplyStep), the ModeSteps (optim_job.py) of MultiNodeMuonWithAuxAdam. Each receives the
StepContext and NodeJobLink (multinode_link.py) explicitly.
"""
import torch

from ._native import CODES, MuondError
from .apply_mode import group_name
from .optim_apply import ApplyModeStep
from .optim_job import ModeStep
from .zero import (all_gather_partition_buffers, copy_from_buffer, copy_into_buffer,
                   fill_world_buffer, reduce_scatter_partitions, scatter_world_buffer)


def _wire(t):
    # gloo (torch 1.13) moves no bfloat16: bytes instead (split sizes scaled by the caller).
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


class NodeRouter:
    """Routes a rank's partition to the node jobs and back. ctx, link: see the module comment;
    commit: the TwoPhaseCommit. bytes: (sent, received) by the last step's two all-to-alls;
    recv, result: the flat buffers of a gRPC session (None over shared memory)."""

    def __init__(self, ctx, link, commit):
        self.ctx, self.link, self.commit = ctx, link, commit
        self.bytes = self._moved = (0, 0)
        self.recv = self.result = None

    def attached(self, session):
        if not session.is_shm:
            size = session.buffer_elements
            self.recv = torch.zeros(size, dtype=self.link.dtype)
            self.result = torch.zeros(size, dtype=self.link.dtype)

    def partition_buffer(self, elements):
        """A zeroed flat buffer of the job's dtype where this rank's partition is routed from."""
        return torch.zeros(elements, dtype=self.link.dtype, device=self.link.route_device or "cpu")

    def gradient_partition(self, pairs, mean):
        """This rank's partition of the gradients of `pairs`, reduced over the ranks when asked
        (a reduce-scatter: the sum in rank order, divided by the world size when `mean`, as one
        node's optimizer reduces them, so both give the same bits)."""
        ctx, link = self.ctx, self.link
        grads = [p.grad for _, p in pairs]
        part = self.partition_buffer(link.partition.buffer_elements)
        if ctx.reduce_gradients and ctx.world_size > 1:
            world = self.partition_buffer(ctx.world_size * part.numel())
            fill_world_buffer(world, link.partitions, grads)
            reduce_scatter_partitions(world, part, ctx.ranks.group)
            if mean:
                part.mul_(1.0 / ctx.world_size)
        else:
            copy_into_buffer(part, link.partition, grads)
        return part

    def route_forward(self, recv, part):
        """The forward all-to-all: this rank's pieces of `part` to the owners' local ranks, this
        rank's received pieces into `recv` (its node region's view): directly (host routing), or
        into a buffer on the route device and then copied into the region (NCCL)."""
        send = self.link.routing.gather_send(part)
        if self.link.route_device is None:
            self.all_to_all(recv, send, forward=True)
            return
        staged = torch.empty(recv.numel(), dtype=self.link.dtype, device=self.link.route_device)
        self.all_to_all(staged, send, forward=True)
        recv.copy_(staged)

    def route_back(self, result):
        """The inverse all-to-all: `result` (this rank's results, in its node region) back to the
        ranks whose partitions they belong to; returns them in this rank's send order, on the
        route device."""
        device = self.link.route_device or "cpu"
        if self.link.route_device is not None:
            result = result.to(device)
        back = torch.empty(self.link.routing.send_elements, dtype=self.link.dtype, device=device)
        self.all_to_all(back, result, forward=False)
        return back

    def all_to_all(self, out, inp, forward):
        r, ctx = self.link.routing, self.ctx
        ins, outs = (r.send_splits, r.recv_splits) if forward else (r.recv_splits, r.send_splits)
        scale = 2 if self.link.dtype == torch.bfloat16 else 1
        me, element = ctx.rank, out.element_size()
        sent, received = self._moved
        self._moved = (sent + element * (sum(ins) - ins[me]),
                       received + element * (sum(outs) - outs[me]))
        if ctx.world_size == 1:
            out.copy_(inp)
            return
        ctx.ranks.dist.all_to_all_single(_wire(out), _wire(inp), [n * scale for n in outs],
                                         [n * scale for n in ins], group=ctx.ranks.group)

    def route_step(self, part, hyper):
        """Routes this rank's gradient partition (`part`, flat, partition layout) to the owners,
        runs the step on every node atomically and returns this rank's results in the same
        layout. A collective over the world."""
        step, s, commit = self.ctx.step_id, self.link.session, self.commit
        self._moved = (0, 0)
        try:
            recv = s.gradient_view(step, self.link.dtype) if s.is_shm else self.recv
            self.route_forward(recv, part)
        except RuntimeError as e:
            commit.lost(step, e)
        clips = hyper is not None and commit.max_grad_norm > 0
        error = result = None
        node_sum = 0.0
        try:
            if hyper is not None:
                s.set_hyper(*hyper)
                if clips:
                    s.set_global_clip(1)  # speculate: clip 1, report the node's sum of squares
            result = self.node_step(step, recv)
            node_sum = s.last_step_sum_sq()
        except MuondError as e:
            error = e
        total = commit.agree(step, error, hyper, node_sum if clips else None)
        if clips:
            result = commit.clip_globally(step, hyper, total, node_sum, result,
                                          lambda: self.node_step(step, recv))
        commit.commit_everywhere(step)
        return self._results(step, part, result)

    def _results(self, step, part, result):
        """The committed step's results routed back into this rank's partition layout."""
        try:
            back = self.route_back(result)
        except RuntimeError as e:  # committed everywhere already: only this rank's copy is lost
            raise MuondError(CODES["UNAVAILABLE"],
                             f"global job '{self.link.global_job_id}' step {step} committed on "
                             f"every node, but returning its results failed ({e}); reload the "
                             "checkpoint", "multinode") from e
        out = torch.zeros_like(part)
        self.link.routing.scatter_back(back, out)
        self.bytes = self._moved
        return out

    def node_step(self, step, recv):
        """Runs this rank's part of `step` on its node's daemon (prepared, not committed) and
        returns where its results are."""
        s = self.link.session
        if s.is_shm:
            s.step_in_place(step)
            return s.update_view(step, self.link.dtype)
        s.step_buffer(step, recv, self.result)
        return self.result

    def expected_bytes(self):
        """The formula of multinode.py's module comment from the plan: sent = received =
        e * ((P_r - S_r) + (Q_r - S_r))."""
        e = torch.empty(0, dtype=self.link.dtype).element_size()
        r = self.link.routing
        both = e * (r.sent_elements_remote + r.recv_elements_remote)
        return (both, both)

    def upload_params(self):
        """Apply mode, a collective: every rank's partition of the parameters goes to the local
        ranks of the owner nodes (the forward all-to-all) and becomes the masters there."""
        link = self.link
        part = self.partition_buffer(link.partition.buffer_elements)
        copy_into_buffer(part, link.partition, [p for _, p in self.ctx.job_tensors])
        s = link.session
        recv = s.init_view(link.dtype)[:s.buffer_elements] if s.is_shm else self.recv
        self.route_forward(recv, part)

        def upload():
            if s.is_shm:
                s.init_params_in_place()
            else:
                s.init_params_buffer(recv, float32=link.dtype == torch.float32)
        link.each_rank(upload)


class RoutedUpdateStep(ModeStep):
    """Update mode over nodes: the step is routed whole (no streaming, no delayed update: the
    routing's all-to-alls and the two-phase commit run in step()). adamw, installer: the
    AuxAdamW and MuonInstaller (optim_update.py)."""

    def __init__(self, ctx, router, adamw, installer):
        self.ctx, self.router, self.adamw, self.installer = ctx, router, adamw, installer

    def attached(self, session):
        self.router.attached(session)

    def run(self, grad_divisor):
        ctx = self.ctx
        ctx.require_gradients(ctx.muon, "Muon")
        adam = self.adamw.gradients()
        part = self.router.gradient_partition(ctx.muon, mean=True)
        self.installer.install(self.router.route_step(part, None))
        self.adamw.step(adam)


class RoutedApplyStep(ApplyModeStep):
    """Apply mode over nodes: ApplyModeStep's hyperparameters (step_divisor, grad_divisor,
    loss_scaler, set_max_logits) with the step routed whole; no stream (streams holds none), no
    ParameterOffload."""

    def __init__(self, ctx, link, streams, router, grad_divisor, loss_scaler):
        super().__init__(ctx, link, streams, None, grad_divisor, loss_scaler, init_from=None)
        self.router = router

    def job_opened(self):
        # Node jobs imported from an export hold the masters.
        self.upload_pending = self.ctx.step_id == 0 and self.link.import_dir is None

    def attached(self, session):
        self.router.attached(session)

    def detached(self):
        pass

    def holds_stream(self):
        return False

    def run(self, grad_divisor):
        ctx, link = self.ctx, self.link
        ctx.require_gradients(ctx.job_tensors, "apply-mode")
        if self.upload_pending:
            self.upload_params()
        divisor = self.step_divisor(grad_divisor)
        if ctx.reduce_gradients and ctx.world_size > 1:
            divisor *= ctx.world_size  # summed over the ranks: muond takes the mean
        part = self.router.gradient_partition(ctx.job_tensors, mean=False)
        groups = ctx.groups()
        hyper = ([group_name(i) for i in range(len(groups))], [g["lr"] for g in groups],
                 [g["weight_decay"] for g in groups], divisor)
        new = self.router.route_step(part, hyper)
        params = [p for _, p in ctx.job_tensors]
        if ctx.world_size > 1:
            world = self.router.partition_buffer(ctx.world_size * part.numel())
            all_gather_partition_buffers(world, new, ctx.ranks.group)
            scatter_world_buffer(world, link.partitions, params)
        else:
            copy_from_buffer(new, link.partition, params)

    def upload_params(self):
        self.router.upload_params()
        self.upload_pending = False
