"""ZeRO partitions of a muond job for the ranks of a torch.distributed group.

A job's layout (DESIGN.md section 4) gives every rank a list of spans, each a run of one matrix's
elements placed at `rank_offset` of the rank's flat buffer:
  - ZeRO stage 1/2: the matrices concatenated in job order, split into world_size partitions of
    P = ceil(total / world_size) elements (the last padded);
  - ZeRO stage 3: each matrix split on its own into chunks of ceil(numel / world_size), the rank's
    chunks back to back (each padded).
The spans come from the client library (muond_layout_spans), the computation the daemon uses.
Every rank's flat buffer has the same size, so partitions can be exchanged with all_gather.
Functions here do not synchronize unless they say so; all_gather_partitions is a collective.
"""
from dataclasses import dataclass

import torch

from .client import layout_spans


@dataclass(frozen=True)
class Partition:
    """What one rank owns: spans of (matrix, offset, length, rank_offset) and the elements of its
    flat buffer."""
    rank: int
    spans: tuple
    buffer_elements: int


def group_rank_and_size(group=None):
    """(rank, world size) of this process in `group` (the default group when None); (0, 1) when
    torch.distributed is not initialized."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def job_partitions(spec):
    """The partitions of every rank of a job spec (dict with world_size, zero_stage, matrices)."""
    out = []
    for rank in range(int(spec.get("world_size", 1))):
        spans, elements = layout_spans(spec, rank)
        out.append(Partition(rank, spans, elements))
    return out


def group_partition(spec, group=None):
    """This process's partition of the job for `group`; ValueError when the job's world size is not
    the group's."""
    rank, world = group_rank_and_size(group)
    if int(spec.get("world_size", 1)) != world:
        raise ValueError(f"job '{spec.get('job_id')}' has world_size {spec.get('world_size', 1)}, "
                         f"the process group has {world} ranks")
    spans, elements = layout_spans(spec, rank)
    return Partition(rank, spans, elements)


def stage12_spec(job_id, tensors, world_size, zero_stage=2, **muon):
    """A job spec for named tensors ({name: tensor}, in order) under a ZeRO stage 1/2 (or 3)
    partition; `muon` holds the job's Muon config (momentum, nesterov, ns_method, ...)."""
    from .client import dtype_name
    return {"job_id": job_id, "world_size": int(world_size), "zero_stage": int(zero_stage),
            "muon": dict(muon),
            "matrices": [{"name": n, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
                         for n, t in tensors.items()]}


def copy_into_buffer(buffer, partition, tensors, scale=None):
    """Writes the partition's elements of `tensors` (one per job matrix, contiguous) into the flat
    `buffer` (e.g. a session's shared-memory gradient view), multiplied by `scale` when given (a
    gradient average fused into the copy). One pass over the data, no intermediate buffer."""
    for matrix, offset, length, rank_offset in partition.spans:
        src = tensors[matrix].reshape(-1)[offset:offset + length]
        dst = buffer[rank_offset:rank_offset + length]
        if scale is None:
            dst.copy_(src)
        else:
            torch.mul(src, scale, out=dst)


def copy_from_buffer(buffer, partition, tensors):
    """The inverse of copy_into_buffer: the partition's elements of `tensors` from `buffer`."""
    for matrix, offset, length, rank_offset in partition.spans:
        tensors[matrix].view(-1)[offset:offset + length].copy_(
            buffer[rank_offset:rank_offset + length])


def all_gather_partitions(buffer, partitions, rank, tensors, group=None):
    """Collective: every rank contributes its flat `buffer` (its partition's elements of `tensors`)
    and receives the others', written into `tensors`. REQUIRES: every rank's buffer has the same
    size and dtype (true of muond layouts)."""
    import torch.distributed as dist
    gathered = [torch.empty_like(buffer) for _ in partitions]
    dist.all_gather(gathered, buffer, group=group)
    for part, received in zip(partitions, gathered):
        if part.rank != rank:
            copy_from_buffer(received, part, tensors)
