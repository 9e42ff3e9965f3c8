"""The ranks of a torch.distributed process group as MuonWithAuxAdam uses them: collectives whose
failure on any rank raises on every rank, so that no rank is left waiting in a collective that a
failed peer never joins. Without torch.distributed (or before init_process_group): one rank, and
every collective is local.

Thread-safety: none; every rank of the group calls the same collectives in the same order.
"""
import torch

from ._native import CODES, MuondError


class RankGroup:
    """This process's place in `process_group` (None: the default group when torch.distributed
    is initialized, else a single rank). dist: the torch.distributed module or None; group: the
    group passed to its calls; rank, size: this process's rank in the group and its size."""

    def __init__(self, process_group=None):
        import torch.distributed as dist
        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.group = process_group if self.dist else None
        if self.dist:
            self.rank = dist.get_rank(self.group)
            self.size = dist.get_world_size(self.group)
        else:
            self.rank, self.size = 0, 1

    def on_rank0(self, fn):
        """Runs fn on the group's rank 0 and returns its result on every rank; an exception there is
        raised on every rank (as MuondError; other exceptions as UNKNOWN)."""
        result = [None, None]
        if self.rank == 0:
            try:
                result[0] = fn()
            except MuondError as e:
                result[1] = (e.code, e.message, e.operation)
            except Exception as e:  # re-raised below, after the peers know
                result[1] = (CODES["UNKNOWN"], f"{type(e).__name__}: {e}", "rank 0")
        if self.size > 1:
            src = 0
            if self.group is not None:
                c10d = self.dist.distributed_c10d
                global_rank = getattr(c10d, "get_global_rank", None) or c10d._get_global_rank
                src = global_rank(self.group, 0)
            self.dist.broadcast_object_list(result, src=src, group=self.group)
        if result[1] is not None:
            raise MuondError(*result[1])
        return result[0]

    def all_ranks(self, fn):
        """Runs fn on every rank; when it raises MuondError on any, every rank raises (the first
        failure, naming its rank)."""
        error = None
        try:
            fn()
        except MuondError as e:
            error = (e.code, e.message, e.operation)
        if self.size > 1:
            errors = [None] * self.size
            self.dist.all_gather_object(errors, error, group=self.group)
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            if failed and error is None:
                rank, (code, message, operation) = failed[0]
                error = (code, f"rank {rank}: {message}", operation)
        if error is not None:
            raise MuondError(*error)

    def barrier(self):
        if self.size > 1:
            self.dist.barrier(group=self.group)

    def count(self, flag):
        """On how many ranks of the group `flag` is true (an all-reduce of one integer, on the
        device NCCL needs)."""
        if self.size == 1:
            return int(bool(flag))
        nccl = self.dist.get_backend(self.group) == "nccl"
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device="cuda" if nccl else "cpu")
        self.dist.all_reduce(t, group=self.group)
        return int(t.item())

    def agree(self, flag, values):
        """One all-reduce (MAX over float64, on the device NCCL needs): whether `flag` is true on
        any rank, and element-wise the smallest and largest of `values` (a list of floats of the
        same length on every rank) over the group."""
        if self.size == 1:
            return bool(flag), list(values), list(values)
        nccl = self.dist.get_backend(self.group) == "nccl"
        t = torch.tensor([1.0 if flag else 0.0] + [-v for v in values] + list(values),
                         dtype=torch.float64, device="cuda" if nccl else "cpu")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        got = t.tolist()
        n = len(values)
        return got[0] > 0, [-v for v in got[1:1 + n]], got[1 + n:]

    def counts(self, flags):
        """Element-wise, on how many ranks each of `flags` is true (one all-reduce)."""
        if self.size == 1:
            return [int(bool(f)) for f in flags]
        nccl = self.dist.get_backend(self.group) == "nccl"
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32,
                         device="cuda" if nccl else "cpu")
        self.dist.all_reduce(t, group=self.group)
        return [int(x) for x in t.tolist()]

    def raise_if_any_failed(self, error):
        """Raises `error` (a MuondError or None) on this rank, or the first failure of another
        rank on the ranks where it is None; returns when no rank failed. Costs one count() when
        none did."""
        if self.size > 1 and self.count(error is not None):
            mine = None if error is None else (error.code, error.message, error.operation)
            errors = [None] * self.size
            self.dist.all_gather_object(errors, mine, group=self.group)
            if error is None:
                rank, (code, message, operation) = next(
                    (r, e) for r, e in enumerate(errors) if e is not None)
                raise MuondError(code, f"rank {rank}: {message}", operation)
        if error is not None:
            raise error
