"""MuonWithAuxAdam: Muon for the hidden weight matrices, through muond; AdamW in-process for the rest.

Mirrors DeepSpeed's MuonWithAuxAdam: every parameter group says `use_muon`. Muon groups hold the
hidden 2-D weights (3-D expert stacks and 4-D conv weights too); their momentum lives in the muond
daemon, which returns the orthogonalized update U of each rank's ZeRO partition, and the optimizer
applies W <- W * (1 - lr * weight_decay) - lr * U. The other groups (embeddings, output head,
norms, biases) run AdamW here.

Hyperparameters are named as torch.optim.Muon names them: lr, weight_decay, momentum, nesterov,
ns_steps, adjust_lr_fn (None or "original", "match_rms_adamw"; or scale_mode, which also takes
"none"), plus ns_method ("standard", "gram", "polar_express") and num_heads per group. lr and
weight_decay may differ per group; the rest configure the muond job and must agree across the Muon
groups.

Distributed use: with a torch.distributed process group of N ranks, one job of world size N is
created (by the group's rank 0) with a ZeRO stage 1/2 (default) or 3 layout. Each rank's
partition of the Muon gradients, averaged over the group (reduce_gradients: a reduce-scatter, the
sum in rank order), goes into the session's shared-memory gradient buffer, streamed bucket by
bucket while backward runs (streaming.py; stream=False: all at step()); muond computes, and
step() applies the update to the partition (span by span as results come, with one rank) and
all-gathers the new weights. delay=1 runs a one-step delayed update. Construction, step(), save_checkpoint(), load_checkpoint() and
load_state_dict() are then collectives: every rank of the group calls them in the same order.

Checkpoints (checkpoints.py): the momentum lives in muond. save_checkpoint() has the daemon write a
durable checkpoint generation; state_dict() (a cheap getter, as in torch.optim) returns the AdamW
state with a reference to that generation, for torch.save; load_state_dict() restores both.
Collectives with errors on every rank: rank_group.py.

backend="local" computes the same Muon math in this process (fp32, muon_offload.reference) with the
momentum in the optimizer state: the side-by-side reference for muond.

mode="apply" (DESIGN.md section 4b) offloads the whole optimizer: every parameter is a tensor of
the muond job (Muon groups with optimizer "muon", the others "adamw"), muond keeps the fp32 master
weights, the momentum and the AdamW moments, and returns new parameters in their dtype (float32,
bfloat16 or float16; on the CPU or a CUDA device). The trainer holds no optimizer state. Each rank
uploads its partition of the parameters before the first step; step() reduce-scatters the
gradients into muond (muon_offload.apply_mode), sends each group's lr and weight_decay as the
param_groups hold them then (so LR schedulers work) and a gradient divisor (the loss scale of
fp16 training: step(grad_divisor=...), the grad_divisor attribute, or a DynamicLossScaler's
scale), and all-gathers the new parameters. max_grad_norm clips globally in muond.
mode="update" (the default) is the above. There max_grad_norm clips too, by the norm over every
gradient: muond sums the Muon matrices' squares as they stream in and adds the AdamW tensors'
share, which goes with the step's last part; it clips the Muon gradients (recomputing a step it
computed speculatively with clip 1) and returns the whole sum, by which step() clips the AdamW
gradients here (opt.last_grad_norm is the step's norm). Streaming is kept, unlike with
torch.nn.utils.clip_grad_norm_, which edits gradients after they streamed.

Non-finite gradients (fp16 loss scaling): nonfinite="skip" (the default in apply mode with a
loss_scaler) makes a step whose gradients hold a NaN or Inf on any rank a skipped step: muond
changes nothing, step() returns normally with every parameter (and in update mode the AdamW
state) as it was, opt.last_step_skipped is True, the step id advances and the scaler halves its
scale. nonfinite="refuse" (the default otherwise) raises INVALID_ARGUMENT as below.

Errors: MuondError (code, code_name, message). A step that fails changes nothing: no weight, AdamW
state or momentum is updated, the step id stays, and the gradients are left as they were.

Composition: the optimizer owns named collaborators, chosen once at construction, each given
what it uses (the StepContext and JobLink of optim_job.py, and its options) explicitly:
  _job      JobLink (optim_job.py): the job's plan, the connection, the token, the session;
  _mode     the mode's half of step(): UpdateModeStep or LocalStep (optim_update.py),
            ApplyModeStep (optim_apply.py), IdleStep (every parameter frozen in apply mode);
  _streams  StreamControl (optim_stream.py): the gradient stream of the attached session;
  _delayed  DelayedUpdates (optim_delay.py): delay=1's step in flight and weight prediction;
  _checkpoints  DaemonCheckpoints (checkpoints.py): save/load_checkpoint, state_dict's muond part.
Construction validates every argument and builds the job spec (optim_spec.py, no I/O) before it
connects to the daemon, creates the job or attaches.
"""
import time
import uuid

