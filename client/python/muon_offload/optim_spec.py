"""MuonWithAuxAdam's arguments checked and its muond job spec built, with no I/O: nothing here
connects to a daemon, creates a job or attaches shared memory, so every refusal of a bad argument
comes before any of that (as a tensorstore spec is validated before a driver opens). The
optimizer (optim.py) runs: OptimizerOptions (the keyword arguments) -> normalize_group (each
param group, through torch's add_param_group) -> job_config -> plan_job (the spec, the ZeRO
partitions, the buffers' dtype) -> open the job (optim_job.py).
"""
import math
import numbers

import torch

from . import reference
from .apply_mode import apply_job_spec, wire_dtype
from .client import dtype_name
from .qk_clip import job_block as qk_clip_job_block
from .streaming import DEFAULT_BUCKET_BYTES
from .zero import job_partitions

MUON_KEYS = {"lr": 0.02, "weight_decay": 0.0, "momentum": 0.95, "nesterov": True, "ns_steps": 5,
             "ns_method": "standard", "adjust_lr_fn": None, "scale_mode": None, "num_heads": 1}
ADAM_KEYS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
# Muon keys that configure the muond job (one per job), not the trainer-side update.
JOB_KEYS = ("momentum", "nesterov", "ns_steps", "ns_method", "scale_mode")


class OptimizerOptions:
    """MuonWithAuxAdam's keyword arguments (see its docstring), checked; ValueError for a bad one.
    Fields: the arguments as given, but nonfinite (None resolved: "skip" with a loss_scaler, else
    "refuse"), delay, delay_warmup and bucket_bytes (ints), grad_divisor (float), stream (False
    with backend "local"), predict (False unless delay is 1) and clip_norm (update mode's
    max_grad_norm as a float, 0.0 when off or in apply mode, where muond clips by the spec) and
    state (the job's "state" block from momentum_dtype and adamw_state_dtype, None for fp32)."""

    def __init__(self, *, backend="muond", address=None, job_id=None, token=None,
                 process_group=None, zero_stage=None, transport="auto", compute_dtype="float32",
                 reduce_gradients=None, takeover=False, mode="update", max_grad_norm=None,
                 init_from=None, grad_divisor=1.0, fp32_iterations=0, stream=True,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, delay=0, delay_warmup=10, predict=True,
                 nonfinite=None, loss_scaler=None, qk_clip=None, momentum_dtype="float32",
                 adamw_state_dtype="float32"):
        _check_modes(backend, mode, init_from, qk_clip)
        self.state = _check_state_dtypes(backend, mode, momentum_dtype, adamw_state_dtype)
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
        self.nonfinite = _check_nonfinite(nonfinite, loss_scaler, mode, delay)
        self.backend, self.mode, self.address, self.job_id = backend, mode, address, job_id
        self.token, self.process_group, self.zero_stage = token, process_group, zero_stage
        self.transport, self.compute_dtype = transport, compute_dtype
        self.reduce_gradients, self.takeover = reduce_gradients, takeover
        self.max_grad_norm, self.init_from = max_grad_norm, init_from
        self.grad_divisor = float(grad_divisor)
        self.fp32_iterations = fp32_iterations
        self.stream = bool(stream) and backend == "muond"
        self.bucket_bytes = int(bucket_bytes)
        self.delay, self.delay_warmup = int(delay), int(delay_warmup)
        self.predict = bool(predict) and self.delay == 1
        self.loss_scaler, self.qk_clip = loss_scaler, qk_clip
        self.clip_norm = float(max_grad_norm or 0.0) if mode == "update" else 0.0


STATE_DTYPES = ("float32", "bfloat16", "int8")


def _check_state_dtypes(backend, mode, momentum_dtype, adamw_state_dtype):
    """The job's "state" block (how muond holds Muon's momentum and, in apply mode, AdamW's
    moments), or None when both are float32."""
    for name, value in (("momentum_dtype", momentum_dtype),
                        ("adamw_state_dtype", adamw_state_dtype)):
        if value not in STATE_DTYPES:
            raise ValueError(f"{name} must be one of {', '.join(STATE_DTYPES)}, not {value!r}")
    if momentum_dtype == "float32" and adamw_state_dtype == "float32":
        return None
    if backend != "muond":
        raise ValueError("momentum_dtype and adamw_state_dtype choose how muond holds the "
                         "state; backend='local' holds it in float32")
    if mode != "apply" and adamw_state_dtype != "float32":
        raise ValueError("adamw_state_dtype applies to mode='apply' only (in update mode the "
                         "AdamW moments stay with the trainer's torch.optim.AdamW)")
    return {"momentum_dtype": momentum_dtype, "adamw_dtype": adamw_state_dtype}


def _check_modes(backend, mode, init_from, qk_clip):
    if backend not in ("muond", "local"):
        raise ValueError(f"backend must be 'muond' or 'local', not '{backend}'")
    if mode not in ("update", "apply"):
        raise ValueError(f"mode must be 'update' or 'apply', not '{mode}'")
    if mode == "apply" and backend != "muond":
        raise ValueError("mode='apply' runs the optimizer in muond; the in-process reference "
                         "of apply mode is muon_offload.reference.ApplyReference")
    if mode == "update" and (init_from is not None or qk_clip is not None):
        raise ValueError("init_from and qk_clip apply to mode='apply' only")


def _check_nonfinite(nonfinite, loss_scaler, mode, delay):
    """nonfinite resolved (None: "skip" with a loss_scaler, else "refuse") and checked."""
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
    return nonfinite


