"""MuonWithAuxAdam's gradient stream (streaming.py's GradientStream on the attached session):
made on each attach, armed for the next step or held, the agreement to send a step whole when a
streamed gradient was edited, the DDP route and the accumulating() micro-batches. A collaborator
of the optimizer (optim.py); it receives the StepContext and JobLink (optim_job.py) and its
options explicitly.
"""
import warnings

import torch

from .streaming import GradientStream


class StreamControl:
    """The stream of one rank's attached session (None before the first attach and after close).

    enabled: stream=True (the hooks stream during backward; False: every step goes whole at
      step()); bucket_bytes: the bucket size. fallbacks: streamed steps sent whole because a
      gradient was edited (opt.stream_fallbacks). accumulating: the depth of accumulating()
      contexts. ddp_routed: the job tensors DDP's communication hook streams (stream_ddp).
    """

    def __init__(self, ctx, link, enabled, bucket_bytes):
        self.ctx, self.link = ctx, link
        self.enabled, self.bucket_bytes = enabled, bucket_bytes
        self.stream = None
        self.fallbacks = 0
        self.accumulating = 0
        self.ddp_routed = ()
        self._edit_warned = False

    def make(self, session, view, mean, zero_missing, on_first_post):
        """A new GradientStream on `session` (the old one's hooks removed): view(step) is where a
        step's gradients go; mean/zero_missing as GradientStream takes them; on_first_post is
        called before a step's first part leaves. Returns whether it streams (enabled)."""
        if self.stream is not None:
            self.stream.remove()
        ctx, link = self.ctx, self.link
        self.stream = GradientStream(session, link.partitions, ctx.rank,
                                     [p for _, p in ctx.job_tensors], ctx.ranks.group,
                                     ctx.ranks.dist, dtype=link.dtype,
                                     reduce=ctx.reduce_gradients, mean=mean,
                                     bucket_bytes=self.bucket_bytes, zero_missing=zero_missing)
        self.stream.set_buffer(view)
        self.stream.route(self.ddp_routed)
        self.stream.on_first_post = on_first_post
        if self.enabled:
            self.stream.install()
        return self.enabled

    def arm(self, step, held):
        """The next backward streams `step` unless `held` (a delayed or accumulating step, apply
        mode's pending upload, QK-Clip's maxima not yet set)."""
        st = self.stream
        if st is None or not self.enabled:
            return
        if held or self.accumulating:
            st.disarm()
        else:
            st.arm(step, shm=self.link.session.is_shm)

    def remove(self):
        if self.stream is not None:
            self.stream.remove()
            self.stream = None

    def abandon_failed(self, step):
        """After a failed step with parts out (e.g. a gradient missing at step()): the daemon
        drops them, and the retry streams afresh."""
        st = self.stream
        if st is not None and st.step == step and st._posted:
            st.abandon()

    def send_gradients(self, step, checked=False):
        """This rank's partition of the job tensors' gradients into the step's buffer (reduced
        over the ranks when asked), sent in parts as backward produced them when the stream was
        armed and every streamed gradient is still what left (checked: the caller made sure);
        returns True when the step went in parts (its last part posted)."""
        st = self.stream
        streamed = st.armed and st.step == step  # copied (shm: and posted) during backward
        parts = streamed and self.link.session.is_shm
        if streamed and not checked and self.edited():
            self.fall_back()
            streamed = parts = False
        if not streamed:
            st.arm(step, shm=False)
        try:
            st.finish()
        except BaseException:
            if parts:
                st.abandon()
            raise
        if parts:
            st.post_last()
        return parts

    def edited(self, also=False):
        """Whether a streamed step must be sent whole, on every rank alike (one all-reduce with a
        process group): a gradient streamed during backward was edited before step() on some
        rank (GradientStream.edited), or `also` (another reason of this rank's) holds. Counts
        the fallback and warns once per run naming the first edited tensor."""
        st, ctx = self.stream, self.ctx
        edited = st.edited()
        mine = bool(edited) or bool(also)
        agreed = ctx.ranks.count(mine) > 0 if ctx.world_size > 1 else mine
        if edited and not self._edit_warned:
            self._edit_warned = True
            self._warn_edited(ctx.names[ctx.job_tensors[edited[0]][1]], len(edited))
        if agreed:
            self.fallbacks += 1
        return agreed

    def _warn_edited(self, name, count):
        st = self.stream
        what = f"streaming from the DDP hook failed ({st.fault_error!r})" \
            if st.fault_error is not None else \
            (f"the gradient of {name!r} changed between backward and step() after it was "
             f"streamed to muond ({count} tensor(s) this step; e.g. clip_grad_norm_, "
             "an unscale, DistributedDataParallel's reduction, p.grad = ..., a second "
             "backward)")
        warnings.warn(
            f"muon_offload: {what}: the step is sent whole at step() instead, exact but not "
            "overlapped with backward; opt.stream_fallbacks counts such steps. To keep "
            "streaming, edit gradients through the optimizer's routes (README, \"Streaming "
            "and gradient edits\"): a DynamicLossScaler, max_grad_norm, "
            "opt.stream_ddp(ddp_model) under DistributedDataParallel, opt.accumulating() "
            "for earlier micro-batches",
            RuntimeWarning, stacklevel=6)

    def fall_back(self):
        """Every rank drops the parts it streamed of the armed step together (the daemon refuses
        that try, nothing of it commits) before any sends the step whole."""
        self.stream.abandon(everyone=True)
        self.ctx.ranks.barrier()

    def post_whole(self, step):
        """Sends the step's whole gradient buffer without waiting (delayed mode)."""
        s = self.link.session
        s.post_part(step, 0, s.raw_view("gradient", step).numel(), last=True)

    def route_ddp(self, ddp_model):
        """stream_ddp's routing (see MuonWithAuxAdam.stream_ddp): the hook on `ddp_model`."""
        mine = {id(p) for p in ddp_model.module.parameters()}
        self.ddp_routed = [i for i, (_, p) in enumerate(self.ctx.job_tensors) if id(p) in mine]
        ddp_model.register_comm_hook(ddp_model.process_group, self._ddp_comm_hook)
        if self.stream is not None:
            self.stream.route(self.ddp_routed)

    def _ddp_comm_hook(self, process_group, bucket):
        """DDP's default all-reduce hook, and the reduced bucket into the gradient stream."""
        group = process_group if process_group is not None else \
            torch.distributed.group.WORLD
        tensor = bucket.buffer()
        tensor.div_(group.size())
        params = bucket.parameters()
        stream = self.stream

        def reduced(fut):
            flat = fut.value()[0]
            if stream is not None:
                try:
                    stream.arrived_reduced(params, flat)
                except Exception as e:  # the step falls back; backward goes on
                    stream.fault(e)
            return flat
        return torch.distributed.all_reduce(tensor, group=group, async_op=True) \
            .get_future().then(reduced)
