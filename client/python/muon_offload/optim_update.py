"""MuonWithAuxAdam's update mode (the default; the optimizer and its module comment are in
optim.py): muond returns the orthogonalized update U of this rank's partition of the Muon
matrices and the trainer applies W <- W * (1 - lr * weight_decay) - lr * U, then all-gathers the
new weights; AdamW runs here for the other parameters, clipped by the step's whole gradient norm
with max_grad_norm. LocalStep is backend="local": the same math in this process.

Collaborators of the optimizer, built once at its construction: each receives the StepContext
and JobLink (optim_job.py) and the stream and delayed-update parts it uses.
"""
import math

import torch

from . import reference
from .optim_job import ModeStep
from .streaming import EarlyResults
from .zero import all_gather_partitions, all_reduce_mean, copy_into_buffer


def apply_update(weight, update, lr, weight_decay):
    """W <- W * (1 - lr * wd) - lr * U, as separate roundings (no fused multiply-add) so that a
    partition's elements and the whole matrix's get the same bits."""
    if weight_decay:
        weight.mul_(1.0 - lr * weight_decay)
    weight.sub_(torch.mul(update, lr))


class AuxAdamW:
    """AdamW over the context's AdamW parameters, its state in the optimizer's (torch_state())."""

    def __init__(self, ctx):
        self.ctx = ctx

    def gradients(self):
        """The AdamW parameters' gradients, averaged over the ranks (new tensors; p.grad stays
        untouched, so a failed step can be retried). None: skipped, as torch.optim.AdamW does."""
        ctx = self.ctx
        adam = [p.grad for _, p in ctx.adam]
        if not (ctx.reduce_gradients and ctx.world_size > 1):
            return adam
        present = [g for g in adam if g is not None]
        reduced = {id(g): r for g, r in zip(present, all_reduce_mean(present, ctx.ranks.group))}
        return [None if g is None else reduced[id(g)] for g in adam]

    @torch.no_grad()
    def step(self, grads, hyper=None):
        """hyper: (lr, weight_decay) per AdamW parameter (delayed mode: its step's); None: the
        groups' now."""
        state_of = self.ctx.torch_state()
        for j, ((g, p), grad) in enumerate(zip(self.ctx.adam, grads)):
            if grad is None:
                continue
            state = state_of[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            beta1, beta2 = g["betas"]
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].lerp_(grad.square(), 1 - beta2)
            m = state["exp_avg"] / (1 - beta1 ** state["step"])
            v = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
            lr, wd = (g["lr"], g["weight_decay"]) if hyper is None else hyper[j]
            apply_update(p, m / (v.sqrt() + g["eps"]), lr, wd)


class GradientClip:
    """Update mode's max_grad_norm (`norm`, 0: off): the step's coefficient from the whole sum
    of squares (muond's, or the local backend's), and the AdamW share that goes to muond."""

    def __init__(self, ctx, link, norm):
        self.ctx, self.link, self.norm = ctx, link, norm

    def outside_share(self, adam):
        """The AdamW gradients' share of the norm goes with the step's last part. Every rank holds
        the same (reduced) AdamW gradients, so rank 0 counts them and the others send 0."""
        if self.norm > 0:
            share = reference.sum_of_squares(adam) if self.ctx.rank == 0 else 0.0
            self.link.require_session().set_outside_sum_sq(share)

    def clipped(self, grads, sum_sq=None):
        """`grads` multiplied by the step's clip coefficient (new tensors; p.grad stays as it is,
        so a failed step can be retried), from the whole raw sum of squares muond returned
        (sum_sq: the local backend's). Sets ctx.last_grad_norm."""
        if self.norm <= 0:
            return grads
        if sum_sq is None:
            sum_sq = self.link.session.last_step_sum_sq()
        self.ctx.last_grad_norm = math.sqrt(sum_sq)
        coef = reference.clip_coefficient(sum_sq, self.norm)
        if coef >= 1.0:
            return grads
        return [None if g is None else g * torch.tensor(coef, dtype=g.dtype, device=g.device)
                for g in grads]


class LocalStep(ModeStep):
    """backend="local" (and update mode without Muon matrices): the Muon math in this process
    (fp32, muon_offload.reference), the momentum in the optimizer's state."""

    def __init__(self, ctx, muon_config, adamw, clip):
        self.ctx, self.config, self.adamw, self.clip = ctx, muon_config, adamw, clip

    def run(self, grad_divisor):
        muon_grads, adam_grads = self._gradients()
        if self.clip.norm > 0:  # muond's clipping, in-process
            total = reference.sum_of_squares(list(muon_grads) + list(adam_grads))
            muon_grads = self.clip.clipped(muon_grads, total)
            adam_grads = self.clip.clipped(adam_grads, total)
        if self.ctx.muon:
            self._muon_step(muon_grads)
        self.adamw.step(adam_grads)

    def _gradients(self):
        """Averaged gradients of (muon, adam) parameters, without changing p.grad."""
        ctx = self.ctx
        ctx.require_gradients(ctx.muon, "Muon")
        muon = [p.grad for _, p in ctx.muon]
        adam = [p.grad for _, p in ctx.adam]  # None: skipped, as torch.optim.AdamW does
        if not (ctx.reduce_gradients and ctx.world_size > 1):
            return muon, adam
        # p.grad stays untouched, so a failed step can be retried.
        present = [g for g in muon + adam if g is not None]
        reduced = {id(g): r for g, r in zip(present, all_reduce_mean(present, ctx.ranks.group))}
        return ([reduced[id(g)] for g in muon],
                [None if g is None else reduced[id(g)] for g in adam])

    @torch.no_grad()
    def _muon_step(self, grads):
        cfg, state_of = self.config, self.ctx.torch_state()
        updates = []
        for (g, p), grad in zip(self.ctx.muon, grads):
            state = state_of[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32)
            updates.append(reference.muon_update(
                grad, state["momentum_buffer"], cfg["momentum"], cfg["nesterov"],
                cfg["ns_method"], cfg["ns_steps"], cfg["scale_mode"], g["num_heads"]))
        for (g, p), u in zip(self.ctx.muon, updates):
            apply_update(p, u, g["lr"], g["weight_decay"])


