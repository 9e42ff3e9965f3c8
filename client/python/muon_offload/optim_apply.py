"""MuonWithAuxAdam's apply mode (DESIGN.md 4b; the optimizer and its module comment are in
optim.py): a step's hyperparameters, presence mask and QK-Clip maxima, the step itself through the
ParameterOffload (streamed in parts, or whole), the weights' upload and the export. A collaborator
of the optimizer, built once at its construction: it receives the StepContext and JobLink
(optim_job.py), the stream and delayed-update parts and its options explicitly.
"""
import torch

from ._native import CODES, MuondError
from .apply_mode import ParameterOffload, group_name
from .optim_job import ModeStep
from .qk_clip import flatten_max_logits as qk_flatten_max_logits
from .streaming import EarlyResults


class ApplyModeStep(ModeStep):
    """Apply mode through muond. grad_divisor: the default divisor of the gradients (the
    optimizer's grad_divisor attribute, which it keeps here); loss_scaler: a DynamicLossScaler
    or None; init_from: muond reads the initial weights from there (None: the ranks upload
    theirs); upload_pending: the ranks upload the weights at the next step (a new job without
    init_from). offload: the ParameterOffload of the attached session (None when detached)."""

    def __init__(self, ctx, link, streams, delayed, grad_divisor, loss_scaler, init_from):
        self.ctx, self.link, self.streams, self.delayed = ctx, link, streams, delayed
        self.grad_divisor, self.loss_scaler = grad_divisor, loss_scaler
        self.init_from = init_from
        self.upload_pending = False
        self.predicted_params = [p for _, p in ctx.job_tensors]
        self.offload = None
        # The last step's presence mask, what a part sent during backward carries.
        self._absent_guess = ()
        # Streamed steps: the hyperparameters the first part carried, and step()'s.
        self._sent_hyper = self._step_hyper = None
        # QK-Clip (qk_clip.py): the next step's per-head maxima (set_max_logits) and what the
        # step's first part carried.
        self._max_logits = self._sent_max_logits = None
        # rearm(): the optimizer arms the stream for its next step, with every reason to hold it
        # (after an upload, and when maxima arrive); set by the optimizer.
        self.rearm = None

    # ----- the session -----

    def attached(self, session):
        if self.offload is not None:
            self.offload.close()
        ctx, link = self.ctx, self.link
        self.offload = ParameterOffload(session, link.partitions, ctx.rank,
                                        [p for _, p in ctx.job_tensors], ctx.ranks.group,
                                        ctx.ranks.dist, ctx.reduce_gradients)
        offload = self.offload
        if session.is_shm:
            def view(t):
                return offload._pinned(session.gradient_view(t, link.dtype))
        else:
            def view(t):
                return offload._host_grads
        return view, False, True, self._send_hyper

    def detached(self):
        if self.offload is not None:
            self.offload.close()
            self.offload = None

    def on_arm(self):
        self._sent_hyper = None

    def holds_stream(self):
        # Nothing streams before the initial weights are in (step() uploads them); QK-Clip: a
        # step's first part carries its max logits, so it streams only once they are set.
        return self.upload_pending or bool(self.link.qk_order and self._max_logits is None)

    def step_done(self):
        self._max_logits = self._sent_max_logits = None  # each step carries its own

    def job_opened(self):
        # A job that starts at step 0 takes the weights of the trainer (unless muond reads them
        # from init_from); a later step means muond holds them already (a restarted trainer).
        self.upload_pending = self.init_from is None and self.ctx.step_id == 0

    def job_replaced(self, fresh):
        # The imported state holds the master weights; a fresh job takes the trainer's.
        self.upload_pending = fresh and "init_from" not in self.link.spec

    # ----- hyperparameters -----

    def step_divisor(self, grad_divisor=None):
        """The divisor of a step's gradients: step(grad_divisor=...), else the loss scaler's
        scale (what the loss being backpropagated was scaled by, also while backward streams),
        else the grad_divisor attribute."""
        if grad_divisor is None and self.loss_scaler is not None:
            grad_divisor = self.loss_scaler.scale
        return self.grad_divisor if grad_divisor is None else float(grad_divisor)

    def _hyper(self, grad_divisor=None, absent=None):
        """(groups, lr, weight_decay, divisor, absent) of Session.set_hyper. absent: the
        presence mask (default: the last step's, a guess made during backward)."""
        ctx = self.ctx
        divisor = self.step_divisor(grad_divisor)
        if ctx.reduce_gradients and ctx.world_size > 1:
            divisor *= ctx.world_size  # the ranks' gradients are summed: muond takes the mean
        groups = ctx.groups()
        return ([group_name(i) for i in range(len(groups))], [g["lr"] for g in groups],
                [g["weight_decay"] for g in groups], divisor,
                self._absent_guess if absent is None else absent)

    def _absent_tensors(self):
        """The job tensors (indices) whose p.grad is None on every rank this step (a collective
        with a process group). muond skips them as torch.optim.AdamW skips such a parameter;
        one absent on some ranks only is zeros there, as a reduce takes it."""
        ctx = self.ctx
        present = [p.grad is not None for _, p in ctx.job_tensors]
        counts = ctx.ranks.counts(present) if ctx.world_size > 1 else present
        return tuple(i for i, c in enumerate(counts) if not c)

    def _grads_or_zeros(self):
        return [torch.zeros_like(p) if p.grad is None else p.grad
                for _, p in self.ctx.job_tensors]

    def _send_hyper(self):
        """Before a streamed step's first part: its hyperparameters as they are now (during
        backward), or step()'s when the first part leaves in step()."""
        self._sent_hyper = self._step_hyper or self._hyper()
        self.offload.session.set_hyper(*self._sent_hyper)
        if self.link.qk_order:
            self._sent_max_logits = self._max_logits
            self.offload.session.set_max_logits(self._max_logits)

    def set_max_logits(self, max_logits):
        """QK-Clip (see MuonWithAuxAdam.set_max_logits)."""
        if not self.link.qk_order:
            raise ValueError("set_max_logits: the optimizer has no qk_clip pairs")
        self._max_logits = qk_flatten_max_logits(self.link.qk_order, self.ctx.names, max_logits)
        if self.streams.stream is not None and not self.streams.stream.armed:
            self.rearm()

    # ----- the step -----

    def run(self, grad_divisor):
        ctx, link = self.ctx, self.link
        if self.offload is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], f"job '{link.job_id}' rank "
                             f"{ctx.rank}: not attached (closed, or a checkpoint load failed)",
                             "step")
        absent = self._absent_tensors()
        self._absent_guess = absent
        st, s, step = self.streams.stream, self.offload.session, ctx.step_id
        if self.upload_pending:
            if st.armed and st._posted:
                st.abandon()  # parts of a step the daemon cannot run yet
            st.disarm()  # the upload goes through gradient buffer 0
            self.upload_params()
            self.rearm()
        hyper = self._hyper(grad_divisor, absent)
        if link.qk_order:
            if self._max_logits is None:
                raise ValueError("the job has qk_clip pairs: pass step(max_logits={q parameter: "
                                 "per-head maxima}) or call set_max_logits() after the forward")
            s.set_max_logits(self._max_logits)
        streamed = st.armed and st.step == step and s.is_shm
        # lr, the divisor, the presence mask or the max logits changed after the first part
        # left, or a streamed gradient was edited after it left: every rank drops its parts and
        # sends the step whole (one agreement over the ranks for both reasons).
        if streamed and self.streams.edited(
                also=self._sent_hyper not in (None, hyper) or
                self._sent_max_logits not in (None, self._max_logits)):
            self.streams.fall_back()
            streamed = False
        if self.delayed.active():
            self._send_delayed(step, hyper)
            return
        self._step_now(step, hyper, streamed)

    def _send_delayed(self, step, hyper):
        """delay=1: installs the step in flight, sends this one whole and returns."""
        s, offload, dtype = self.offload.session, self.offload, self.link.dtype
        self.delayed.install_in_flight()
        s.set_hyper(*hyper)
        offload._reduce_gradients(self._grads_or_zeros(),
                                  offload._pinned(s.gradient_view(step, dtype)))
        self.streams.post_whole(step)

        def install(session):
            offload.pull_params(offload._pinned(session.update_view(step, dtype),
                                                read_only=True))
        self.delayed.sent(step, install)

    def _step_now(self, step, hyper, streamed):
        ctx, st, s = self.ctx, self.streams.stream, self.offload.session
        error = new_params = early = None
        skipped = False
        try:
            if streamed:
                self._step_hyper = hyper
                try:
                    self.streams.send_gradients(step, checked=True)
                finally:
                    self._step_hyper = None
                new_params = self.offload._pinned(s.update_view(step, self.link.dtype),
                                                  read_only=True)
                if ctx.world_size == 1:
                    early = EarlyResults(s, step, self.link.partition.spans,
                                         self._span_user(new_params))
                    early.run()
                else:
                    s.wait_parts(step)
            else:
                st.disarm()
                new_params = self.offload.push_step(step, self._grads_or_zeros(), hyper)
            skipped = s.last_step_skipped
        except MuondError as e:
            error = e
        ctx.ranks.raise_if_any_failed(error)
        if skipped:  # every rank was told so: none takes part in the all-gather
            ctx.last_step_skipped = True
            return
        if early is None:
            self.offload.pull_params(new_params)
        else:
            self.offload._sync()

    def _span_user(self, new_params):
        params = [p for _, p in self.ctx.job_tensors]
        spans = self.link.partition.spans

        def use(k, keep):
            matrix, offset, length, rank_offset = spans[k]
            view = params[matrix].view(-1)[offset:offset + length]
            old = view.clone() if keep else None
            view.copy_(new_params[rank_offset:rank_offset + length])
            return (view, old) if keep else None
        return use

    def upload_params(self):
        """A collective: every rank uploads its partition of the parameters as its part of
        muond's master weights."""
        if self.offload is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], "no apply-mode muond job attached",
                             "upload_params")
        self.ctx.ranks.all_ranks(self.offload.upload_params)
        self.upload_pending = False
