"""Checkpoints of MuonWithAuxAdam (a mixin of optim.py): the state muond holds (the momentum; in
apply mode also the master weights and the AdamW state) lives in the daemon.

  - save_checkpoint(): the daemon writes a durable checkpoint generation (DESIGN.md section 7);
    load_checkpoint() restores one into the same job.
  - state_dict(), at any time (as torch's): the in-process optimizer state plus, for muond, a
    reference to the generation save_checkpoint() wrote if it ran since the last step, else the
    job's whole state by tensor name ("muond_state": the full-state export of the daemon's live
    state, `muonctl checkpoint export`'s two files as bytes, which torch.save keeps) when the
    daemon is on this host; with a daemon elsewhere (TCP), a reference to a durable generation it
    takes itself ("muond": {"job_id", "generation", "step", "next_step"}).
  - load_state_dict(): a reference loads that generation of this job; a state by tensor name is
    imported into a new job of this optimizer's spec and id, which replaces the job (as
    DeepSpeed's universal checkpoint: the state may come from a job of another id, world size or
    ZeRO stage; tensors are matched by name and shape).

Apply mode: the state holds the master weights too; the model's parameters come back from the
trainer's own checkpoint (they are the masters in the param dtype), or from export().

Collectives, as the optimizer: save_checkpoint(), load_checkpoint(), state_dict() and
load_state_dict() are called by every rank of the group in the same order (state_dict()'s export
runs on rank 0, whose dict holds the state; the other ranks' refer to rank 0's). The temporary
export directory is made for the daemon's user to read (0711, files 0644, a random name) and
removed at once. Errors: MuondError.
"""
import os
import shutil
import tempfile

from ._native import CODES, MuondError


