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

The apply-mode half of the step is optim_apply.py (ApplyModeSteps), the delayed update
optim_delay.py (DelayedUpdates); both are mixins of MuonWithAuxAdam.
"""
import math
import time
import uuid
import warnings

import torch

from . import reference
from ._native import CODES, MuondError
from .client import Client, dtype_name
from .apply_mode import ParameterOffload, apply_job_spec, wire_dtype
from .checkpoints import DaemonCheckpoints
from .optim_apply import ApplyModeSteps
from .optim_delay import DelayedUpdates
from .qk_clip import job_block as qk_clip_job_block
from .rank_group import RankGroup
from .streaming import DEFAULT_BUCKET_BYTES, EarlyResults, GradientStream
from .zero import all_gather_partitions, all_reduce_mean, copy_into_buffer, job_partitions

MUON_KEYS = {"lr": 0.02, "weight_decay": 0.0, "momentum": 0.95, "nesterov": True, "ns_steps": 5,
             "ns_method": "standard", "adjust_lr_fn": None, "scale_mode": None, "num_heads": 1}
ADAM_KEYS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
# Muon keys that configure the muond job (one per job), not the trainer-side update.
JOB_KEYS = ("momentum", "nesterov", "ns_steps", "ns_method", "scale_mode")


def _scale_mode(group):
    adjust, mode = group.get("adjust_lr_fn"), group.get("scale_mode")
    if adjust is not None and mode is not None and adjust != mode:
        raise ValueError(f"adjust_lr_fn '{adjust}' and scale_mode '{mode}' disagree")
    mode = mode or adjust or "original"
    if mode not in reference.SCALE_MODES:
        raise ValueError(f"unknown adjust_lr_fn/scale_mode '{mode}' "
                         f"(accepted: {', '.join(reference.SCALE_MODES)})")
    return mode


class MuonWithAuxAdam(ApplyModeSteps, DelayedUpdates, DaemonCheckpoints, torch.optim.Optimizer):
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
                 nonfinite=None, loss_scaler=None, qk_clip=None):
        if backend not in ("muond", "local"):
            raise ValueError(f"backend must be 'muond' or 'local', not '{backend}'")
        if mode not in ("update", "apply"):
            raise ValueError(f"mode must be 'update' or 'apply', not '{mode}'")
        if mode == "apply" and backend != "muond":
            raise ValueError("mode='apply' runs the optimizer in muond; the in-process reference "
                             "of apply mode is muon_offload.reference.ApplyReference")
        if mode == "update" and (init_from is not None or qk_clip is not None):
            raise ValueError("init_from and qk_clip apply to mode='apply' only")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and
                                              math.isfinite(max_grad_norm) and
                                              max_grad_norm >= 0):
            raise ValueError(f"max_grad_norm must be a finite number >= 0, not {max_grad_norm!r}")
        if token is not None and not job_id:
            raise ValueError("a token was given without the job_id it belongs to")
        if delay not in (0, 1):
            raise ValueError(f"delay must be 0 or 1, not {delay!r}")
        if isinstance(delay_warmup, bool) or not isinstance(delay_warmup, int) or delay_warmup < 0:
            raise ValueError(f"delay_warmup must be an integer >= 0, not {delay_warmup!r}")
        if int(bucket_bytes) <= 0:
            raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes!r}")
        if loss_scaler is not None and (mode != "apply" or delay):
            raise ValueError("loss_scaler: the gradients are divided by its scale in muond, which "
                             "takes mode='apply' and delay=0 (the scaler needs each step's "
                             "outcome at step())")
        if nonfinite is None:
            nonfinite = "skip" if loss_scaler is not None else "refuse"
        if nonfinite not in ("refuse", "skip"):
            raise ValueError(f"nonfinite must be 'refuse' or 'skip', not {nonfinite!r}")
        if loss_scaler is not None and nonfinite != "skip":
            raise ValueError("a loss_scaler needs nonfinite='skip' (an overflowed step is skipped "
                             "and the scale lowered)")
        self.nonfinite = nonfinite
        self.loss_scaler = loss_scaler
        self.last_step_skipped = False
        self.backend = backend
        self.mode = mode
        self._sealed = False
        super().__init__(list(param_groups), {})
        self._sealed = True

        self.ranks = RankGroup(process_group)
        self._dist, self.process_group = self.ranks.dist, self.ranks.group
        self.rank, self.world_size = self.ranks.rank, self.ranks.size
        self.reduce_gradients = self.world_size > 1 if reduce_gradients is None else reduce_gradients

        # Frozen parameters (requires_grad=False at construction) are not optimized: not job
        # tensors, no AdamW state; they stay in param_groups, as torch.optim keeps them.
        self._muon = [(g, p) for g in self.param_groups if g["use_muon"] for p in g["params"]
                      if p.requires_grad]
        self._adam = [(g, p) for g in self.param_groups if not g["use_muon"]
                      for p in g["params"] if p.requires_grad]
        # The muond job's tensors, in job order: the Muon matrices, or in apply mode everything
        # that is not frozen.
        self._job_tensors = self._muon if mode == "update" else \
            [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._names = {}
        for g in self.param_groups:
            for name, p in zip(g["param_names"], g["params"]):
                self._names[p] = name
        self.muon_config = self._job_config(compute_dtype, fp32_iterations)

        self.client = self.session = self.partition = None
        self.partitions = []
        self.job_id = job_id
        self.token = token
        self.zero_stage = zero_stage
        self.transport = transport
        self.address = address
        self.step_id = 0  # the muond step id of the next step (the local backend counts too)
        self._checkpoint = None  # the generation state_dict() refers to (save_checkpoint())
        self.grad_divisor = float(grad_divisor)
        self.offload = None  # apply mode: the ParameterOffload of the attached session
        self._upload_pending = False  # apply mode: the ranks upload the weights at the next step
        self.stream = bool(stream) and backend == "muond"
        self.bucket_bytes = int(bucket_bytes)
        self.delay, self.delay_warmup = int(delay), int(delay_warmup)
        self._stream = None  # the GradientStream of the attached session
        self._sent_hyper = self._step_hyper = None  # apply mode, streamed steps (_send_hyper)
        self._accumulating = 0
        self._in_flight = None  # delay=1: the step sent and not yet installed
        self.predict = bool(predict) and self.delay == 1
        self._true = None  # predict: the parameters without the prediction
        # Apply mode: the last step's presence mask, what a part sent during backward carries.
        self._absent_guess = ()
        # QK-Clip (qk_clip.py): the pairs' (q, heads) in job order; the next step's per-head
        # maxima (set_max_logits) and what the step's first part carried.
        self._qk_order = ()
        self._max_logits = self._sent_max_logits = None
        self._steps_taken = 0  # committed steps (delay_warmup counts them)
        # Streamed steps sent whole at step() because a gradient was edited after it left
        # (GradientStream.edited); the warning naming the first such tensor is given once.
        self.stream_fallbacks = 0
        # Update mode: clipping by the norm over every gradient, the Muon matrices' in muond (as
        # they stream) and the AdamW tensors' here (_outside_share); the last step's norm.
        self._clip_norm = float(max_grad_norm or 0.0) if mode == "update" else 0.0
        self.last_grad_norm = None
        self._edit_warned = False
        self._ddp_routed = ()  # stream_ddp(): the job tensors DDP's hook streams
        # What the last step cost the caller (seconds): in step(), and waiting for muond.
        self.last_step_stats = {}
        if backend == "local" or not self._job_tensors:
            return
        if self.zero_stage is None:
            self.zero_stage = 2 if self.world_size > 1 else 0
        # The id is rank 0's choice; every rank needs it for the layout.
        self.job_id = self.ranks.on_rank0(lambda: job_id or f"muon-{uuid.uuid4().hex[:16]}")
        if mode == "apply":
            self.spec = apply_job_spec(self.job_id, self.world_size, self.zero_stage,
                                       self.muon_config, self.param_groups, self._names,
                                       max_grad_norm, init_from)
        else:
            self.spec = self._job_spec()
        if self.nonfinite == "skip":
            self.spec["nonfinite"] = "skip"
        if qk_clip is not None:
            self.spec["qk_clip"], self._qk_order = qk_clip_job_block(qk_clip, self._names)
        self.partitions = job_partitions(self.spec)
        self.partition = self.partitions[self.rank]
        # What the buffers hold: apply mode moves a model of several dtypes as float32.
        self.dtype = wire_dtype([p for _, p in self._job_tensors]) if mode == "apply" \
            else self._job_tensors[0][1].dtype
        self.client = Client(address)
        self.token = self.ranks.on_rank0(self._create_job)
        self.ranks.all_ranks(lambda: self._attach(takeover))
        # A job that starts at step 0 takes the weights of the trainer (unless muond reads them
        # from init_from); a later step means muond holds them already (a restarted trainer).
        self._upload_pending = mode == "apply" and init_from is None and self.step_id == 0
        self._arm()

    # ----- parameter groups -----

    def add_param_group(self, param_group):
        if getattr(self, "_sealed", False):
            raise ValueError("MuonWithAuxAdam: the muond job's matrices are fixed at construction; "
                             "create the optimizer with every parameter group")
        if "use_muon" not in param_group:
            raise ValueError("every parameter group needs 'use_muon' (True: Muon through muond, "
                             "False: AdamW)")
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = list(group.get("param_names", []))
        if params and isinstance(params[0], tuple):
            names = [n for n, _ in params]
            params = [p for _, p in params]
        index = len(self.param_groups)
        if not names:
            names = [f"group{index}.param{i}" for i in range(len(params))]
        if len(names) != len(params):
            raise ValueError(f"group {index}: {len(names)} param_names for {len(params)} params")
        group["params"], group["param_names"] = params, names
        keys = MUON_KEYS if group["use_muon"] else ADAM_KEYS
        unknown = set(group) - set(keys) - {"params", "param_names", "use_muon"}
        if unknown:
            raise ValueError(f"group {index} (use_muon={group['use_muon']}): unknown "
                             f"hyperparameters {sorted(unknown)}; accepted: {sorted(keys)}")
        for k, v in keys.items():
            group.setdefault(k, v)
        apply = getattr(self, "mode", "update") == "apply"
        if group["use_muon"]:
            group["scale_mode"] = _scale_mode(group)
            for name, p in zip(names, params):
                if not 2 <= p.dim() <= 4:
                    raise ValueError(f"parameter '{name}' has shape {list(p.shape)}: Muon takes "
                                     "2-D weights (3-D expert stacks, 4-D conv weights); put it in "
                                     "a use_muon=False group")
                if p.device.type != "cpu" and not apply:
                    raise ValueError(f"parameter '{name}' is on {p.device}: this optimizer "
                                     "updates CPU parameters (mode='apply' takes CUDA ones)")
        for name, p in zip(names, params):
            flat = p if getattr(p, "_fsdp_flattened", False) else getattr(p, "_base", None)
            if flat is not None and getattr(flat, "_fsdp_flattened", False):
                raise ValueError(
                    f"parameter '{name}' belongs to a FullyShardedDataParallel FlatParameter: "
                    "FSDP is not supported (it flattens and shards the weight matrices itself, "
                    "where muond needs each whole matrix and its gradient as backward produces "
                    "it); shard with MuonWithAuxAdam's own zero_stage (1, 2 or 3), optionally "
                    "under DistributedDataParallel (README, \"Streaming and gradient edits\")")
        if group["use_muon"] or apply:
            for name, p in zip(names, params):
                if not p.is_contiguous():
                    raise ValueError(f"parameter '{name}' is not contiguous")
        super().add_param_group(group)

    def _job_config(self, compute_dtype, fp32_iterations=0):
        groups = [g for g in self.param_groups if g["use_muon"]]
        if not groups:
            return None
        first = groups[0]
        for g in groups[1:]:
            for k in JOB_KEYS:
                if g[k] != first[k]:
                    raise ValueError(f"Muon groups disagree on '{k}' ({first[k]!r} vs {g[k]!r}); "
                                     "it configures the one muond job, only lr and weight_decay "
                                     "may differ per group")
        if first["ns_method"] not in reference.NS_METHODS:
            raise ValueError(f"unknown ns_method '{first['ns_method']}'")
        if self.backend == "local" and compute_dtype != "float32":
            raise ValueError("backend='local' computes in float32; compute_dtype "
                             f"'{compute_dtype}' applies to muond only")
        if (isinstance(fp32_iterations, bool) or not isinstance(fp32_iterations, int)
                or not 0 <= fp32_iterations <= int(first["ns_steps"])):
            raise ValueError(f"fp32_iterations must be an integer in 0..ns_steps "
                             f"({int(first['ns_steps'])}), got {fp32_iterations!r}")
        config = {"momentum": float(first["momentum"]), "nesterov": bool(first["nesterov"]),
                  "ns_method": first["ns_method"], "ns_steps": int(first["ns_steps"]),
                  "compute_dtype": compute_dtype, "scale_mode": first["scale_mode"]}
        if fp32_iterations:
            config["fp32_iterations"] = fp32_iterations
        return config

    def _job_spec(self):
        dtypes = {p.dtype for _, p in self._muon}
        if len(dtypes) != 1:
            raise ValueError(f"the Muon parameters have dtypes {sorted(map(str, dtypes))}; a muond "
                             "job with a ZeRO partition takes one dtype")
        matrices = []
        for g, p in self._muon:
            m = {"name": self._names[p], "shape": list(p.shape), "dtype": dtype_name(p.dtype)}
            if g["num_heads"] != 1:
                m["num_heads"] = int(g["num_heads"])
            matrices.append(m)
        spec = {"job_id": self.job_id, "world_size": self.world_size,
                "zero_stage": self.zero_stage, "muon": self.muon_config, "matrices": matrices}
        if self._clip_norm > 0:
            spec["max_grad_norm"] = self._clip_norm
        return spec

    def _create_job(self):
        """Rank 0: the job's token (creating the job unless a token was given)."""
        self.client.health(5.0)  # "muond at ADDRESS is not reachable" beats a failed CreateJob
        return self.token if self.token is not None else self.client.create_job(self.spec)

    def _attach(self, takeover):
        self.spec["job_id"] = self.job_id
        self.session = self.client.attach(self.job_id, self.rank, self.token, takeover,
                                          self.transport)
        if tuple(self.session.spans) != tuple(self.partition.spans):
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"job '{self.job_id}' rank {self.rank}: the daemon's layout differs "
                             "from this optimizer's parameters (another model or world size?)",
                             "attach")
        self.step_id = self.session.next_step
        if self.mode == "apply":
            if self.offload is not None:
                self.offload.close()
            self.offload = ParameterOffload(self.session, self.partitions, self.rank,
                                            [p for _, p in self._job_tensors], self.process_group,
                                            self._dist, self.reduce_gradients)
        elif self.session.is_shm:
            self._grad_buffers = self._update_buffers = None
        else:
            self._grad_buffers = torch.zeros(self.partition.buffer_elements, dtype=self.dtype)
            self._update_buffers = torch.zeros(self.partition.buffer_elements, dtype=self.dtype)
        self._make_stream()

    def _make_stream(self):
        if self._stream is not None:
            self._stream.remove()
        params = [p for _, p in self._job_tensors]
        apply = self.mode == "apply"
        self._stream = GradientStream(self.session, self.partitions, self.rank, params,
                                      self.process_group, self._dist, dtype=self.dtype,
                                      reduce=self.reduce_gradients, mean=not apply,
                                      bucket_bytes=self.bucket_bytes, zero_missing=apply)
        s = self.session
        if s.is_shm:
            view = (lambda t: self.offload._pinned(s.gradient_view(t, self.dtype))) if apply \
                else (lambda t: s.gradient_view(t, self.dtype))
        else:
            view = (lambda t: self.offload._host_grads) if apply else \
                (lambda t: self._grad_buffers)
        self._stream.set_buffer(view)
        self._stream.route(self._ddp_routed)
        self._stream.on_first_post = self._send_hyper if apply else None
        if self.stream:
            self._stream.install()
            self._arm()

    def _arm(self):
        """The next backward streams step step_id, unless the step is delayed or accumulating."""
        st = self._stream
        self._sent_hyper = None  # apply mode: what the armed step's first part carried
        if st is None or not self.stream:
            return
        delayed = self.delay and self._steps_taken >= self.delay_warmup
        # Apply mode: nothing streams before the initial weights are in (step() uploads them).
        # QK-Clip: a step's first part carries its max logits, so it streams only once they are
        # set (set_max_logits after the forward).
        qk_waiting = self._qk_order and self._max_logits is None
        if delayed or self._accumulating or self._upload_pending or qk_waiting:
            st.disarm()
        else:
            st.arm(self.step_id, shm=self.session.is_shm)

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
        mine = {id(p) for p in ddp_model.module.parameters()}
        self._ddp_routed = [i for i, (_, p) in enumerate(self._job_tensors) if id(p) in mine]
        ddp_model.register_comm_hook(ddp_model.process_group, self._ddp_comm_hook)
        if self._stream is not None:
            self._stream.route(self._ddp_routed)

    def _ddp_comm_hook(self, process_group, bucket):
        """DDP's default all-reduce hook, and the reduced bucket into the gradient stream."""
        group = process_group if process_group is not None else \
            torch.distributed.group.WORLD
        tensor = bucket.buffer()
        tensor.div_(group.size())
        params = bucket.parameters()
        stream = self._stream

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

    def accumulating(self):
        """Context manager: backward passes inside it accumulate gradients without streaming them
        (all micro-batches of a step but the last)."""
        opt = self

        class _Accumulating:
            def __enter__(self):
                opt._accumulating += 1
                if opt._stream is not None:
                    opt._stream.disarm()
                return opt

            def __exit__(self, *exc):
                opt._accumulating -= 1
                if not opt._accumulating:
                    opt._arm()
                return False

        return _Accumulating()

    def _detach(self):
        """Installs a delayed step in flight, then ends the rank's session (and its CUDA
        registrations). The gradient hooks stay: a new attach re-makes them."""
        if self.session is not None:
            self.drain()
        if self.offload is not None:
            self.offload.close()
            self.offload = None
        if self.session is not None:
            self.session.close()
            self.session = None

    def close(self, delete_job=False):
        """Detaches this rank; with delete_job, rank 0 deletes the job (after all ranks detached).
        A delayed step in flight is installed first."""
        self._detach()
        if self._stream is not None:
            self._stream.remove()
            self._stream = None
        if delete_job and self.client is not None:
            self.ranks.barrier()
            if self.rank == 0:
                self.client.delete_job(self.job_id, self.token)
        if self.client is not None:
            self.client.close()
            self.client = None

    # ----- the step -----

    def _require_gradients(self, pairs, kind):
        """Raises on every rank (a collective) when a parameter of `pairs` has no gradient on any
        rank: every rank must stop here, or the others would wait for it in a collective."""
        missing = [self._names[p] for _, p in pairs if p.grad is None]
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

    def _gradients(self):
        """Averaged gradients of (muon, adam) parameters, without changing p.grad."""
        self._require_gradients(self._muon, "Muon")
        muon = [p.grad for _, p in self._muon]
        adam = [p.grad for _, p in self._adam]  # None: skipped, as torch.optim.AdamW does
        if not (self.reduce_gradients and self.world_size > 1):
            return muon, adam
        # p.grad stays untouched, so a failed step can be retried.
        present = [g for g in muon + adam if g is not None]
        reduced = {id(g): r for g, r in zip(present, all_reduce_mean(present,
                                                                     self.process_group))}
        return ([reduced[id(g)] for g in muon],
                [None if g is None else reduced[id(g)] for g in adam])

    def _adam_gradients(self):
        """The AdamW parameters' gradients, averaged over the ranks (new tensors; p.grad stays
        untouched, so a failed step can be retried)."""
        adam = [p.grad for _, p in self._adam]  # None: skipped, as torch.optim.AdamW does
        if not (self.reduce_gradients and self.world_size > 1):
            return adam
        present = [g for g in adam if g is not None]
        reduced = {id(g): r for g, r in zip(present, all_reduce_mean(present,
                                                                     self.process_group))}
        return [None if g is None else reduced[id(g)] for g in adam]

    def _session(self):
        if self.session is None:
            raise MuondError(CODES["FAILED_PRECONDITION"], f"job '{self.job_id}' rank {self.rank}: "
                             "not attached (closed, or a checkpoint load failed)", "step")
        return self.session

    def _delayed(self):
        return self.delay == 1 and self._steps_taken >= self.delay_warmup and \
            self._session().is_shm

    def _send_gradients(self, step, checked=False):
        """This rank's partition of the job tensors' gradients into the step's buffer (reduced
        over the ranks when asked), sent in parts as backward produced them when the stream was
        armed and every streamed gradient is still what left (checked: the caller made sure);
        returns True when the step went in parts (its last part posted)."""
        st = self._stream
        streamed = st.armed and st.step == step  # copied (shm: and posted) during backward
        parts = streamed and self.session.is_shm
        if streamed and not checked and self._stream_edited(st):
            self._fall_back(st)
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

    def _stream_edited(self, st, also=False):
        """Whether a streamed step must be sent whole, on every rank alike (one all-reduce with a
        process group): a gradient streamed during backward was edited before step() on some
        rank (GradientStream.edited), or `also` (another reason of this rank's) holds. Counts
        the fallback (stream_fallbacks) and warns once per run naming the first edited tensor."""
        edited = st.edited()
        mine = bool(edited) or bool(also)
        agreed = self.ranks.count(mine) > 0 if self.world_size > 1 else mine
        if edited and not self._edit_warned:
            self._edit_warned = True
            name = self._names[self._job_tensors[edited[0]][1]]
            what = f"streaming from the DDP hook failed ({st.fault_error!r})" \
                if st.fault_error is not None else \
                (f"the gradient of {name!r} changed between backward and step() after it was "
                 f"streamed to muond ({len(edited)} tensor(s) this step; e.g. clip_grad_norm_, "
                 "an unscale, DistributedDataParallel's reduction, p.grad = ..., a second "
                 "backward)")
            warnings.warn(
                f"muon_offload: {what}: the step is sent whole at step() instead, exact but not "
                "overlapped with backward; opt.stream_fallbacks counts such steps. To keep "
                "streaming, edit gradients through the optimizer's routes (README, \"Streaming "
                "and gradient edits\"): a DynamicLossScaler, max_grad_norm, "
                "opt.stream_ddp(ddp_model) under DistributedDataParallel, opt.accumulating() "
                "for earlier micro-batches",
                RuntimeWarning, stacklevel=4)
        if agreed:
            self.stream_fallbacks += 1
        return agreed

    def _fall_back(self, st):
        """Every rank drops the parts it streamed of the armed step together (the daemon refuses
        that try, nothing of it commits) before any sends the step whole."""
        st.abandon(everyone=True)
        self.ranks.barrier()

    def _post_whole(self, step):
        """Sends the step's whole gradient buffer without waiting (delayed mode)."""
        s = self.session
        s.post_part(step, 0, s.raw_view("gradient", step).numel(), last=True)

    def _muond_updates(self, step):
        """Sends this rank's partition of the Muon gradients and waits; returns (update view,
        EarlyResults or None): with one rank and a streamed step the updates were applied to
        the parameters span by span already."""
        s = self._session()
        parts = self._send_gradients(step)
        if parts and self.world_size == 1:
            early = EarlyResults(s, step, self.partition.spans,
                                 self._muon_span_user(s.update_view(step, self.dtype)))
            early.run()
            return s.update_view(step, self.dtype), early
        if parts:
            s.wait_parts(step)
        elif s.is_shm:
            s.step_in_place(step)
        else:
            s.step_buffer(step, self._grad_buffers, self._update_buffers)
            return self._update_buffers, None
        return s.update_view(step, self.dtype), None

    def _muon_span_user(self, update, hyper=None):
        """use(k, keep): applies span k of `update` (the rank's flat update buffer) to its
        parameters with its group's lr and weight decay (hyper: per Muon matrix, a delayed step's
        own); with keep, returns (view, old values) to restore."""
        params = [p for _, p in self._muon]
        groups = [g for g, _ in self._muon]

        def use(k, keep):
            matrix, offset, length, rank_offset = self.partition.spans[k]
            g = groups[matrix]
            lr, wd = (g["lr"], g["weight_decay"]) if hyper is None else hyper[matrix]
            view = params[matrix].view(-1)[offset:offset + length]
            old = view.clone() if keep else None
            self._apply(view, update[rank_offset:rank_offset + length], lr, wd)
            return (view, old) if keep else None
        return use

    @staticmethod
    def _apply(weight, update, lr, weight_decay):
        # W <- W * (1 - lr * wd) - lr * U, as separate roundings (no fused multiply-add) so that
        # a partition's elements and the whole matrix's get the same bits.
        if weight_decay:
            weight.mul_(1.0 - lr * weight_decay)
        weight.sub_(torch.mul(update, lr))

    @torch.no_grad()
    def _local_muon_step(self, grads):
        cfg = self.muon_config
        updates = []
        for (g, p), grad in zip(self._muon, grads):
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32)
            updates.append(reference.muon_update(
                grad, state["momentum_buffer"], cfg["momentum"], cfg["nesterov"],
                cfg["ns_method"], cfg["ns_steps"], cfg["scale_mode"], g["num_heads"]))
        for (g, p), u in zip(self._muon, updates):
            self._apply(p, u, g["lr"], g["weight_decay"])

    @torch.no_grad()
    def _install_muon(self, update, early=None, hyper=None):
        """This rank's partition of `update` into the parameters (unless `early` applied it
        already), then the all-gather of every rank's."""
        params = [p for _, p in self._muon]
        if early is None:
            use = self._muon_span_user(update, hyper)
            for k in range(len(self.partition.spans)):
                use(k, False)
        if self.world_size > 1:
            mine = torch.zeros(self.partition.buffer_elements, dtype=self.dtype)
            copy_into_buffer(mine, self.partition, params)
            all_gather_partitions(mine, self.partitions, self.rank, params, self.process_group)

    @torch.no_grad()
    def _adam_step(self, grads, hyper=None):
        """hyper: (lr, weight_decay) per AdamW parameter (delayed mode: its step's); None: the
        groups' now."""
        for j, ((g, p), grad) in enumerate(zip(self._adam, grads)):
            if grad is None:
                continue
            state = self.state[p]
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
            self._apply(p, m / (v.sqrt() + g["eps"]), lr, wd)

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
                if self.mode == "apply":
                    if self._job_tensors:
                        self._apply_mode_step(grad_divisor)
                elif self.backend == "local" or not self._job_tensors:
                    muon_grads, adam_grads = self._gradients()
                    if self._clip_norm > 0:  # muond's clipping, in-process
                        total = reference.sum_of_squares(list(muon_grads) + list(adam_grads))
                        muon_grads = self._clipped(muon_grads, total)
                        adam_grads = self._clipped(adam_grads, total)
                    if self._muon:
                        self._local_muon_step(muon_grads)
                    self._adam_step(adam_grads)
                else:
                    self._update_mode_step()
        except BaseException:
            # A step that failed with parts out (e.g. a gradient missing at step()): the daemon
            # drops them, and the retry of the step streams afresh.
            st = self._stream
            if st is not None and st.step == self.step_id and st._posted:
                st.abandon()
            self._arm()
            raise
        finally:
            self.last_step_stats = {"seconds": time.perf_counter() - t0}
        if not self.last_step_skipped:
            self._steps_taken += 1  # committed steps only: delay_warmup counts them
        self.step_id += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.last_step_skipped)
        self._max_logits = self._sent_max_logits = None  # each step carries its own
        self._arm()
        return loss

    def _outside_share(self, adam):
        """Update mode with max_grad_norm: the AdamW gradients' share of the norm goes with the
        step's last part. Every rank holds the same (reduced) AdamW gradients, so rank 0 counts
        them and the others send 0."""
        if self._clip_norm > 0:
            share = reference.sum_of_squares(adam) if self.rank == 0 else 0.0
            self._session().set_outside_sum_sq(share)

    def _clipped(self, grads, sum_sq=None):
        """Update mode with max_grad_norm: `grads` multiplied by the step's clip coefficient (new
        tensors; p.grad stays as it is, so a failed step can be retried), from the whole raw sum
        of squares muond returned (sum_sq: the local backend's)."""
        if self._clip_norm <= 0:
            return grads
        if sum_sq is None:
            sum_sq = self.session.last_step_sum_sq()
        self.last_grad_norm = math.sqrt(sum_sq)
        coef = reference.clip_coefficient(sum_sq, self._clip_norm)
        if coef >= 1.0:
            return grads
        return [None if g is None else g * torch.tensor(coef, dtype=g.dtype, device=g.device)
                for g in grads]

    def _update_mode_step(self):
        self._require_gradients(self._muon, "Muon")
        adam = self._adam_gradients()
        self._outside_share(adam)
        step = self.step_id
        if self._delayed():
            self._install_in_flight()
            st = self._stream
            st.arm(step, shm=False)
            st.finish()
            self._post_whole(step)
            self._delayed_rest = ([(g["lr"], g["weight_decay"]) for g, _ in self._muon],
                                  [None if g is None else g.clone() for g in adam],
                                  [(g["lr"], g["weight_decay"]) for g, _ in self._adam])
            self._in_flight = step
            return
        update, early = self._muond_updates(step)
        if self.session.last_step_skipped:  # every rank was told so; AdamW skips it too
            self.last_step_skipped = True
            return
        self._install_muon(update, early)
        self._adam_step(self._clipped(adam))
