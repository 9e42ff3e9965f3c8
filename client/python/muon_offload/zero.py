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


def copy_into_buffer(buffer, partition, tensors, scale=None, non_blocking=False):
    """Writes the partition's elements of `tensors` (one per job matrix, contiguous) into the flat
    `buffer` (e.g. a session's shared-memory gradient view), multiplied by `scale` when given (a
    gradient average fused into the copy). One pass over the data, no intermediate buffer.
    non_blocking: device-to-host copies into pinned memory are asynchronous (the caller
    synchronizes before reading `buffer`)."""
    for matrix, offset, length, rank_offset in partition.spans:
        src = tensors[matrix].reshape(-1)[offset:offset + length]
        dst = buffer[rank_offset:rank_offset + length]
        if scale is None:
            dst.copy_(src, non_blocking=non_blocking)
        else:
            torch.mul(src, scale, out=dst)


def copy_from_buffer(buffer, partition, tensors, non_blocking=False):
    """The inverse of copy_into_buffer: the partition's elements of `tensors` from `buffer`."""
    for matrix, offset, length, rank_offset in partition.spans:
        tensors[matrix].view(-1)[offset:offset + length].copy_(
            buffer[rank_offset:rank_offset + length], non_blocking=non_blocking)


def all_reduce_mean(grads, group=None):
    """Collective: the mean over the group's ranks of each of `grads` (new tensors; the inputs are
    left as they were), one flat all-reduce per dtype (gloo has no reduce-scatter; the sum is the
    same) scaled by 1/N. gloo sums no bfloat16: there the sum is taken in float32 and rounded to
    bfloat16 once."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    widen = dist.get_backend(group) != "nccl"
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    reduced = {}
    for dtype, same in by_dtype.items():
        flat = torch.cat([g.reshape(-1) for g in same])
        if widen and dtype == torch.bfloat16:
            wide = flat.float()
            dist.all_reduce(wide, group=group)
            flat = wide.mul_(1.0 / world).to(dtype)
        else:
            dist.all_reduce(flat, group=group)
            flat.mul_(1.0 / world)
        at = 0
        for g in same:
            reduced[id(g)] = flat[at:at + g.numel()].view(g.shape)
            at += g.numel()
    return [reduced[id(g)] for g in grads]


def _rank_slot(world_buffer, partition):
    """Rank `partition.rank`'s buffer inside a world buffer (every rank's flat buffer back to
    back, rank order)."""
    size = partition.buffer_elements
    return world_buffer[partition.rank * size:(partition.rank + 1) * size]


def fill_world_buffer(world_buffer, partitions, tensors):
    """Lays `tensors` out as every rank's flat buffer back to back (rank r's at r * P), the input
    of reduce_scatter_partitions. For stage 1/2 this is the concatenation of the tensors; padding
    is never written (allocate the buffer zeroed)."""
    for part in partitions:
        copy_into_buffer(_rank_slot(world_buffer, part), part, tensors)


def scatter_world_buffer(world_buffer, partitions, tensors, non_blocking=False):
    """The inverse of fill_world_buffer: every rank's elements of `tensors` from a world buffer
    (the output of all_gather_partition_buffers)."""
    for part in partitions:
        copy_from_buffer(_rank_slot(world_buffer, part), part, tensors, non_blocking)


def _wire(t):
    # gloo (torch 1.13) moves neither bfloat16 nor int16: bfloat16 travels as its bytes. Only
    # data movement uses this; sums are done on the real dtype.
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


def reduce_scatter_partitions(world_buffer, out, group=None):
    """Collective: `out` (this rank's P elements) <- the sum over the group's ranks of their
    world buffers' slot of this rank (a reduce-scatter: each rank receives only its partition).
    NCCL: reduce_scatter_tensor. Other backends (gloo has no reduce-scatter): an all-to-all of the
    slots, then the sum in rank order, one rounding per addition in the buffer's dtype, so the
    result is a deterministic function of the ranks' gradients."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    if dist.get_backend(group) == "nccl":
        dist.reduce_scatter_tensor(out, world_buffer, group=group)
        return
    received = torch.empty_like(world_buffer)
    dist.all_to_all_single(_wire(received), _wire(world_buffer), group=group)
    slots = received.view(world, -1)
    out.copy_(slots[0])
    for r in range(1, world):
        out.add_(slots[r])


def all_gather_partition_buffers(world_buffer, mine, group=None):
    """Collective: every rank's `mine` (its flat buffer, P elements) into `world_buffer` at
    rank * P. REQUIRES: every rank's buffer has the same size and dtype."""
    import torch.distributed as dist
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(world_buffer, mine, group=group)
        return
    slots = list(_wire(world_buffer).chunk(dist.get_world_size(group)))
    dist.all_gather(slots, _wire(mine), group=group)


def all_gather_partitions(buffer, partitions, rank, tensors, group=None):
    """Collective: every rank contributes its flat `buffer` (its partition's elements of `tensors`)
    and receives the others', written into `tensors`. REQUIRES: every rank's buffer has the same
    size and dtype (true of muond layouts)."""
    import torch.distributed as dist
    gathered = [torch.empty_like(buffer) for _ in partitions]
    dist.all_gather([_wire(g) for g in gathered], _wire(buffer), group=group)
    for part, received in zip(partitions, gathered):
        if part.rank != rank:
            copy_from_buffer(received, part, tensors)


# ----- partition-sized collectives (apply mode's trainer memory, ZeRO's promise) -----
#
# reduce_scatter_partitions and all_gather_partition_buffers exchange world buffers (every rank's
# flat buffer back to back: world * P elements, a model-sized buffer for stage 1/2). The functions
# below do the same exchanges in windows of the flat buffers: window [a, b) of every rank's buffer
# at once, world * (b - a) elements in and out, so the staging they need is two windows of at most
# one partition (P elements) each, whatever the world size. The sums are the same, element for
# element (rank order on gloo; NCCL's own order on NCCL, as reduce_scatter_partitions).

def window_elements(partition_elements, world):
    """The window length: world windows of it cover at most one partition (at least 1)."""
    return max(1, -(-int(partition_elements) // int(world)))


def _copy_window(buffer, partition, tensors, start, end, into):
    """Elements [start, end) of `partition`'s flat buffer <-> `buffer` (end - start elements):
    into=True writes the tensors' elements there into `buffer` (padding left alone), False the
    reverse."""
    for matrix, offset, length, rank_offset in partition.spans:
        lo, hi = max(start, rank_offset), min(end, rank_offset + length)
        if lo >= hi:
            continue
        flat = tensors[matrix].view(-1)[offset + lo - rank_offset:offset + hi - rank_offset]
        window = buffer[lo - start:hi - start]
        if into:
            window.copy_(flat)
        else:
            flat.copy_(window)


def _windows(partitions, staging, group):
    """(start, end, n, nccl) of each window of the ranks' flat buffers, for staging buffers of
    `staging` elements (world windows)."""
    import torch.distributed as dist
    world = len(partitions)
    size = partitions[0].buffer_elements
    w = staging.numel() // world
    nccl = dist.get_backend(group) == "nccl"
    for start in range(0, size, w):
        end = min(size, start + w)
        yield start, end, end - start, nccl


def reduce_scatter_windows(partitions, tensors, out, send, received, group=None):
    """Collective: `out` (this rank's P elements) <- the sum over the group's ranks of their
    `tensors`' elements of this rank's partition (reduce_scatter_partitions' result, element for
    element), through the staging buffers `send` and `received` (world * window elements each,
    see window_elements) instead of world buffers."""
    import torch.distributed as dist
    world = len(partitions)
    for start, end, n, nccl in _windows(partitions, send, group):
        sv = send[:world * n].view(world, n)
        sv.zero_()  # padding
        for part in partitions:
            _copy_window(sv[part.rank], part, tensors, start, end, into=True)
        if nccl:
            dist.reduce_scatter_tensor(out[start:end], sv.view(-1), group=group)
            continue
        rv = received[:world * n]
        dist.all_to_all_single(_wire(rv), _wire(sv.view(-1)), group=group)
        slots = rv.view(world, n)
        target = out[start:end]
        target.copy_(slots[0])
        for r in range(1, world):
            target.add_(slots[r])


def all_gather_windows(partitions, mine, tensors, send, received, group=None):
    """Collective: every rank's `mine` (its P-element flat buffer of new values) into every rank's
    `tensors` (all_gather_partition_buffers then scatter_world_buffer, element for element),
    through `send` and `received` (world * window elements each) instead of a world buffer. On
    gloo the window goes out by all-to-all (its all_gather flattens the outputs into a buffer of
    its own: one more world window)."""
    import torch.distributed as dist
    world = len(partitions)
    for start, end, n, nccl in _windows(partitions, received, group):
        rv = received[:world * n]
        if nccl:
            dist.all_gather_into_tensor(rv, mine[start:end].contiguous(), group=group)
        else:
            sv = send[:world * n].view(world, n)
            sv.copy_(mine[start:end].expand(world, n))
            dist.all_to_all_single(_wire(rv), _wire(sv.view(-1)), group=group)
        slots = rv.view(world, n)
        for part in partitions:
            _copy_window(slots[part.rank], part, tensors, start, end, into=False)