import torch

from .optim_apply import ApplyModeStep
from .optim_delay import DelayedUpdates
from .optim_job import IdleStep, JobLink, StepContext, delegate as _delegate
from .optim_spec import OptimizerOptions, job_config, normalize_group, plan_job
from .optim_stream import StreamControl
from .optim_update import AuxAdamW, GradientClip, LocalStep, UpdateModeStep
from .checkpoints import DaemonCheckpoints, install_torch_state, staged_torch_state
from .rank_group import RankGroup
from .streaming import DEFAULT_BUCKET_BYTES


class MuonWithAuxAdam(torch.optim.Optimizer):
    """See the module comment.

    param_groups: dicts with "params" (tensors, or (name, tensor) pairs), "use_muon" (required),
      optional "param_names" and the hyperparameters above.
    backend: "muond" (default) or "local".
    address: the daemon's address (None: its default unix socket).
    job_id: the muond job; a fresh id when None. token: the job's token when the job exists
      already (a restarted trainer); None creates the job.
    process_group: the torch.distributed group of the job's ranks (None: the default group if
      torch.distributed is initialized, else a single rank).
    zero_stage: 1, 2 (default for more than one rank) or 3; 0 for a single rank.
    transport: "auto", "shm" or "grpc". compute_dtype: muond's Newton-Schulz dtype.
    fp32_iterations: with compute_dtype "bfloat16" or "float16", how many leading Newton-Schulz
      iterations muond runs in fp32 (default 0: every iteration in the compute dtype, as the usual
      implementations do; 2 gives DESIGN.md 3's tighter bound).
    reduce_gradients: average gradients over the group in step() (default: True for more than one
      rank); False when the caller has reduced them already: under DistributedDataParallel pass
      False and call stream_ddp(ddp_model), which streams DDP's reduced buckets (without it,
      each step falls back to a whole send at step(), since DDP rewrites the gradients after
      they streamed: exact, not overlapped).
    takeover: attach even when the rank is attached elsewhere (a restarted trainer).
    momentum_dtype: how muond holds Muon's momentum: "float32" (default), "bfloat16" or "int8"
      (blocks of 2048 with an fp32 scale each; README "Memory"). adamw_state_dtype: the same for
      AdamW's moments in apply mode (int8: m linear, v on a logarithmic map). state_dict() and
      checkpoints hold their decoding in float32, which loads back bit for bit.
    max_grad_norm: gradient clipping by the norm over every gradient, in muond (None: off;
      both modes; see the module comment).
    mode: "update" (default) or "apply" (see the module comment); apply mode only:
      init_from: a safetensors file muond reads the initial weights from (None: the ranks upload
        their parameters before the first step);
      grad_divisor: the gradients are divided by it in muond (default 1; per step: step(...)).
    stream: hand each gradient to muond as soon as autograd accumulated it, in buckets of
      bucket_bytes (streaming.py), and use results as they come; default True. False: step()
      sends the whole step.
    delay: 1 runs a one-step delayed update (ZeRO-Offload's DPU): step() at step t sends t's
      gradients and returns at once; the parameters installed before the next forward are those
      of step t-1. delay_warmup synchronous steps come first (default 10). 0: synchronous.
      state_dict(), save_checkpoint(), load_checkpoint(), export() and close() drain the step in
      flight first (drain()).
    predict (delay=1, default True): the next forward runs on the installed parameters plus the
      update just installed, the expected value of the update still in flight (weight
      prediction, as in SpecTrain and PipeMare); the update applies to the parameters without
      it, which the optimizer keeps (one copy of the parameters it steps). drain() leaves the
      parameters without the prediction. It closes most of the loss gap that one step of delay
      opens (README, "Off the critical path"). Parameters written by the caller between steps
      are overwritten while a prediction is installed: drain() first.
    Gradient accumulation: run the backward passes of all micro-batches but the last inside
    `with opt.accumulating():` (their gradients are not streamed; the last one's are).
    """

    def __init__(self, param_groups, *, backend="muond", address=None, job_id=None, token=None,
                 process_group=None, zero_stage=None, transport="auto", compute_dtype="float32",
                 reduce_gradients=None, takeover=False, mode="update", max_grad_norm=None,
                 init_from=None, grad_divisor=1.0, fp32_iterations=0, stream=True,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, delay=0, delay_warmup=10, predict=True,
                 nonfinite=None, loss_scaler=None, qk_clip=None, momentum_dtype="float32",
                 adamw_state_dtype="float32"):
        # 1. Every argument checked (optim_spec.py), then each param group (add_param_group).
        options = OptimizerOptions(
            backend=backend, address=address, job_id=job_id, token=token,
            process_group=process_group, zero_stage=zero_stage, transport=transport,
            compute_dtype=compute_dtype, reduce_gradients=reduce_gradients, takeover=takeover,
            mode=mode, max_grad_norm=max_grad_norm, init_from=init_from,
            grad_divisor=grad_divisor, fp32_iterations=fp32_iterations, stream=stream,
            bucket_bytes=bucket_bytes, delay=delay, delay_warmup=delay_warmup, predict=predict,
            nonfinite=nonfinite, loss_scaler=loss_scaler, qk_clip=qk_clip,
            momentum_dtype=momentum_dtype, adamw_state_dtype=adamw_state_dtype)
        self._options = options
        self._sealed = False
        super().__init__(list(param_groups), {})
        self._sealed = True
        self.muon_config = job_config(self.param_groups, options.backend, options.compute_dtype,
                                      options.fp32_iterations)
        self._ctx = self._context(RankGroup(options.process_group), options)
        self._job = self._make_link(options)
        # 2. The job's spec, partitions and dtype (no I/O; rank 0 picks the id).
        self._offloaded = options.backend == "muond" and bool(self._ctx.job_tensors)
        if self._offloaded:
            self._plan(options)
        # 3. The collaborators, the mode's chosen once; then the daemon.
        self._compose(options)
        #: What the last step cost the caller (seconds): in step(), and waiting for muond.
        self.last_step_stats = {}
        if self._offloaded:
            self._open(options)

    # ----- construction -----

    def _context(self, ranks, options):
        """The StepContext: frozen parameters (requires_grad=False at construction) are not
        optimized (not job tensors, no AdamW state); they stay in param_groups, as torch.optim
        keeps them."""
        groups = self.param_groups
        muon = [(g, p) for g in groups if g["use_muon"] for p in g["params"] if p.requires_grad]
        adam = [(g, p) for g in groups if not g["use_muon"] for p in g["params"]
                if p.requires_grad]
        tensors = muon if options.mode == "update" else \
            [(g, p) for g in groups for p in g["params"] if p.requires_grad]
        names = {p: name for g in groups for name, p in zip(g["param_names"], g["params"])}
        reduce = ranks.size > 1 if options.reduce_gradients is None else options.reduce_gradients
        return StepContext(ranks, names, muon, adam, tensors, lambda: self.param_groups,
                           lambda: self.state, reduce)

    def _make_link(self, options):
        return JobLink(self._ctx, options)

    def _plan(self, options):
        """Rank 0 picks the job id (every rank needs it for the layout); the JobPlan follows."""
        ctx, link = self._ctx, self._job
        if link.zero_stage is None:
            link.zero_stage = 2 if ctx.world_size > 1 else 0
        job_id = ctx.ranks.on_rank0(lambda: options.job_id or f"muon-{uuid.uuid4().hex[:16]}")
        link.plan(job_id, plan_job(options, job_id, ctx.world_size, link.zero_stage,
                                   self.muon_config, self.param_groups, ctx.names,
                                   ctx.job_tensors))

    def _compose(self, options):
        """The collaborators (see the module comment); the mode's step is chosen here, once."""
        ctx, link = self._ctx, self._job
        self._streams = StreamControl(ctx, link, options.stream, options.bucket_bytes)
        self._delayed = DelayedUpdates(ctx, link, options.delay, options.delay_warmup,
                                       options.predict)
        self._mode = self._mode_step(options)
        self._delayed.params = self._mode.predicted_params
        link.on_attach = self._attached
        self._checkpoints = self._make_checkpoints()

    def _mode_step(self, options):
        ctx, link = self._ctx, self._job
        adamw, clip = AuxAdamW(ctx), GradientClip(ctx, link, options.clip_norm)
        if options.mode == "apply":
            if not ctx.job_tensors:
                return IdleStep()
            step = ApplyModeStep(ctx, link, self._streams, self._delayed, options.grad_divisor,
                                 options.loss_scaler, options.init_from)
            step.rearm = self._arm
            return step
        if not self._offloaded:
            return LocalStep(ctx, self.muon_config, adamw, clip)
        return UpdateModeStep(ctx, link, self._streams, self._delayed, adamw, clip)

    def _make_checkpoints(self, kind=DaemonCheckpoints):
        return kind(
            self._ctx, self._job, self._mode, drain=self.drain, detach=self._detach,
            attach=lambda: self._job.attach(takeover=False), arm=self._arm,
            stage_torch=lambda sd: staged_torch_state(self, sd),
            install_torch=lambda *staged: install_torch_state(self, *staged))

    def _open(self, options):
        """Connects, creates the job (rank 0) and attaches every rank. A job that starts at step
        0 takes the weights of the trainer (unless muond reads them from init_from); a later
        step means muond holds them already (a restarted trainer)."""
        self._job.open(options.takeover)
        self._mode.job_opened()
        self._arm()

    def _attached(self, session):
        """After each attach: the mode's buffers, and a new gradient stream."""
        setup = self._mode.attached(session)
        if setup is not None and self._streams.make(session, *setup):
            self._arm()

    # ----- what users and tests read -----

    backend = _delegate("_options", "backend", "'muond' or 'local'.")
    mode = _delegate("_options", "mode", "'update' or 'apply'.")
    nonfinite = _delegate("_options", "nonfinite", "'refuse' or 'skip'.")
    loss_scaler = _delegate("_options", "loss_scaler", "The DynamicLossScaler, or None.")
    stream = _delegate("_streams", "enabled", "Gradients stream during backward.")
    bucket_bytes = _delegate("_streams", "bucket_bytes", "The stream's bucket size.")
    stream_fallbacks = _delegate("_streams", "fallbacks",
                                 "Streamed steps sent whole at step() because a gradient was "
                                 "edited after it left (a warning names the first, once).")
    delay = _delegate("_delayed", "delay", "1: delayed updates (after delay_warmup steps).")
    delay_warmup = _delegate("_delayed", "warmup", "Synchronous steps before delayed ones.")
    predict = _delegate("_delayed", "predict", "Weight prediction (delay=1).")
    ranks = _delegate("_ctx", "ranks", "The RankGroup of the job's ranks.")
    rank = _delegate("_ctx", "rank", "This process's rank in the group.")
    world_size = _delegate("_ctx", "world_size", "The group's size.")
    reduce_gradients = _delegate("_ctx", "reduce_gradients", "step() averages the gradients.")
    step_id = _delegate("_ctx", "step_id", "The muond step id of the next step.", True)
    last_step_skipped = _delegate("_ctx", "last_step_skipped",
                                  "The last step was skipped (nonfinite='skip').", True)
    last_grad_norm = _delegate("_ctx", "last_grad_norm",
                               "The last step's gradient norm with max_grad_norm, else None.",
                               True)
    client = _delegate("_job", "client", "The Client of the daemon (None when closed).")
    session = _delegate("_job", "session", "The attached Session (None when detached).")
    job_id = _delegate("_job", "job_id", "The muond job's id.")
    token = _delegate("_job", "token", "The job's token.")
    spec = _delegate("_job", "spec", "The job spec (dict; None without a job).")
    partitions = _delegate("_job", "partitions", "Every rank's ZeRO partition.")
    partition = _delegate("_job", "partition", "This rank's ZeRO partition.")
    dtype = _delegate("_job", "dtype", "The dtype the flat buffers hold.")
    zero_stage = _delegate("_job", "zero_stage", "The job's ZeRO stage.")
    address = _delegate("_job", "address", "The daemon's address (None: the default).")
    transport = _delegate("_job", "transport", "'auto', 'shm' or 'grpc'.")

    @property
    def process_group(self):
        return self._ctx.ranks.group

    @property
    def offload(self):
        """Apply mode: the ParameterOffload of the attached session (None otherwise)."""
        return getattr(self._mode, "offload", None)

    @property
    def grad_divisor(self):
        """Apply mode: what the gradients are divided by in muond by default (per step:
        step(grad_divisor=...))."""
        return getattr(self._mode, "grad_divisor", self._options.grad_divisor)

    @grad_divisor.setter
    def grad_divisor(self, value):
        if isinstance(self._mode, ApplyModeStep):
            self._mode.grad_divisor = value
        self._options.grad_divisor = value

    # For tests that look inside: the stream, the delayed step and prediction, the count.
    _stream = _delegate("_streams", "stream", "The GradientStream (None when detached).")
    _in_flight = _delegate("_delayed", "in_flight", "delay=1: the step sent, not installed.")
    _true = _delegate("_delayed", "true", "predict: the parameters without the prediction.")
    _steps_taken = _delegate("_delayed", "steps_taken", "Committed steps.")

    # ----- parameter groups -----

    def add_param_group(self, param_group):
        if getattr(self, "_sealed", False):
            raise ValueError("MuonWithAuxAdam: the muond job's matrices are fixed at construction; "
                             "create the optimizer with every parameter group")
        super().add_param_group(normalize_group(param_group, len(self.param_groups),
                                                self._options.mode == "apply"))

    # ----- streaming controls -----

    def _arm(self):
        """The next backward streams step step_id, unless the step is delayed or accumulating,
        or the mode holds it."""
        self._mode.on_arm()
        self._streams.arm(self.step_id, self._delayed.due() or self._mode.holds_stream())

    def stream_ddp(self, ddp_model):
        """The DDP route: streams the gradients DistributedDataParallel reduced, as each of its
        buckets is reduced during backward, instead of each rank's local gradient (which DDP
        rewrites at the end of backward, so that streaming it always falls back). Registers a
        communication hook on `ddp_model` that reduces as DDP's default hook does (the bucket
        divided by the group's size, then all-reduced) and hands the reduced bucket to the
        stream; gradient_as_bucket_view True or False. Needs reduce_gradients=False (DDP
        reduces). Under no_sync() no hook fires and nothing streams: the step goes whole at
        step(). Call once, before the first backward; every rank calls it."""
        ddp = torch.nn.parallel.DistributedDataParallel
        if not isinstance(ddp_model, ddp):
            raise TypeError(f"stream_ddp takes a DistributedDataParallel model, not "
                            f"{type(ddp_model).__name__}")
        if self.reduce_gradients:
            raise ValueError("stream_ddp: DistributedDataParallel reduces the gradients; create "
                             "the optimizer with reduce_gradients=False")
        self._streams.route_ddp(ddp_model)

    def accumulating(self):
        """Context manager: backward passes inside it accumulate gradients without streaming them
        (all micro-batches of a step but the last)."""
        opt, streams = self, self._streams

        class _Accumulating:
            def __enter__(self):
                streams.accumulating += 1
                if streams.stream is not None:
                    streams.stream.disarm()
                return opt

            def __exit__(self, *exc):
                streams.accumulating -= 1
                if not streams.accumulating:
                    opt._arm()
                return False

        return _Accumulating()

    # ----- the session -----

    def _detach(self):
        """Installs a delayed step in flight, then ends the rank's session (and its CUDA
        registrations). The gradient hooks stay: a new attach re-makes them."""
        if self.session is not None:
            self.drain()
        self._mode.detached()
        self._job.close_session()

    def close(self, delete_job=False):
        """Detaches this rank; with delete_job, rank 0 deletes the job (after all ranks detached).
        A delayed step in flight is installed first."""
        self._detach()
        self._streams.remove()
        if delete_job and self.client is not None:
            self._job.delete_job()
        self._job.close_client()

    def drain(self):
        """Delayed mode: installs the step in flight (no-op otherwise). state_dict(),
        save_checkpoint(), load_checkpoint(), export() and close() call it, so that what they see
        is a whole step. A collective with several ranks."""
        self._delayed.drain()

    # ----- the step -----

    # torch.cuda.amp.GradScaler calls step(grad_scaler=scaler) on an optimizer that says this, in
    # place of its own unscale and inf check: refused there (step() below), not run unscaled.
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_divisor=None, max_logits=None, grad_scaler=None):
        """One optimizer step (a collective with a process group). Raises MuondError, with nothing
        updated, when a gradient muond needs is missing or muond refuses the step (e.g.
        INVALID_ARGUMENT for a non-finite gradient on any rank, naming the tensor and rank, on
        every rank). grad_divisor (apply mode): divides this step's gradients (default: the
        grad_divisor attribute). max_logits (qk_clip): the step's per-head maxima, as
        set_max_logits takes them (needed unless set_max_logits was called for the step)."""
        if grad_scaler is not None:
            raise TypeError(
                "MuonWithAuxAdam does not take torch.cuda.amp.GradScaler (scaler.step(opt)): its "
                "unscale and inf check would edit the gradients after they were streamed to "
                "muond, and its skipped steps would not reach the daemon. Use "
                "muon_offload.DynamicLossScaler: MuonWithAuxAdam(..., mode='apply', "
                "loss_scaler=scaler), scaler.backward(loss) (or (loss * scaler.scale)."
                "backward()), opt.step(); muond divides by the scale and skips overflowed steps. "
                "Nothing of this step was applied")
        if grad_divisor is not None and self.mode != "apply":
            raise ValueError("grad_divisor applies to mode='apply' only")
        if max_logits is not None:
            self.set_max_logits(max_logits)
        self.last_step_skipped = False
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                self._mode.run(grad_divisor)
        except BaseException:
            self._streams.abandon_failed(self.step_id)
            self._arm()
            raise
        finally:
            self.last_step_stats = {"seconds": time.perf_counter() - t0}
        if not self.last_step_skipped:
            self._delayed.steps_taken += 1  # committed steps only: delay_warmup counts them
        self.step_id += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.last_step_skipped)
        self._mode.step_done()
        self._arm()
        return loss

    # ----- apply mode -----

    def set_max_logits(self, max_logits):
        """QK-Clip (qk_clip=...): this rank's largest attention logit of each query head in the
        coming step's forward, {q parameter (or name): H values}; muond takes the maximum over
        the ranks. Called after the forward, it lets the backward stream the step; step()'s
        max_logits argument does the same later. ValueError naming the pair for missing, extra
        or non-finite values."""
        self._mode.set_max_logits(max_logits)

    def upload_params(self):
        """Apply mode, a collective: every rank uploads its partition of the parameters as its
        part of muond's master weights. step() does it before the first step of a new job; call
        it to replace the masters between steps."""
        self._mode.upload_params()
        self._arm()

    def export(self, path, dtype="float32"):
        """Apply mode, a collective: muond writes the master weights, every tensor in full shape
        under its parameter name, to `path` (a safetensors file on the daemon's host) in
        `dtype`."""
        self.drain()
        self.ranks.barrier()
        self.ranks.on_rank0(lambda: self.client.export(self.job_id, self.token, path, dtype))

    # ----- checkpoints (checkpoints.py) -----

    def save_checkpoint(self):
        """Collective: asks muond for a durable checkpoint generation of the job (rank 0) and
        returns {"job_id", "generation", "step", "next_step"} on every rank; state_dict() refers to
        it until the next step."""
        return self._checkpoints.save_checkpoint()

    def load_checkpoint(self, generation=-1, step=-1):
        """Collective: detaches, loads the job's checkpoint generation (`generation` >= 0, the one
        saved at `step`, or the newest good one) on rank 0 and attaches again. Returns
        (loaded_generation, next_step)."""
        return self._checkpoints.load_checkpoint(generation, step)

    def state_dict(self):
        """In-process optimizer state (AdamW in update mode, the local backend's momentum) as
        torch.optim keeps it, "step_id", and for muond the job's state (checkpoints.py): the
        generation save_checkpoint() saved when it ran since the last step; else by tensor name
        on rank 0 when the daemon is on this host, else a generation it saves now. With delay=1
        the step in flight is installed first (drain()). A collective with a process group."""
        if self.session is not None:
            self.drain()  # delayed mode (a collective then): the state of a whole step
        sd = super().state_dict()
        sd["step_id"] = self.step_id
        if self._offloaded:
            sd.update(self._checkpoints.daemon_state())
        return sd

    def load_state_dict(self, state_dict):
        """Restores the in-process part and, for muond, the job's state (checkpoints.py): a
        generation of this job ("muond"), or a state by tensor name ("muond_state", of any job
        id, world size or ZeRO stage), which replaces this optimizer's job by a job imported from
        it (a new token). A collective with a process group. All or nothing: torch's part is
        checked first and installed only once the daemon took its part."""
        return self._checkpoints.load_state_dict(state_dict, self._offloaded)
