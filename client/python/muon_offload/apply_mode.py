"""The trainer side of apply mode (DESIGN.md section 4b): muond holds the fp32 master weights, the
Muon momentum and the AdamW state of every parameter and returns new parameters; the trainer holds
only its model parameters (float32, bfloat16 or float16) and their gradients.

ParameterOffload moves one rank's data through one attached session:
  - upload_params(): the rank's partition of the parameters becomes its part of the masters;
  - push_step(): the gradients, reduce-scattered over the process group (each rank receives only
    the sum of its partition, written straight into the session's shared-memory gradient buffer
    or a flat buffer for gRPC), go to muond with the step's hyperparameters; the gradient divisor
    turns the sum into the mean there (in fp32: the ranks' sum is rounded once in the gradient
    dtype, and fp16 gradients must leave room for it, as dynamic loss scaling expects);
  - pull_params(): the new parameters of the partition, in the param dtype, are all-gathered
    into every rank's parameters.
Every rank's flat buffer has the same size P. The collectives exchange windows of it (window w
of every rank's buffer at once, zero.reduce_scatter_windows and all_gather_windows), so the
trainer's staging is two buffers of about P elements, whatever the world size: ZeRO's memory, not
a model-sized world buffer. A loss scale that overflows the sum refuses the step as non-finite, or
skips it with "nonfinite": "skip".

Parameters on a CUDA device: the session's shared-memory buffers are registered with CUDA
(cudaHostRegister) so the copies between the device and them are asynchronous DMA; the staging
buffers of the collectives live on the device (NCCL). REQUIRES: contiguous parameters.

Parameters of several dtypes (bfloat16 weights with float32 norms, say): a flat buffer holds one
dtype, so their gradients and new parameters travel as float32 (wire_dtype), converted on the
copies into and out of the buffers (exact for gradients; new bfloat16 / float16 parameters are
rounded to nearest even from the float32 masters, as muond rounds them). The cost is the bytes:
2x for the half-precision tensors of such a model; a model of one dtype moves in its own.

Thread-safety: none; one step at a time, as the session. Collectives: upload_params() and step()
are called by every rank of the group in the same order.
"""
import torch

from ._native import CODES, MuondError
from .cuda_pinning import CudaRuntimeRegistrar, PinnedHostRanges
from .zero import (all_gather_windows, copy_from_buffer, copy_into_buffer,
                   reduce_scatter_windows, window_elements)

DEFAULT_ADAMW = {"betas": (0.9, 0.95), "eps": 1e-10}


def wire_dtype(params):
    """The dtype the parameters' gradients and new values travel in: their own when they share
    one, else float32 (every dtype muond takes converts to it exactly)."""
    dtypes = {p.dtype for p in params}
    return next(iter(dtypes)) if len(dtypes) == 1 else torch.float32


def group_name(index):
    """The job's name of parameter group `index` (its lr and weight_decay travel under it)."""
    return f"group{index}"


def _adamw_config(adam_groups):
    if not adam_groups:
        return dict(DEFAULT_ADAMW)

    def config(g):
        return {"betas": tuple(float(b) for b in g["betas"]), "eps": float(g["eps"])}

    first = config(adam_groups[0])
    for g in adam_groups[1:]:
        if config(g) != first:
            raise ValueError(f"AdamW groups disagree on betas/eps ({first} vs {config(g)}); in "
                             "apply mode they configure the one muond job, only lr and "
                             "weight_decay may differ per group")
    return first


