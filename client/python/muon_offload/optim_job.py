"""What MuonWithAuxAdam's collaborators share (optim.py composes them): the StepContext (the
ranks, the tensors, the step id and the last step's outcome) and the JobLink (the muond job of
this rank: its plan, the connection, the token and the attached session). Both are plain objects
with documented fields that the optimizer owns and hands to each collaborator it builds.
"""
from ._native import CODES, MuondError
from .client import Client


def delegate(part, name, doc, settable=False):
    """A property of the optimizer that reads (and with settable, writes) `name` of the
    collaborator held in attribute `part`."""
    def get(self):
        return getattr(getattr(self, part), name)

    def put(self, value):
        setattr(getattr(self, part), name, value)
    return property(get, put if settable else None, doc=doc)


class StepContext:
    """The state every part of a step reads (one object per optimizer).

    ranks: the RankGroup of the job's ranks (rank, size, collectives failing on every rank).
    names: {parameter: name}.
    muon, adam: (group, param) pairs of the Muon matrices and of the AdamW parameters (frozen
      parameters, requires_grad=False at construction, are in neither).
    job_tensors: the muond job's (group, param) pairs in job order: the Muon matrices, or in
      apply mode every parameter that is not frozen.
    groups(): the optimizer's param_groups now; torch_state(): its per-parameter state now
      (torch.optim's self.state; torch's load_state_dict replaces both objects).
    reduce_gradients: step() averages the gradients over the ranks.
    step_id: the muond step id of the next step (the local backend counts too).
    last_step_skipped: the last step was skipped (a non-finite gradient, nonfinite="skip").
    last_grad_norm: the last step's gradient norm when clipping (max_grad_norm), else None.
    """

    def __init__(self, ranks, names, muon, adam, job_tensors, groups, torch_state,
                 reduce_gradients):
        self.ranks, self.names = ranks, names
        self.muon, self.adam, self.job_tensors = muon, adam, job_tensors
        self.groups, self.torch_state = groups, torch_state
        self.reduce_gradients = reduce_gradients
        self.step_id = 0
        self.last_step_skipped = False
        self.last_grad_norm = None

    @property
    def rank(self):
        return self.ranks.rank

    @property
    def world_size(self):
        return self.ranks.size

    def require_gradients(self, pairs, kind):
        """Raises on every rank (a collective) when a parameter of `pairs` has no gradient on any
        rank: every rank must stop here, or the others would wait for it in a collective."""
        missing = [self.names[p] for _, p in pairs if p.grad is None]
        ranks_missing = self.ranks.count(missing)
        if missing:
            raise MuondError(CODES["INVALID_ARGUMENT"],
                             f"{kind} parameter(s) {', '.join(repr(n) for n in missing)} have no "
                             f"gradient (p.grad is None): every {kind} tensor of the muond job "
                             "needs one each step; was the parameter used in the forward pass?",
                             "step")
        if ranks_missing:
            raise MuondError(CODES["INVALID_ARGUMENT"],
                             f"{ranks_missing} other rank(s) of the group have {kind} parameters "
                             "without a gradient (see their errors); the step is skipped", "step")


