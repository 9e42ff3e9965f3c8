"""Checkpoints of MuonWithAuxAdam (a collaborator of the optimizer in optim.py): the state muond
holds (the momentum; in apply mode also the master weights and the AdamW state) lives in the
daemon.

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
    ZeRO stage; tensors are matched by name and shape). All or nothing: torch's part (state,
    param_groups) is checked first (a mismatch touches no job) and installed, with step_id, only
    once the daemon took its part; a refusal leaves both as they were. The state a by-name load
    replaces stays restorable until the new one is in: rank 0 exports it to a backup directory
    first, and a refused import re-creates the job from it; when that fails too (the daemon
    died), the backup is kept and the error names it and how to create the job from it.

Apply mode: the state holds the master weights too; the model's parameters come back from the
trainer's own checkpoint (they are the masters in the param dtype), or from export().

Collectives, as the optimizer: save_checkpoint(), load_checkpoint(), state_dict() and
load_state_dict() are called by every rank of the group in the same order (state_dict()'s export
runs on rank 0, whose dict holds the state; the other ranks' refer to rank 0's). The temporary
directories (muon-state-*, under tempfile.gettempdir()) are made for the daemon's user to read
(0711, files 0644, a random name) and removed once used, but for a backup that the error of a
failed restore names. Errors: MuondError.
"""
import os
import shutil
import tempfile

import torch

from ._native import CODES, MuondError


