"""MuonWithAuxAdam's delayed parameter update (delay=1, DESIGN.md 4d; the optimizer and its
module comment are in optim.py): the step in flight, installed when the next one comes, weight
prediction, and drain(). A collaborator of the optimizer: it receives the StepContext and JobLink
(optim_job.py), the parameters prediction moves and its options; the mode step hands it each
delayed step with the function that installs the step's results.
"""
import torch

from ._native import MuondError


class DelayedUpdates:
    """delay: 1 runs delayed steps once warmup committed steps were taken (0: never); predict:
    weight prediction. in_flight: the step sent and not yet installed (None: none); steps_taken:
    committed steps (delay_warmup counts them); true: with a prediction installed, the
    parameters without it (what the update applies to)."""

    def __init__(self, ctx, link, delay, warmup, predict):
        self.ctx, self.link = ctx, link
        self.params = ()  # what prediction moves: the mode step's predicted_params
        self.delay, self.warmup, self.predict = delay, warmup, predict
        self.in_flight = None
        self.steps_taken = 0
        self.true = None
        self._install = None

    def due(self):
        """Whether the next step is delayed (before knowing the transport: the stream stays
        disarmed for it)."""
        return bool(self.delay) and self.steps_taken >= self.warmup

    def active(self):
        """Whether this step is sent delayed (delay=1 after the warm-up, shared memory)."""
        return self.delay == 1 and self.steps_taken >= self.warmup and \
            self.link.require_session().is_shm

    def sent(self, step, install):
        """`step` went out whole; install(session) puts its results into the parameters."""
        self.in_flight, self._install = step, install

    def install_in_flight(self, draining=False):
        """Waits for the step in flight and installs its results (a collective with several
        ranks). A failed delayed step raises here, with nothing of it installed; its step id is
        the next step's again. With predict, the parameters the next forward sees are the
        installed ones plus the update just installed (the step in flight's expected update);
        draining installs without it."""
        if self.in_flight is None:
            if draining:
                self.drop_prediction()
            return
        step, self.in_flight = self.in_flight, None
        session, ctx = self.link.session, self.ctx
        error = None
        try:
            session.wait_parts(step)
        except MuondError as e:
            error = e
        try:
            ctx.ranks.raise_if_any_failed(error)
        except MuondError:
            ctx.step_id = step
            raise
        if session.last_step_skipped:
            # Nothing to install: the parameters the step applied to stay (without prediction).
            ctx.last_step_skipped = True
            self.drop_prediction()
            return
        self._install_predicted(session, self.predict and not draining)

    def _install_predicted(self, session, predict):
        if self.true is not None:
            for p, t in zip(self.params, self.true):
                p.copy_(t)  # the parameters without the prediction, which the update applies to
        elif predict:
            self.true = [p.detach().clone() for p in self.params]
        self._install(session)
        if not predict:
            self.true = None
            return
        for p, t in zip(self.params, self.true):
            change = p - t  # this step's update, which the one in flight is expected to repeat
            t.copy_(p)
            p.add_(change)

    def drain(self):
        """Installs the step in flight (no-op otherwise), without a prediction."""
        with torch.no_grad():
            self.install_in_flight(draining=True)

    def drop_prediction(self):
        if self.true is not None:
            for p, t in zip(self.params, self.true):
                p.copy_(t)
            self.true = None
