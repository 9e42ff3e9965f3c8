"""Checkpoints of MuonWithAuxAdam (a mixin of optim.py): the state muond holds (the momentum; in
apply mode also the master weights and the AdamW state) lives in daemon-side checkpoint
generations (DESIGN.md section 7). save_checkpoint() has the daemon write a durable generation;
state_dict() (a cheap getter, as in torch.optim) returns the in-process optimizer state with a
reference to that generation, for torch.save; load_state_dict() restores both.

Apply mode: a generation holds the master weights too; the model's parameters come back from the
trainer's own checkpoint (they are the masters in the param dtype), or from export().

Collectives, as the optimizer: save_checkpoint(), load_checkpoint() and load_state_dict() are
called by every rank of the group in the same order. Errors: MuondError.
"""
from ._native import CODES, MuondError


class DaemonCheckpoints:
    """Checkpoint methods over the optimizer's attributes (ranks, client, session, offload,
    job_id, token, step_id, backend, _job_tensors, _attach, _checkpoint, _upload_pending)."""


    def save_checkpoint(self):
        """Collective: asks muond for a durable checkpoint generation of the job (rank 0) and
        returns {"job_id", "generation", "step", "next_step"} on every rank; state_dict() refers to
        it until the next step."""
        if self.session is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], "no muond job attached", "checkpoint")
        self.drain()  # delayed mode: the step in flight is installed, so the save is a whole step
        self.ranks.barrier()  # every rank has the result of the last step: between steps
        generation, step = self.ranks.on_rank0(
            lambda: self.client.checkpoint_save(self.job_id, self.token))
        self._checkpoint = {"job_id": self.job_id, "generation": generation, "step": step,
                            "next_step": self.step_id}
        return dict(self._checkpoint)

    def load_checkpoint(self, generation=-1, step=-1):
        """Collective: detaches, loads the job's checkpoint generation (`generation` >= 0, the one
        saved at `step`, or the newest good one) on rank 0 and attaches again. Returns
        (loaded_generation, next_step)."""
        if self.client is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], "no muond job attached", "checkpoint")
        if self.session is not None:
            self.drain()
        if self.offload is not None:
            self.offload.close()
            self.offload = None
        if self.session is not None:
            self.session.close()
            self.session = None
        self._checkpoint = None
        self._upload_pending = False  # apply mode: the generation holds the master weights
        self.ranks.barrier()
        loaded, next_step = self.ranks.on_rank0(
            lambda: self.client.checkpoint_load(self.job_id, self.token, generation, step))
        self.ranks.barrier()
        self.ranks.all_ranks(lambda: self._attach(takeover=False))
        if self.step_id != next_step:
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"job '{self.job_id}': generation {loaded} resumes at step "
                             f"{next_step}, but rank {self.rank} attached at step {self.step_id}",
                             "checkpoint")
        return loaded, next_step

    def state_dict(self):
        """AdamW state (and the local backend's momentum) as torch.optim keeps it, plus, for muond,
        {"muond": {"job_id", "generation", "step", "next_step"}}: the generation save_checkpoint()
        saved (or load_state_dict() loaded) since the last step. Only reads (not a collective, saves
        nothing), except that with delay=1 it first installs the step in flight (drain()). Raises MuondError FAILED_PRECONDITION when there is none (call
        save_checkpoint() first): momentum and AdamW state from different steps restore neither."""
        if self.session is not None:
            self.drain()  # delayed mode (a collective then): the state of a whole step
        sd = super().state_dict()
        sd["step_id"] = self.step_id
        if self._offloaded():
            saved = self._checkpoint
            if saved is None or saved["next_step"] != self.step_id:
                raise MuondError(CODES["FAILED_PRECONDITION"],
                                 f"job '{self.job_id}': no checkpoint generation saved since "
                                 f"the last step (next step {self.step_id}); call "
                                 "save_checkpoint() (a collective) before state_dict()",
                                 "state_dict")
            sd["muond"] = dict(saved)
        return sd

    def _offloaded(self):
        return self.backend == "muond" and bool(self._job_tensors)

    def load_state_dict(self, state_dict):
        """Restores the AdamW part in-process and, for muond, loads the referenced generation of the
        job into the daemon (a collective)."""
        state_dict = dict(state_dict)
        muond = state_dict.pop("muond", None)
        step_id = state_dict.pop("step_id", 0)
        if self._offloaded():
            if muond is None:
                raise ValueError("this state_dict has no muond part (saved by backend='local'?)")
            if muond["job_id"] != self.job_id:
                raise ValueError(f"the state_dict is of muond job '{muond['job_id']}', this "
                                 f"optimizer drives job '{self.job_id}'")
        super().load_state_dict(state_dict)
        if self._offloaded():
            _, next_step = self.load_checkpoint(generation=muond["generation"])
            if next_step != muond["next_step"]:
                raise MuondError(CODES["DATA_LOSS"],
                                 f"job '{self.job_id}' generation {muond['generation']} resumes "
                                 f"at step {next_step}, the state_dict at step "
                                 f"{muond['next_step']}", "load_state_dict")
            self._checkpoint = dict(muond)
        else:
            self.step_id = step_id