class DaemonCheckpoints:
    """The optimizer's checkpoints, a collaborator of MuonWithAuxAdam (see the module comment).

    ctx, link: the StepContext and JobLink (optim_job.py); mode: the ModeStep (apply mode's
    upload_pending). The optimizer's own operations, as callables: drain() installs a delayed
    step in flight; detach() drains and ends this rank's session; attach() attaches this rank
    again (takeover False; the stream is re-made); arm() arms the stream for the next step;
    stage_torch(state_dict) -> staged and install_torch(*staged): torch's part of
    load_state_dict, checked without changing the optimizer, then installed.
    saved: the generation state_dict() refers to (save_checkpoint()), None when none is.
    """

    def __init__(self, ctx, link, mode, *, drain, detach, attach, arm, stage_torch,
                 install_torch):
        self.ctx, self.link, self.mode = ctx, link, mode
        self.drain, self.detach, self.attach, self.arm = drain, detach, attach, arm
        self.stage_torch, self.install_torch = stage_torch, install_torch
        self.saved = None

    def save_checkpoint(self):
        """Collective: asks muond for a durable checkpoint generation of the job (rank 0) and
        returns {"job_id", "generation", "step", "next_step"} on every rank; state_dict() refers to
        it until the next step."""
        ctx, link = self.ctx, self.link
        if link.session is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], "no muond job attached", "checkpoint")
        self.drain()  # delayed mode: the step in flight is installed, so the save is a whole step
        ctx.ranks.barrier()  # every rank has the result of the last step: between steps
        generation, step = ctx.ranks.on_rank0(
            lambda: link.client.checkpoint_save(link.job_id, link.token))
        self.saved = {"job_id": link.job_id, "generation": generation, "step": step,
                      "next_step": ctx.step_id}
        return dict(self.saved)

    def load_checkpoint(self, generation=-1, step=-1):
        """Collective: detaches, loads the job's checkpoint generation (`generation` >= 0, the one
        saved at `step`, or the newest good one) on rank 0 and attaches again. Returns
        (loaded_generation, next_step)."""
        ctx, link = self.ctx, self.link
        if link.client is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], "no muond job attached", "checkpoint")
        self.detach()
        ctx.ranks.barrier()
        try:
            loaded, next_step = ctx.ranks.on_rank0(
                lambda: link.client.checkpoint_load(link.job_id, link.token, generation, step))
        except MuondError:
            # Refused (no such generation, a damaged one): the job kept its state; attach again
            # so the optimizer is as it was (when the daemon is gone, the load's error stands).
            try:
                ctx.ranks.all_ranks(self.attach)
                self.arm()
            except MuondError:
                pass
            raise
        self.saved = None
        self.mode.upload_pending = False  # apply mode: the generation holds the master weights
        ctx.ranks.barrier()
        ctx.ranks.all_ranks(self.attach)
        if ctx.step_id != next_step:
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"job '{link.job_id}': generation {loaded} resumes at step "
                             f"{next_step}, but rank {ctx.rank} attached at step {ctx.step_id}",
                             "checkpoint")
        return loaded, next_step

    def daemon_state(self):
        """The muond part of state_dict() (see the module comment): {"muond": generation} or
        {"muond_state": the job's state by tensor name} (a collective with a process group)."""
        ctx, link = self.ctx, self.link
        saved = self.saved
        if saved is not None and saved["next_step"] == ctx.step_id:
            return {"muond": dict(saved)}  # save_checkpoint() ran since the last step
        if not self._daemon_is_local():
            return {"muond": dict(self.save_checkpoint())}
        ctx.ranks.barrier()  # every rank has the result of the last step
        state = error = None
        if ctx.rank == 0:
            try:
                state = self._export_state_bytes()
            except MuondError as e:
                error = e
        ctx.ranks.raise_if_any_failed(error)
        return {"muond_state": state if ctx.rank == 0 else
                {"on_rank": 0, "job_id": link.job_id, "next_step": ctx.step_id}}

    def _daemon_is_local(self):
        address, session = self.link.address, self.link.session
        return (session is not None and session.is_shm) or address is None or \
            str(address).startswith("unix:")

    def _export_state_bytes(self):
        """Rank 0: the job's live state exported by the daemon into a temporary directory and read
        back as bytes (the directory is removed)."""
        tmp = _private_dir("muon-state-export-")
        link = self.link
        try:
            step = link.client.export_state(link.job_id, link.token, tmp)
            files = {}
            for name in sorted(os.listdir(tmp)):
                with open(os.path.join(tmp, name), "rb") as f:
                    files[name] = f.read()
            return {"format": "muon_offload-state-1", "job_id": link.job_id, "next_step": step,
                    "files": files}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load_state_dict(self, state_dict, offloaded):
        """Restores the in-process part and, when `offloaded` (a muond job), the job's state: a
        generation of this job ("muond"), or a state by tensor name ("muond_state", of any job
        id, world size or ZeRO stage), which replaces this optimizer's job by a job imported
        from it (a new token). A collective with a process group. All or nothing: torch's part
        (state, param_groups) is checked first and installed only once the daemon took its part;
        a refusal raises with both as they were (see _import_state for the one case where the
        job cannot be put back)."""
        state_dict = dict(state_dict)
        muond = state_dict.pop("muond", None)
        by_name = state_dict.pop("muond_state", None)
        step_id = state_dict.pop("step_id", 0)
        if offloaded:
            if muond is None and by_name is None:
                raise ValueError("this state_dict has no muond part (saved by backend='local'?)")
            if by_name is None and muond["job_id"] != self.link.job_id:
                raise ValueError(f"the state_dict refers to a generation of muond job "
                                 f"'{muond['job_id']}', this optimizer drives job "
                                 f"'{self.link.job_id}'; a state by tensor name (state_dict() "
                                 "with the daemon on this host) loads into any job")
        staged = self.stage_torch(state_dict)
        if not offloaded:
            self.ctx.step_id = step_id
        elif by_name is not None:
            self._import_state(by_name)
        else:
            self._load_generation(muond)
        self.install_torch(*staged)

    def _load_generation(self, muond):
        """The muond part of a state_dict that names a generation of this job."""
        _, next_step = self.load_checkpoint(generation=muond["generation"])
        if next_step != muond["next_step"]:
            raise MuondError(CODES["DATA_LOSS"],
                             f"job '{self.link.job_id}' generation {muond['generation']} resumes "
                             f"at step {next_step}, the state_dict at step "
                             f"{muond['next_step']}; the trainer's part was not loaded",
                             "load_state_dict")
        self.saved = dict(muond)

    def _import_state(self, by_name):
        """Replaces the job by one of the same spec imported from `by_name` (rank 0's files).

        Until the import is in, the job's state stays restorable: rank 0 exports it into a backup
        directory (muon-state-backup-<job>-* under tempfile.gettempdir(), 0711, for the daemon's
        user) before the job is deleted. A refused import re-creates the job from that backup
        (the error says "restored"); when that re-create fails too (the daemon died), the backup
        is kept and the error names it and how to create the job from it; every other way out
        removes it. A refusal before the job is deleted (a bad file entry, a failed export)
        leaves the job as it was, attached again."""
        self.detach()
        self.ctx.ranks.barrier()
        outcome = self.ctx.ranks.on_rank0(lambda: self._replace_job(by_name))
        token, error, replaced, fresh = outcome
        if replaced:
            self.link.token = token
            self.saved = None  # the old job's generations went with it
            self.mode.job_replaced(fresh)
        self.ctx.ranks.all_ranks(self.attach)
        self.arm()
        if error is not None:
            raise MuondError(*error)

    def _replace_job(self, by_name):
        """Rank 0 of _import_state: (token, error, replaced, fresh). error: why the import was
        refused (None: it is in); replaced: the job was deleted and re-made (token is new);
        fresh: a new job without state (it had none to back up). Raises, naming the kept backup,
        when neither the import nor the restore made a job."""
        tmp = backup = None
        try:
            try:
                files = by_name.get("files") if isinstance(by_name, dict) else None
                if not isinstance(files, dict) or not files:
                    raise MuondError(CODES["INVALID_ARGUMENT"],
                                     "rank 0's state_dict holds no muond state by name (a "
                                     "state_dict of another rank? every rank loads its own)",
                                     "load_state_dict")
                tmp = _private_dir("muon-state-import-")
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
                backup = _private_dir(f"muon-state-backup-{self.link.job_id}-")
                try:
                    self.link.client.export_state(self.link.job_id, self.link.token, backup)
                    _readable(backup)
                except MuondError as e:
                    _remove(backup)
                    backup = None
                    if self.ctx.step_id != 0:
                        raise MuondError(e.code, f"{e.message} (backing up the job's state)",
                                         "load_state_dict")
                    # A new job (apply mode before its weights): no state, nothing to lose.
            except OSError as e:  # the temporary directories
                _remove(backup)
                return self.link.token, (CODES["UNKNOWN"], f"{e}; the job was left as it was",
                                    "load_state_dict"), False, False
            except MuondError as e:
                return self.link.token, (e.code, f"{e.message}; the job was left as it was",
                                    e.operation), False, False
            try:
                self.link.client.delete_job(self.link.job_id, self.link.token)
            except MuondError as e:
                return self._restore_from(backup, e, deleted=False)
            spec = dict(self.link.spec)
            spec.pop("init_from", None)  # the imported state holds the master weights
            try:
                token = self.link.client.create_job(spec, import_dir=tmp)
            except MuondError as e:
                return self._restore_from(backup, e, deleted=True)
            _remove(backup)
            backup = None
            return token, None, True, False
        finally:
            _remove(tmp)

    def _restore_from(self, backup, refused, deleted):
        """Rank 0: the job re-created from `backup` (None: as a new job from its spec) after
        `refused` (of the delete when not `deleted`, else of the import); the outcome as
        _replace_job returns it. Keeps the backup and raises when the job cannot be re-created."""
        spec = dict(self.link.spec)
        if backup is not None:
            spec.pop("init_from", None)
        try:
            token = self.link.client.create_job(spec, import_dir=backup)
        except MuondError as e:
            if not deleted and e.code_name == "ALREADY_EXISTS":
                _remove(backup)  # the delete was refused: the job is there as it was
                return self.link.token, (refused.code, refused.message, refused.operation), False, \
                    False
            if backup is None:
                raise MuondError(e.code, f"{refused.message}; re-creating the job (it had no "
                                 f"state yet) failed too: {e.message}", "load_state_dict")
            raise MuondError(
                e.code, f"{refused.message}; restoring job '{self.link.job_id}' from its backup "
                f"failed too ({e.code_name}: {e.message}), so this optimizer has no job (the "
                "trainer's part of the state_dict was not loaded). The job's state from before "
                f"load_state_dict() is kept in {backup}: re-create the job from it with "
                f"`muonctl job create --spec SPEC.json --import-dir {backup}` (SPEC.json: this "
                "optimizer's .spec without init_from) or muon_offload.Client(address)."
                f"create_job(spec, import_dir={backup!r}), then construct the optimizer with "
                "that job_id and token; remove the directory afterwards", "load_state_dict")
        _remove(backup)
        return token, (refused.code, f"{refused.message}; the job was restored to the state it "
                       "had before load_state_dict()", "load_state_dict"), True, backup is None


