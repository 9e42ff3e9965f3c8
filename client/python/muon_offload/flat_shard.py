"""Apply mode for a trainer whose model is already sharded flat (ZeRO stage 3 in the trainer):
FSDP with use_orig_params=False wrapping the optimized parameters in one unit, or DeepSpeed stage
3's flat partitions. Such a rank holds neither whole parameters nor whole gradients, only

  - its shard of the flat parameter: the parameters flattened and concatenated in order, zero
    padded to a multiple of the world size W, split in W equal pieces of P = ceil(total / W)
    elements; rank r holds elements [r * P, (r + 1) * P);
  - the same shard of the ranks' averaged gradient (what the sharded framework's reduce-scatter
    leaves in flat_param.grad).

That is exactly a muond job's ZeRO stage 1/2 partition of the same tensors in the same order
(zero.py), so the shard is the rank's flat buffer: FlatShardOptimizer sends the gradient shard
as it is, muond reassembles each whole matrix for Newton-Schulz (it owns every rank's piece), and
the new parameters of the shard come back in place. No collective runs in the trainer (the
framework all-gathers the parameters for its forward pass, as it always does) and the trainer
holds no optimizer state and no model-sized buffer.

torch 1.13's FSDP cannot be imported under Python 3.11 (a dataclass in
torch.distributed._shard.sharded_tensor.metadata has a mutable default), so the tests build the
same flat layout by hand (flat_shard_test.py).

Thread-safety: none; one step at a time. Every rank of the job calls step() for each step.
"""
import torch

from ._native import CODES, MuondError
from .apply_mode import group_name
from .client import Client
from .rank_group import RankGroup
from .zero import job_partitions


