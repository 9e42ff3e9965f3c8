"""MuonWithAuxAdam's delayed parameter update (delay=1, DESIGN.md 4d; the optimizer and its
module comment are in optim.py): installing the step in flight when the next one comes, weight
prediction, and drain(). A mixin of MuonWithAuxAdam: it works on the optimizer's own attributes.
"""
import torch

from ._native import MuondError


class DelayedUpdates:
    """The delay=1 half of MuonWithAuxAdam's step (see the module comment)."""

    def _install_in_flight(self, draining=False):
        """Delayed mode: waits for the step in flight and installs its results (a collective
        with several ranks). A failed delayed step raises here, with nothing of it installed; its
        step id is the next step's again. With predict, the parameters the next forward sees are
        the installed ones plus the update just installed (the step in flight's expected
        update); draining installs without it."""
        if self._in_flight is None:
            if draining:
                self._drop_prediction()
            return
        step, self._in_flight = self._in_flight, None
        error = None
        try:
            self.session.wait_parts(step)
        except MuondError as e:
            error = e
        try:
            self.ranks.raise_if_any_failed(error)
        except MuondError:
            self.step_id = step
            raise
        if self.session.last_step_skipped:
            # Nothing to install: the parameters the step applied to stay (without prediction).
            self.last_step_skipped = True
            self._drop_prediction()
            return
        predict = self.predict and not draining
        params = self._predicted_params()
        if self._true is not None:
            for p, t in zip(params, self._true):
                p.copy_(t)  # the parameters without the prediction, which the update applies to
        elif predict:
            self._true = [p.detach().clone() for p in params]
        if self.mode == "apply":
            self.offload.pull_params(self.offload._pinned(
                self.session.update_view(step, self.dtype), read_only=True))
        else:
            hyper, adam, adam_hyper = self._delayed_rest
            self._install_muon(self.session.update_view(step, self.dtype), hyper=hyper)
            self._adam_step(self._clipped(adam), adam_hyper)
        if not predict:
            self._true = None
            return
        for p, t in zip(params, self._true):
            change = p - t  # this step's update, which the one in flight is expected to repeat
            t.copy_(p)
            p.add_(change)

    def _predicted_params(self):
        return [p for _, p in self._job_tensors] + \
            ([p for _, p in self._adam] if self.mode == "update" else [])

    def drain(self):
        """Delayed mode: installs the step in flight (no-op otherwise). state_dict(),
        save_checkpoint(), load_checkpoint(), export() and close() call it, so that what they see
        is a whole step. A collective with several ranks."""
        with torch.no_grad():
            self._install_in_flight(draining=True)

    def _drop_prediction(self):
        if self._true is not None:
            for p, t in zip(self._predicted_params(), self._true):
                p.copy_(t)
            self._true = None