def staged_torch_state(opt, state_dict):
    """(state, param_groups) that torch.optim.Optimizer.load_state_dict makes of `state_dict`
    (its checks, deep copy and casts), the optimizer `opt` left as it was. Raises ValueError as
    torch does, and when a group's use_muon differs (the job's tensors are fixed)."""
    saved = state_dict.get("param_groups")
    if isinstance(saved, (list, tuple)) and len(saved) == len(opt.param_groups):
        for i, (g, sg) in enumerate(zip(opt.param_groups, saved)):
            if isinstance(sg, dict) and "use_muon" in sg and \
                    bool(sg["use_muon"]) != bool(g["use_muon"]):
                raise ValueError(f"loaded state dict's group {i} has use_muon="
                                 f"{sg['use_muon']}, this optimizer's {g['use_muon']}")
    kept = opt.__dict__["state"], opt.__dict__["param_groups"]
    try:
        # torch's own, which builds new objects; the old ones stay intact.
        torch.optim.Optimizer.load_state_dict(opt, state_dict)
        return opt.state, opt.param_groups
    finally:
        opt.state, opt.param_groups = kept


def install_torch_state(opt, state, param_groups):
    """What staged_torch_state made, installed. The group dicts are updated in place: the
    optimizer's (group, param) pairs keep seeing the groups' hyperparameters."""
    for group, loaded in zip(opt.param_groups, param_groups):
        group.clear()
        group.update(loaded)
    opt.state = state


def _private_dir(prefix):
    """A new directory under tempfile.gettempdir() that the daemon's user enters without listing
    it (0711, a random name)."""
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o711)
    return path


def _readable(path):
    """The files in `path` (an export the daemon wrote) readable by everyone, so that a daemon
    importing them as this user may (those the daemon owns it made so already)."""
    for name in os.listdir(path):
        try:
            os.chmod(os.path.join(path, name), 0o644)
        except OSError:
            pass


def _remove(path):
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