class JobLink:
    """This rank's muond job (None fields until open()).

    spec, qk_order, partitions, dtype: the JobPlan (optim_spec.py); partition: this rank's.
    job_id, token: the job (token None until created or given); zero_stage, address, transport:
      as the optimizer was given them (zero_stage resolved).
    client: the Client (None before open() and after close()); session: the attached Session
      (None when detached).
    on_attach(session): called after every attach (the optimizer makes its buffers and the
      gradient stream there).
    """

    def __init__(self, ctx, options):
        self.ctx = ctx
        self.job_id, self.token = options.job_id, options.token
        self.zero_stage, self.address = options.zero_stage, options.address
        self.transport = options.transport
        self.spec = self.dtype = None
        self.qk_order = ()
        self.partitions, self.partition = [], None
        self.client = self.session = None
        self.on_attach = None

    def plan(self, job_id, plan):
        """Takes the JobPlan of job `job_id` (no I/O)."""
        self.job_id = job_id
        self.spec, self.qk_order, self.dtype = plan.spec, plan.qk_order, plan.dtype
        self.partitions = plan.partitions
        self.partition = self.partitions[self.ctx.rank]

    def open(self, takeover):
        """Connects, creates the job on rank 0 (unless a token was given) and attaches every
        rank (collectives)."""
        self.client = Client(self.address)
        self.token = self.ctx.ranks.on_rank0(self.create_job)
        self.ctx.ranks.all_ranks(lambda: self.attach(takeover))

    def create_job(self):
        """Rank 0: the job's token (creating the job unless a token was given)."""
        self.client.health(5.0)  # "muond at ADDRESS is not reachable" beats a failed CreateJob
        return self.token if self.token is not None else self.client.create_job(self.spec)

    def attach(self, takeover):
        """Attaches this rank (its layout checked against the plan); the step id becomes the
        session's next step."""
        self.spec["job_id"] = self.job_id
        self.session = self.client.attach(self.job_id, self.ctx.rank, self.token, takeover,
                                          self.transport)
        if tuple(self.session.spans) != tuple(self.partition.spans):
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"job '{self.job_id}' rank {self.ctx.rank}: the daemon's layout "
                             "differs from this optimizer's parameters (another model or world "
                             "size?)", "attach")
        self.ctx.step_id = self.session.next_step
        self.on_attach(self.session)

    def require_session(self):
        """The attached session; FAILED_PRECONDITION when there is none."""
        if self.session is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], f"job '{self.job_id}' rank "
                             f"{self.ctx.rank}: not attached (closed, or a checkpoint load "
                             "failed)", "step")
        return self.session

    def close_session(self):
        if self.session is not None:
            self.session.close()
            self.session = None

    def delete_job(self):
        """After every rank detached (a barrier): rank 0 deletes the job."""
        self.ctx.ranks.barrier()
        if self.ctx.rank == 0:
            self.client.delete_job(self.job_id, self.token)

    def close_client(self):
        if self.client is not None:
            self.client.close()
            self.client = None


class ModeStep:
    """The half of step() that a mode runs, chosen once when the optimizer is built (UpdateModeStep
    and LocalStep in optim_update.py, ApplyModeStep in optim_apply.py, IdleStep here; the
    multi-node ones in multinode_steps.py). This base is what a mode without the feature does.

    upload_pending: apply mode's weights go to muond before the next step.
    predicted_params: the parameters weight prediction (delay=1, predict) moves.
    """
    upload_pending = False
    predicted_params = ()

    def run(self, grad_divisor):
        """The step's body (under torch.no_grad(), errors leave nothing changed)."""
        raise NotImplementedError

    def attached(self, session):
        """After each attach: the mode's buffers for `session`. Returns the stream's set-up
        (view, mean, zero_missing, on_first_post) for StreamControl.make, or None."""
        return None

    def detached(self):
        """Before the session ends: what attached() made is released."""

    def on_arm(self):
        """The next step is (re)armed: what its first part carried is forgotten."""

    def holds_stream(self):
        """Whether the next backward must not stream (a reason of the mode's)."""
        return False

    def step_done(self):
        """After every step, committed or skipped: what the step alone carried is dropped."""

    def job_opened(self):
        """The job was created or attached at construction (ctx.step_id is its next step)."""

    def job_replaced(self, fresh):
        """The job was re-made from an imported state (fresh: without any state)."""

    def upload_params(self):
        raise MuondError(CODES["FAILED_PRECONDITION"], "no apply-mode muond job attached",
                         "upload_params")

    def set_max_logits(self, max_logits):
        raise ValueError("set_max_logits: the optimizer has no qk_clip pairs")


class IdleStep(ModeStep):
    """Apply mode with every parameter frozen: no job, nothing to step."""

    def run(self, grad_divisor):
        pass
