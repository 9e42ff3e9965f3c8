"""MuonWithAuxAdam's apply mode (DESIGN.md 4b; the optimizer and its module comment are in
optim.py): a step's hyperparameters, presence mask and QK-Clip maxima, the step itself through the
ParameterOffload (streamed in parts, or whole), the weights' upload and the export. A mixin of
MuonWithAuxAdam: it works on the optimizer's own attributes (offload, session, ranks, partition,
the gradient stream).
"""
import torch

from ._native import CODES, MuondError
from .apply_mode import group_name
from .qk_clip import flatten_max_logits as qk_flatten_max_logits
from .streaming import EarlyResults


class ApplyModeSteps:
    """The apply-mode half of MuonWithAuxAdam's step (see the module comment)."""

    def _step_divisor(self, grad_divisor=None):
        """The divisor of a step's gradients: step(grad_divisor=...), else the loss scaler's
        scale (what the loss being backpropagated was scaled by, also while backward streams),
        else the grad_divisor attribute."""
        if grad_divisor is None and self.loss_scaler is not None:
            grad_divisor = self.loss_scaler.scale
        return self.grad_divisor if grad_divisor is None else float(grad_divisor)

    def _apply_hyper(self, grad_divisor=None, absent=None):
        """(groups, lr, weight_decay, divisor, absent) of Session.set_hyper. absent: the
        presence mask (default: the last step's, a guess made during backward)."""
        divisor = self._step_divisor(grad_divisor)
        if self.reduce_gradients and self.world_size > 1:
            divisor *= self.world_size  # the ranks' gradients are summed: muond takes the mean
        groups = self.param_groups
        return ([group_name(i) for i in range(len(groups))], [g["lr"] for g in groups],
                [g["weight_decay"] for g in groups], divisor,
                self._absent_guess if absent is None else absent)

    def _absent_tensors(self):
        """Apply mode: the job tensors (indices) whose p.grad is None on every rank this step (a
        collective with a process group). muond skips them as torch.optim.AdamW skips such a
        parameter; one absent on some ranks only is zeros there, as a reduce takes it."""
        present = [p.grad is not None for _, p in self._job_tensors]
        counts = self.ranks.counts(present) if self.world_size > 1 else present
        return tuple(i for i, c in enumerate(counts) if not c)

    def _grads_or_zeros(self):
        return [torch.zeros_like(p) if p.grad is None else p.grad for _, p in self._job_tensors]

    def _send_hyper(self):
        """Apply mode, before a streamed step's first part: its hyperparameters as they are now
        (during backward), or step()'s when the first part leaves in step()."""
        self._sent_hyper = self._step_hyper or self._apply_hyper()
        self.offload.session.set_hyper(*self._sent_hyper)
        if self._qk_order:
            self._sent_max_logits = self._max_logits
            self.offload.session.set_max_logits(self._max_logits)

    def set_max_logits(self, max_logits):
        """QK-Clip (qk_clip=...): this rank's largest attention logit of each query head in the
        coming step's forward, {q parameter (or name): H values}; muond takes the maximum over
        the ranks. Called after the forward, it lets the backward stream the step; step()'s
        max_logits argument does the same later. ValueError naming the pair for missing, extra
        or non-finite values."""
        if not self._qk_order:
            raise ValueError("set_max_logits: the optimizer has no qk_clip pairs")
        self._max_logits = qk_flatten_max_logits(self._qk_order, self._names, max_logits)
        if self._stream is not None and not self._stream.armed:
            self._arm()

    def _apply_mode_step(self, grad_divisor):
        if self.offload is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], f"job '{self.job_id}' rank "
                             f"{self.rank}: not attached (closed, or a checkpoint load failed)",
                             "step")
        absent = self._absent_tensors()
        self._absent_guess = absent
        if self._upload_pending:
            if self._stream.armed and self._stream._posted:
                self._stream.abandon()  # parts of a step the daemon cannot run yet
            self._stream.disarm()  # the upload goes through gradient buffer 0
            self.upload_params()
        hyper = self._apply_hyper(grad_divisor, absent)
        st, s, step = self._stream, self.offload.session, self.step_id
        if self._qk_order:
            if self._max_logits is None:
                raise ValueError("the job has qk_clip pairs: pass step(max_logits={q parameter: "
                                 "per-head maxima}) or call set_max_logits() after the forward")
            s.set_max_logits(self._max_logits)
        streamed = st.armed and st.step == step and s.is_shm
        # lr, the divisor, the presence mask or the max logits changed after the first part
        # left, or a streamed gradient was edited after it left: every rank drops its parts and
        # sends the step whole (one agreement over the ranks for both reasons).
        if streamed and self._stream_edited(
                st, also=self._sent_hyper not in (None, hyper) or
                self._sent_max_logits not in (None, self._max_logits)):
            self._fall_back(st)
            streamed = False
        if self._delayed():
            self._install_in_flight()
            s.set_hyper(*hyper)
            self.offload._reduce_gradients(self._grads_or_zeros(),
                                           self.offload._pinned(s.gradient_view(step, self.dtype)))
            self._post_whole(step)
            self._in_flight = step
            return
        error = new_params = early = None
        skipped = False
        try:
            if streamed:
                self._step_hyper = hyper
                try:
                    self._send_gradients(step, checked=True)
                finally:
                    self._step_hyper = None
                new_params = self.offload._pinned(s.update_view(step, self.dtype), read_only=True)
                if self.world_size == 1:
                    early = EarlyResults(s, step, self.partition.spans,
                                         self._param_span_user(new_params))
                    early.run()
                else:
                    s.wait_parts(step)
            else:
                st.disarm()
                new_params = self.offload.push_step(step, self._grads_or_zeros(), hyper)
            skipped = s.last_step_skipped
        except MuondError as e:
            error = e
        self.ranks.raise_if_any_failed(error)
        if skipped:  # every rank was told so: none takes part in the all-gather
            self.last_step_skipped = True
            return
        if early is None:
            self.offload.pull_params(new_params)
        else:
            self.offload._sync()

    def _param_span_user(self, new_params):
        params = [p for _, p in self._job_tensors]

        def use(k, keep):
            matrix, offset, length, rank_offset = self.partition.spans[k]
            view = params[matrix].view(-1)[offset:offset + length]
            old = view.clone() if keep else None
            view.copy_(new_params[rank_offset:rank_offset + length])
            return (view, old) if keep else None
        return use

    def upload_params(self):
        """Apply mode, a collective: every rank uploads its partition of the parameters as its
        part of muond's master weights. step() does it before the first step of a new job; call
        it to replace the masters between steps."""
        if self.offload is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], "no apply-mode muond job attached",
                             "upload_params")
        self.ranks.all_ranks(self.offload.upload_params)
        self._upload_pending = False
        self._arm()

    def export(self, path, dtype="float32"):
        """Apply mode, a collective: muond writes the master weights, every tensor in full shape
        under its parameter name, to `path` (a safetensors file on the daemon's host) in
        `dtype`."""
        self.drain()
        self.ranks.barrier()
        self.ranks.on_rank0(lambda: self.client.export(self.job_id, self.token, path, dtype))