def scale_mode(group):
    """A Muon group's scale mode from adjust_lr_fn and scale_mode (they must agree)."""
    adjust, mode = group.get("adjust_lr_fn"), group.get("scale_mode")
    if adjust is not None and mode is not None and adjust != mode:
        raise ValueError(f"adjust_lr_fn '{adjust}' and scale_mode '{mode}' disagree")
    mode = mode or adjust or "original"
    if mode not in reference.SCALE_MODES:
        raise ValueError(f"unknown adjust_lr_fn/scale_mode '{mode}' "
                         f"(accepted: {', '.join(reference.SCALE_MODES)})")
    return mode


def _real(value):
    """A finite real number (a Python or numpy number, or a one-element tensor), not a bool."""
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, (numbers.Real, torch.Tensor)):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, RuntimeError):
        return False


def check_hyperparameters(group, index):
    """lr and weight_decay finite numbers >= 0 (as muond and torch.optim take them); an AdamW
    group's betas two numbers in [0, 1) and eps a finite number >= 0."""
    where = f"group {index} (use_muon={group['use_muon']})"
    for key in ("lr", "weight_decay"):
        if not _real(group[key]) or group[key] < 0:
            raise ValueError(f"{where}: {key} must be a finite number >= 0, not {group[key]!r}")
    if group["use_muon"]:
        return
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or \
            not all(_real(b) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), not {betas!r}")
    if not _real(group["eps"]) or group["eps"] < 0:
        raise ValueError(f"{where}: eps must be a finite number >= 0, not {group['eps']!r}")


def normalize_group(param_group, index, apply):
    """A param group as MuonWithAuxAdam keeps it: params a list, param_names (from (name, param)
    pairs, or groupI.paramJ), every hyperparameter present (defaults), the Muon group's
    scale_mode resolved. ValueError for what the job cannot take (see the checks' messages).
    `apply`: the optimizer's mode is "apply"."""
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
    check_hyperparameters(group, index)
    if group["use_muon"]:
        group["scale_mode"] = scale_mode(group)
    _check_params(group, names, params, apply)
    return group


def _check_params(group, names, params, apply):
    if group["use_muon"]:
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


def job_config(param_groups, backend, compute_dtype, fp32_iterations=0):
    """The spec's "muon" block from the Muon groups (None without any), which must agree on
    JOB_KEYS."""
    groups = [g for g in param_groups if g["use_muon"]]
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
    if backend == "local" and compute_dtype != "float32":
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


def update_job_spec(job_id, world_size, zero_stage, muon_config, muon, names, clip_norm=0.0):
    """The job.json (dict) of an update-mode job: the Muon matrices `muon` ((group, param)
    pairs) in order, of one dtype."""
    dtypes = {p.dtype for _, p in muon}
    if len(dtypes) != 1:
        raise ValueError(f"the Muon parameters have dtypes {sorted(map(str, dtypes))}; a muond "
                         "job with a ZeRO partition takes one dtype")
    matrices = []
    for g, p in muon:
        m = {"name": names[p], "shape": list(p.shape), "dtype": dtype_name(p.dtype)}
        if g["num_heads"] != 1:
            m["num_heads"] = int(g["num_heads"])
        matrices.append(m)
    spec = {"job_id": job_id, "world_size": world_size, "zero_stage": zero_stage,
            "muon": muon_config, "matrices": matrices}
    if clip_norm > 0:
        spec["max_grad_norm"] = clip_norm
    return spec


class JobPlan:
    """What the job is, before it exists: spec (the job.json dict), qk_order (QK-Clip's (q, heads)
    pairs in job order, () without), partitions (every rank's ZeRO partition) and dtype (what the
    flat buffers hold)."""

    def __init__(self, spec, qk_order, partitions, dtype):
        self.spec, self.qk_order, self.partitions, self.dtype = spec, qk_order, partitions, dtype


def plan_job(options, job_id, world_size, zero_stage, muon_config, param_groups, names,
             tensors):
    """The JobPlan of a job `job_id` over `tensors` ((group, param) pairs in job order: the Muon
    matrices, or in apply mode every parameter that is not frozen). Pure: layout_spans is the
    client library's computation, no daemon."""
    if options.mode == "apply":
        spec = apply_job_spec(job_id, world_size, zero_stage, muon_config, param_groups, names,
                              options.max_grad_norm, options.init_from)
        dtype = wire_dtype([p for _, p in tensors])  # apply mode moves several dtypes as fp32
    else:
        spec = update_job_spec(job_id, world_size, zero_stage, muon_config, tensors, names,
                               options.clip_norm)
        dtype = tensors[0][1].dtype
    if options.nonfinite == "skip":
        spec["nonfinite"] = "skip"
    # A shared-memory rank's buffers: one of each. Step t's results are taken (installed and
    # synchronized) before step t+1's gradients are written into the region, also in the delayed
    # mode: its step() of t+1 installs step t first (DelayedUpdates.install_in_flight), and the
    # overlap is step t's compute with the forward and backward of t+1, whose gradients stay in
    # the parameters' .grad until then (README, "Memory").
    spec["step_buffers"] = 1
    if options.state is not None:
        spec["state"] = dict(options.state)
    qk_order = ()
    if options.qk_clip is not None:
        spec["qk_clip"], qk_order = qk_clip_job_block(options.qk_clip, names)
    return JobPlan(spec, qk_order, job_partitions(spec), dtype)