class UpdateModeStep(ModeStep):
    """Update mode through muond: ctx and link (optim_job.py), streams (StreamControl), delayed
    (DelayedUpdates), adamw (AuxAdamW), clip (GradientClip)."""

    def __init__(self, ctx, link, streams, delayed, adamw, clip):
        self.ctx, self.link, self.streams, self.delayed = ctx, link, streams, delayed
        self.adamw, self.clip = adamw, clip
        self.installer = MuonInstaller(ctx, link)
        self.predicted_params = [p for _, p in ctx.job_tensors] + [p for _, p in ctx.adam]
        self._grad_buffers = self._update_buffers = None  # gRPC: the flat buffers

    def attached(self, session):
        if session.is_shm:
            self._grad_buffers = self._update_buffers = None
            view = (lambda t: session.gradient_view(t, self.link.dtype))
        else:
            n = self.link.partition.buffer_elements
            self._grad_buffers = torch.zeros(n, dtype=self.link.dtype)
            self._update_buffers = torch.zeros(n, dtype=self.link.dtype)
            view = (lambda t: self._grad_buffers)
        return view, True, False, None

    def run(self, grad_divisor):
        ctx = self.ctx
        ctx.require_gradients(ctx.muon, "Muon")
        adam = self.adamw.gradients()
        self.clip.outside_share(adam)
        step = ctx.step_id
        if self.delayed.active():
            self._send_delayed(step, adam)
            return
        update, early = self._muond_updates(step)
        if self.link.session.last_step_skipped:  # every rank was told so; AdamW skips it too
            ctx.last_step_skipped = True
            return
        self.installer.install(update, early)
        self.adamw.step(self.clip.clipped(adam))

    def _send_delayed(self, step, adam):
        """delay=1: installs the step in flight, sends this one whole and returns."""
        self.delayed.install_in_flight()
        st = self.streams.stream
        st.arm(step, shm=False)
        st.finish()
        self.streams.post_whole(step)
        hyper = [(g["lr"], g["weight_decay"]) for g, _ in self.ctx.muon]
        grads = [None if g is None else g.clone() for g in adam]
        adam_hyper = [(g["lr"], g["weight_decay"]) for g, _ in self.ctx.adam]

        def install(session):
            self.installer.install(session.update_view(step, self.link.dtype), hyper=hyper)
            self.adamw.step(self.clip.clipped(grads), adam_hyper)
        self.delayed.sent(step, install)

    def _muond_updates(self, step):
        """Sends this rank's partition of the Muon gradients and waits; returns (update view,
        EarlyResults or None): with one rank and a streamed step the updates were applied to
        the parameters span by span already."""
        s, dtype = self.link.require_session(), self.link.dtype
        parts = self.streams.send_gradients(step)
        if parts and self.ctx.world_size == 1:
            early = EarlyResults(s, step, self.link.partition.spans,
                                 self.installer.span_user(s.update_view(step, dtype)))
            early.run()
            return s.update_view(step, dtype), early
        if parts:
            s.wait_parts(step)
        elif s.is_shm:
            s.step_in_place(step)
        else:
            s.step_buffer(step, self._grad_buffers, self._update_buffers)
            return self._update_buffers, None
        return s.update_view(step, dtype), None


class MuonInstaller:
    """Puts this rank's partition of an update into the Muon matrices (W <- W * (1 - lr * wd) -
    lr * U, span by span), then all-gathers every rank's. ctx, link: optim_job.py."""

    def __init__(self, ctx, link):
        self.ctx, self.link = ctx, link

    def span_user(self, update, hyper=None):
        """use(k, keep): applies span k of `update` (the rank's flat update buffer) to its
        parameters with its group's lr and weight decay (hyper: per Muon matrix, a delayed step's
        own); with keep, returns (view, old values) to restore."""
        params = [p for _, p in self.ctx.muon]
        groups = [g for g, _ in self.ctx.muon]
        spans = self.link.partition.spans

        def use(k, keep):
            matrix, offset, length, rank_offset = spans[k]
            g = groups[matrix]
            lr, wd = (g["lr"], g["weight_decay"]) if hyper is None else hyper[matrix]
            view = params[matrix].view(-1)[offset:offset + length]
            old = view.clone() if keep else None
            apply_update(view, update[rank_offset:rank_offset + length], lr, wd)
            return (view, old) if keep else None
        return use

    @torch.no_grad()
    def install(self, update, early=None, hyper=None):
        """This rank's partition of `update` into the parameters (unless `early` applied it
        already), then the all-gather of every rank's."""
        ctx, link = self.ctx, self.link
        params = [p for _, p in ctx.muon]
        if early is None:
            use = self.span_user(update, hyper)
            for k in range(len(link.partition.spans)):
                use(k, False)
        if ctx.world_size > 1:
            mine = torch.zeros(link.partition.buffer_elements, dtype=link.dtype)
            copy_into_buffer(mine, link.partition, params)
            all_gather_partitions(mine, link.partitions, ctx.rank, params, ctx.ranks.group)