class DaemonCheckpoints:
    """Checkpoint methods over the optimizer's attributes (ranks, client, session, offload,
    job_id, token, spec, step_id, backend, _job_tensors, _attach, _detach, _arm, _checkpoint,
    _upload_pending)."""


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
        self._detach()
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
        """In-process optimizer state (AdamW in update mode, the local backend's momentum) as
        torch.optim keeps it, "step_id", and for muond the job's state (see the module comment):
        the generation save_checkpoint() saved when it ran since the last step; else by tensor
        name on rank 0 when the daemon is on this host, else a generation it saves now.
        With delay=1 the step in flight is installed first (drain()). A collective with a process
        group."""
        if self.session is not None:
            self.drain()  # delayed mode (a collective then): the state of a whole step
        sd = super().state_dict()
        sd["step_id"] = self.step_id
        if self._offloaded():
            saved = self._checkpoint
            if saved is not None and saved["next_step"] == self.step_id:
                sd["muond"] = dict(saved)  # save_checkpoint() ran since the last step
            elif self._daemon_is_local():
                self.ranks.barrier()  # every rank has the result of the last step
                state = error = None
                if self.rank == 0:
                    try:
                        state = self._export_state_bytes()
                    except MuondError as e:
                        error = e
                self.ranks.raise_if_any_failed(error)
                sd["muond_state"] = state if self.rank == 0 else \
                    {"on_rank": 0, "job_id": self.job_id, "next_step": self.step_id}
            else:
                sd["muond"] = dict(self.save_checkpoint())
        return sd

    def _daemon_is_local(self):
        address = self.address
        return (self.session is not None and self.session.is_shm) or address is None or \
            str(address).startswith("unix:")

    def _export_state_bytes(self):
        """Rank 0: the job's live state exported by the daemon into a temporary directory and read
        back as bytes (the directory is removed)."""
        tmp = tempfile.mkdtemp(prefix="muon-state-")
        try:
            os.chmod(tmp, 0o711)  # the daemon's user enters it without listing it
            step = self.client.export_state(self.job_id, self.token, tmp)
            files = {}
            for name in sorted(os.listdir(tmp)):
                with open(os.path.join(tmp, name), "rb") as f:
                    files[name] = f.read()
            return {"format": "muon_offload-state-1", "job_id": self.job_id, "next_step": step,
                    "files": files}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _offloaded(self):
        return self.backend == "muond" and bool(self._job_tensors)

    def load_state_dict(self, state_dict):
        """Restores the in-process part and, for muond, the job's state: a generation of this job
        ("muond"), or a state by tensor name ("muond_state", of any job id, world size or ZeRO
        stage), which replaces this optimizer's job by a job imported from it (a new token). A
        collective with a process group."""
        state_dict = dict(state_dict)
        muond = state_dict.pop("muond", None)
        by_name = state_dict.pop("muond_state", None)
        step_id = state_dict.pop("step_id", 0)
        if self._offloaded():
            if muond is None and by_name is None:
                raise ValueError("this state_dict has no muond part (saved by backend='local'?)")
            if by_name is None and muond["job_id"] != self.job_id:
                raise ValueError(f"the state_dict refers to a generation of muond job "
                                 f"'{muond['job_id']}', this optimizer drives job "
                                 f"'{self.job_id}'; a state by tensor name (state_dict() with "
                                 "the daemon on this host) loads into any job")
        super().load_state_dict(state_dict)
        if not self._offloaded():
            self.step_id = step_id
        elif by_name is not None:
            self._import_state(by_name)
        else:
            _, next_step = self.load_checkpoint(generation=muond["generation"])
            if next_step != muond["next_step"]:
                raise MuondError(CODES["DATA_LOSS"],
                                 f"job '{self.job_id}' generation {muond['generation']} resumes "
                                 f"at step {next_step}, the state_dict at step "
                                 f"{muond['next_step']}", "load_state_dict")
            self._checkpoint = dict(muond)

    def _import_state(self, by_name):
        """Replaces the job by one of the same spec imported from `by_name` (rank 0's files)."""
        self._detach()
        self._checkpoint = None
        self.ranks.barrier()

        def recreate():
            """Rank 0: (token, error, fresh): the job imported from `by_name`; when the import is
            refused, the job as it was (imported from its own state, saved first; a fresh job when
            it had none yet) and why."""
            files = by_name.get("files")
            if not isinstance(files, dict) or not files:
                raise MuondError(CODES["INVALID_ARGUMENT"],
                                 "rank 0's state_dict holds no muond state by name (a state_dict "
                                 "of another rank? every rank loads its own)", "load_state_dict")
            tmp = tempfile.mkdtemp(prefix="muon-state-")
            backup = tempfile.mkdtemp(prefix="muon-state-")
            try:
                for d in (tmp, backup):
                    os.chmod(d, 0o711)  # the daemon's user enters them without listing them
                for name, data in files.items():
                    if not isinstance(name, str) or os.path.basename(name) != name or \
                            name.startswith(".") or not isinstance(data, (bytes, bytearray)):
                        raise MuondError(CODES["INVALID_ARGUMENT"],
                                         f"muond_state: bad file entry {name!r}",
                                         "load_state_dict")
                    path = os.path.join(tmp, name)
                    with open(path, "wb") as f:
                        f.write(data)
                    os.chmod(path, 0o644)
                spec = dict(self.spec)
                spec.pop("init_from", None)  # the imported state holds the master weights
                try:
                    self.client.export_state(self.job_id, self.token, backup)
                except MuondError:
                    if self.step_id != 0:
                        raise
                    backup = None  # a new job (e.g. apply mode before its weights): no state
                self.client.delete_job(self.job_id, self.token)
                try:
                    return self.client.create_job(spec, import_dir=tmp), None, False
                except MuondError as e:
                    token = self.client.create_job(spec if backup else self.spec,
                                                   import_dir=backup)
                    return token, (e.code, f"{e.message}; the job was restored to the state it "
                                   "had before load_state_dict()", "load_state_dict"), \
                        backup is None
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                if backup is not None:
                    shutil.rmtree(backup, ignore_errors=True)

        self.token, error, fresh = self.ranks.on_rank0(recreate)
        # The imported state holds the master weights; a fresh job takes the trainer's.
        self._upload_pending = fresh and self.mode == "apply" and "init_from" not in self.spec
        self.ranks.all_ranks(lambda: self._attach(takeover=False))
        self._arm()
        if error is not None:
            raise MuondError(*error)