def apply_job_spec(job_id, world_size, zero_stage, muon_config, param_groups, names,
                   max_grad_norm=None, init_from=None):
    """The job.json (dict) of an apply-mode job for MuonWithAuxAdam's param_groups: every
    parameter a tensor in group order (optimizer "muon" for use_muon groups, else "adamw"), one
    job group per param group (group_name(i)) with its lr and weight_decay, the AdamW betas/eps
    (one per job). `names` maps each parameter to its name. Every tensor's dtype and param_dtype
    are wire_dtype() of the parameters (float32 for a model of several dtypes). ValueError for a
    dtype muond does not take."""
    from .client import dtype_name
    tensors = []
    params = []
    for i, g in enumerate(param_groups):
        for p in g["params"]:
            if not p.requires_grad:
                continue  # frozen: not optimized, not a job tensor
            dtype_name(p.dtype)  # ValueError naming a dtype muond does not take
            t = {"name": names[p], "shape": list(p.shape),
                 "optimizer": "muon" if g["use_muon"] else "adamw", "group": group_name(i)}
            if g["use_muon"] and g["num_heads"] != 1:
                t["num_heads"] = int(g["num_heads"])
            tensors.append(t)
            params.append(p)
    wire = dtype_name(wire_dtype(params)) if params else "float32"
    for t in tensors:
        t["dtype"] = t["param_dtype"] = wire
    adamw = _adamw_config([g for g in param_groups if not g["use_muon"]])
    spec = {"job_id": job_id, "mode": "apply", "world_size": int(world_size),
            "zero_stage": int(zero_stage), "tensors": tensors,
            "groups": [{"name": group_name(i), "lr": float(g["lr"]),
                        "weight_decay": float(g["weight_decay"])}
                       for i, g in enumerate(param_groups)],
            "adamw": {"betas": list(adamw["betas"]), "eps": adamw["eps"]}}
    if muon_config is not None:
        spec["muon"] = dict(muon_config)
    if max_grad_norm is not None:
        spec["max_grad_norm"] = float(max_grad_norm)
    if init_from is not None:
        spec["init_from"] = str(init_from)
    return spec