class FlatShardOptimizer(torch.optim.Optimizer):
    """muond apply mode on this rank's shard of a flat parameter (see the module comment).

    flat_param: the rank's shard, a contiguous 1-D CPU tensor of P elements (float32, bfloat16
    or float16); its .grad the rank's shard of the averaged gradient. tensors: the flat
    parameter's tensors in order, dicts {"name", "shape", "use_muon"} and optional "group"
    (index into `groups`, default 0 for Muon tensors and 1 for the others) and "num_heads".
    groups: the param groups as dicts with "lr" and "weight_decay" (LR schedulers change them);
    group 0 holds flat_param for torch.optim's bookkeeping, the others hold no tensor.
    process_group: the sharding group (its rank and size are the shard's). The job is created by
    rank 0 with ZeRO stage 2 over these tensors; rank r's buffer is its shard. grad_divisor:
    divides the gradient in muond (the loss scale; 1 when the shard holds the mean already).
    """

    def __init__(self, flat_param, tensors, groups, address, job_id=None, process_group=None,
                 transport="auto", muon=None, betas=(0.9, 0.95), eps=1e-8, grad_divisor=1.0,
                 token=None):
        if flat_param.dim() != 1 or not flat_param.is_contiguous() or \
                flat_param.device.type != "cpu":
            raise ValueError("flat_param must be this rank's contiguous 1-D CPU shard")
        param_groups = [dict(g, params=[flat_param] if i == 0 else [])
                        for i, g in enumerate(groups)]
        super().__init__(param_groups, {})
        self.flat_param = flat_param
        self.dtype = flat_param.dtype
        self.ranks = RankGroup(process_group)
        self.rank, self.world_size = self.ranks.rank, self.ranks.size
        self.grad_divisor = float(grad_divisor)
        self.step_id = 0
        self.spec = self._spec(tensors, groups, muon, betas, eps)
        self.partition = job_partitions(self.spec)[self.rank]
        self._check_layout(tensors)
        self.client = Client(address)
        self.job_id = self.ranks.on_rank0(lambda: job_id or self.spec["job_id"])
        self.spec["job_id"] = self.job_id
        self.token = self.ranks.on_rank0(
            lambda: token if token is not None else self.client.create_job(self.spec))
        self.session = self.client.attach(self.job_id, self.rank, self.token,
                                          transport=transport)
        self.step_id = self.session.next_step
        if self.step_id == 0:
            self.ranks.all_ranks(self._upload)
        if not self.session.is_shm:
            self._out = torch.empty(self.partition.buffer_elements, dtype=self.dtype)

    def _spec(self, tensors, groups, muon, betas, eps):
        import uuid

        from .client import dtype_name
        wire = dtype_name(self.dtype)
        spec_tensors = []
        for t in tensors:
            g = int(t.get("group", 0 if t["use_muon"] else 1))
            if not 0 <= g < len(groups):
                raise ValueError(f"tensor '{t['name']}': group {g} of {len(groups)} groups")
            e = {"name": t["name"], "shape": [int(d) for d in t["shape"]], "dtype": wire,
                 "param_dtype": wire, "optimizer": "muon" if t["use_muon"] else "adamw",
                 "group": group_name(g)}
            if t.get("num_heads", 1) != 1:
                e["num_heads"] = int(t["num_heads"])
            spec_tensors.append(e)
        spec = {"job_id": f"flat-{uuid.uuid4().hex[:16]}", "mode": "apply",
                "world_size": self.world_size, "zero_stage": 2, "tensors": spec_tensors,
                "groups": [{"name": group_name(i), "lr": float(g["lr"]),
                            "weight_decay": float(g["weight_decay"])}
                           for i, g in enumerate(groups)],
                "adamw": {"betas": [float(b) for b in betas], "eps": float(eps)}}
        if muon:
            spec["muon"] = dict(muon)
        return spec

    def _check_layout(self, tensors):
        """The job's partition of this rank must be the shard: span k of matrix m at rank offset
        ro is flat element rank * P + ro."""
        size = self.partition.buffer_elements
        if self.flat_param.numel() != size:
            raise ValueError(f"rank {self.rank}: the shard has {self.flat_param.numel()} "
                             f"elements; a flat parameter of these tensors split over "
                             f"{self.world_size} ranks has {size} per rank")
        starts, at = [], 0
        for t in self.spec["tensors"]:
            starts.append(at)
            at += _numel(t["shape"])
        for matrix, offset, length, rank_offset in self.partition.spans:
            if starts[matrix] + offset != self.rank * size + rank_offset:
                raise ValueError(f"rank {self.rank}: tensor '{tensors[matrix]['name']}' is not "
                                 "where a flat parameter puts it")

    def _upload(self):
        s = self.session
        if s.is_shm:
            s.init_view(self.dtype)[:self.flat_param.numel()].copy_(self.flat_param.detach())
            s.init_params_in_place()
        else:
            s.init_params_buffer(self.flat_param.detach().contiguous(),
                                 float32=self.dtype == torch.float32)

    def _hyper(self):
        return ([group_name(i) for i in range(len(self.param_groups))],
                [g["lr"] for g in self.param_groups],
                [g["weight_decay"] for g in self.param_groups], self.grad_divisor)

    @torch.no_grad()
    def step(self, closure=None):
        """One step: the shard's gradient to muond, the shard's new parameters back. MuondError
        (on every rank) when a rank has no gradient or muond refuses the step; nothing changed."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad = self.flat_param.grad

        def check():
            if grad is None or grad.shape != self.flat_param.shape or grad.dtype != self.dtype:
                raise MuondError(CODES["INVALID_ARGUMENT"], f"rank {self.rank}: the flat "
                                 f"parameter's gradient is {None if grad is None else grad.shape}"
                                 f", not its shard of {self.flat_param.numel()} elements", "step")
        self.ranks.all_ranks(check)
        s, step = self.session, self.step_id
        s.set_hyper(*self._hyper())
        if s.is_shm:
            s.gradient_view(step, self.dtype)[:grad.numel()].copy_(grad)
            s.step_in_place(step)
            new = s.update_view(step, self.dtype)[:grad.numel()]
        else:
            s.step_buffer(step, grad.contiguous(), self._out)
            new = self._out
        if not s.last_step_skipped:
            self.flat_param.copy_(new)
        self.step_id += 1
        return loss

    def export(self, path, dtype="float32"):
        """A collective: muond writes the masters, every tensor whole by name, to `path` on its
        host."""
        self.ranks.barrier()
        self.ranks.on_rank0(lambda: self.client.export(self.job_id, self.token, path, dtype))

    def close(self, delete_job=False):
        if self.session is not None:
            self.session.close()
            self.session = None
        if delete_job:
            self.ranks.barrier()
            if self.rank == 0:
                self.client.delete_job(self.job_id, self.token)
        self.client.close()


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