class ParameterOffload:
    """One rank's parameters whose optimizer lives in muond (see the module comment).

    session: the rank's attached client.Session of an apply-mode job; partitions: every rank's
    zero.Partition (rank order); params: the job's tensors in job order (the model's parameters,
    updated in place); process_group, distributed: the torch.distributed group of the ranks and
    the torch.distributed module (None: one rank without torch.distributed); reduce_gradients:
    sum the ranks' gradients (False: every rank holds the reduced gradients already, e.g. from
    DistributedDataParallel, and sends its partition of them). Buffers and collectives are in
    wire_dtype(params).
    """

    def __init__(self, session, partitions, rank, params, process_group=None, distributed=None,
                 reduce_gradients=True):
        self.session = session
        self.partitions = partitions
        self.partition = partitions[rank]
        self.rank = rank
        self.params = list(params)
        self.dtype = wire_dtype(self.params)
        self.device = self.params[0].device
        self.group = process_group
        self._dist = distributed if len(partitions) > 1 else None
        self._reduce = reduce_gradients and self._dist is not None
        self._cuda = self.device.type == "cuda"
        self._pins = None  # PinnedHostRanges of the shared-memory buffers (CUDA only)
        size = self.partition.buffer_elements
        self._check_param_layout()
        kw = dict(dtype=self.dtype, device=self.device)
        # Staging (no optimizer state), of the rank's own partition size, not the model's: the
        # collectives run in windows (zero.reduce_scatter_windows, all_gather_windows) through a
        # send and a receive buffer of world * window <= P + world elements each; on a device also
        # the partition that crosses to and from host memory.
        world = len(partitions)
        staging = world * window_elements(size, world) if self._dist else 0
        self._send = torch.zeros(staging, **kw) if self._dist else None
        self._recv = torch.zeros(staging, **kw) if self._dist else None
        self._device_part = torch.zeros(size, **kw) if self._cuda and self._dist else None
        if session.is_shm:
            self._host_grads = self._host_params = None
        else:
            pin = self._cuda
            self._host_grads = torch.zeros(size, dtype=self.dtype, pin_memory=pin)
            self._host_params = torch.zeros(size, dtype=self.dtype, pin_memory=pin)

    def workspace_bytes(self):
        """Bytes of the staging buffers this object allocated (not optimizer state: nothing here
        outlives a step's meaning)."""
        bufs = (self._send, self._recv, self._device_part, self._host_grads, self._host_params)
        return sum(b.numel() * b.element_size() for b in bufs if b is not None)

    def _check_param_layout(self):
        # The collectives exchange element-for-element flat buffers: the daemon must place each
        # span's parameters where its gradients are (true when every tensor has one dtype). The
        # gRPC flat buffers are that layout by definition; shared memory says where it put them.
        if not self.session.is_shm:
            return
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        want = tuple(rank_offset * itemsize for _, _, _, rank_offset in self.session.spans)
        got = tuple(self.session.param_offsets())
        if got != want:
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"job '{self.session.job_id}' rank {self.rank}: the daemon places the "
                             f"parameters at byte offsets {got[:4]}..., not the gradients' layout "
                             f"{want[:4]}... (tensors of several param dtypes?)", "attach")

    # ----- CUDA registration -----

    def _pinned(self, view, read_only=False):
        """`view` (a shared-memory buffer of the session) registered with CUDA, so that device
        copies to and from it are asynchronous; a view CUDA refused still works, with
        synchronous copies (cuda_pinning warns once). The two buffers of the view's kind
        (gradient: writable, update: read-only, cudaHostRegisterReadOnly) are back to back in one
        mapping and share a page: they are registered as one range, so that no view straddles
        two registrations."""
        if not self._cuda or view.numel() == 0:
            return view
        if self._pins is None:
            self._pins = PinnedHostRanges(CudaRuntimeRegistrar())
        kind = "update" if read_only else "gradient"
        first, second = (self.session.raw_view(kind, step) for step in (0, 1))
        size = first.numel()
        if size and second.data_ptr() == first.data_ptr() + size:
            self._pins.pin(first.data_ptr(), 2 * size, read_only)
        self._pins.pin(view.data_ptr(), view.numel() * view.element_size(), read_only)
        return view

    def close(self):
        """Unregisters from CUDA what _pinned registered (before the session unmaps the
        buffers), and nothing else."""
        if self._pins is not None:
            self._pins.release()
            self._pins = None

    def _sync(self):
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    # ----- initial weights -----

    def upload_params(self):
        """This rank's partition of the parameters, in their dtype, becomes its part of muond's
        master weights (before step 0; replaces what the rank uploaded before)."""
        s = self.session
        if s.is_shm:
            view = self._pinned(s.init_view(self.dtype))
            copy_into_buffer(view, self.partition, self.params, non_blocking=self._cuda)
            self._sync()
            s.init_params_in_place()
        else:
            copy_into_buffer(self._host_grads, self.partition, self.params, non_blocking=self._cuda)
            self._sync()
            s.init_params_buffer(self._host_grads, float32=self.dtype == torch.float32)

    # ----- one step -----

    def push_step(self, step, grads, hyper):
        """Reduce-scatters `grads` (one per job tensor, the parameters' dtype) into this rank's
        gradient buffer, sends the step with `hyper` = (groups, lr, weight_decay, grad_divisor[,
        absent])
        and returns the flat buffer holding the rank's new parameters. A collective over the
        group up to the muond call; raises MuondError when muond refuses the step (nothing in the
        trainer changed)."""
        s = self.session
        s.set_hyper(*hyper)
        host = self._pinned(s.gradient_view(step, self.dtype)) if s.is_shm else self._host_grads
        self._reduce_gradients(grads, host)
        if s.is_shm:
            s.step_in_place(step)
            return self._pinned(s.update_view(step, self.dtype), read_only=True)
        s.step_buffer(step, host, self._host_params)
        return self._host_params

    def _reduce_gradients(self, grads, host):
        if not self._reduce:
            copy_into_buffer(host, self.partition, grads, non_blocking=self._cuda)
        else:
            target = self._device_part if self._cuda else host
            reduce_scatter_windows(self.partitions, grads, target, self._send, self._recv,
                                   self.group)
            if self._cuda:
                host.copy_(target, non_blocking=True)
        self._sync()

    def pull_params(self, new_params):
        """Every rank's new parameters into the model: this rank's from `new_params` (what
        push_step returned), the others' by an all-gather (a collective)."""
        if self._dist is None:
            copy_from_buffer(new_params, self.partition, self.params, non_blocking=self._cuda)
        else:
            mine = new_params
            if self._cuda:
                mine = self._device_part.copy_(new_params, non_blocking=True)
            all_gather_windows(self.partitions, mine, self.params, self._send, self._recv,
                               self.group)
        self._sync()
