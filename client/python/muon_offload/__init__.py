"""muon_offload: the Muon optimizer with its state in the muond daemon, for PyTorch.

    from muon_offload import MuonWithAuxAdam
    hidden = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for p in model.parameters() if all(p is not h for h in hidden)]
    opt = MuonWithAuxAdam([dict(params=hidden, use_muon=True, lr=0.02, weight_decay=0.01),
                           dict(params=other, use_muon=False, lr=3e-4, betas=(0.9, 0.95))])

The package namespace (__all__) is the user's API: the optimizers (MuonWithAuxAdam,
MultiNodeMuonWithAuxAdam, FlatShardOptimizer), DynamicLossScaler, Client and Session, the errors
(MuondError, CODES, CODE_NAMES) and library_path, the QK-Clip helpers and the reference math.
The building blocks (ZeRO buffers, layouts, ownership plans, ParameterOffload, ...) are imported
from their modules; their old names here still work for one release, with a DeprecationWarning.

Modules:
  _native          the C ABI of libmuond_client.so (ctypes), MuondError, CODES, library_path
  client           Client and Session over the C ABI; layout_spans, dtype_name
  optim            MuonWithAuxAdam, composed of the collaborators below (mode="apply" offloads
                   the whole optimizer, DESIGN.md 4b)
  optim_spec       the optimizer's arguments checked and its job spec built, with no I/O
  optim_job        StepContext and JobLink (what the collaborators share), the ModeStep base
  optim_update     update mode's step, the local backend, the trainer-side AdamW and clipping
  optim_apply      apply mode's step: hyperparameters, presence mask, QK-Clip maxima, upload
  optim_delay      delay=1: the step in flight, weight prediction, drain()
  optim_stream     the optimizer's gradient stream: arming, edit fallback, the DDP route
  checkpoints      the optimizer's daemon-side checkpoints and state_dict()'s muond part
  streaming        GradientStream and EarlyResults: gradients streamed during backward
  apply_mode       the trainer side of apply mode (ParameterOffload, apply_job_spec)
  cuda_pinning     shared memory registered with CUDA
  loss_scaler      DynamicLossScaler for fp16 with skipped steps
  rank_group       collectives that fail on every rank
  zero             ZeRO partitions and their collectives for torch.distributed ranks
  flat_shard       FlatShardOptimizer: ZeRO stage 3 on flat parameter shards
  multinode        MultiNodeMuonWithAuxAdam: one daemon per node (DESIGN.md 4c)
  multinode_plan   the ownership plan and the routing of pieces between nodes
  multinode_link   the node jobs: created, attached, the route device
  multinode_route  a multi-node step: the all-to-alls and the routed update/apply steps
  multinode_commit the two-phase commit over the nodes, global clipping
  multinode_checkpoints  the node jobs' checkpoints, export and state_dict
  qk_clip          QK-Clip on the masters in apply mode: MaxLogitRecorder, head_max_logits
  reference        the Muon update of DESIGN.md section 3 in PyTorch, and ApplyReference
Errors: MuondError with the gRPC code and message.
"""
import importlib
import warnings

from ._native import CODE_NAMES, CODES, MuondError, library_path
from .client import Client, Session
from .optim import MuonWithAuxAdam
from .loss_scaler import DynamicLossScaler
from .flat_shard import FlatShardOptimizer
from .multinode import MultiNodeMuonWithAuxAdam
from .qk_clip import (MaxLogitRecorder, head_max_logits, multihead_attention_pair,
                      watch_multihead_attention)
from .reference import ApplyReference, muon_update, newton_schulz

__all__ = [
    "MuonWithAuxAdam", "MultiNodeMuonWithAuxAdam", "FlatShardOptimizer", "DynamicLossScaler",
    "Client", "Session", "MuondError", "CODES", "CODE_NAMES", "library_path",
    "MaxLogitRecorder", "head_max_logits", "multihead_attention_pair",
    "watch_multihead_attention", "ApplyReference", "muon_update", "newton_schulz",
]

# Names this package exported before, now imported from their modules: muon_offload.NAME still
# resolves for one release, with a DeprecationWarning naming the module.
DEPRECATED = {
    "layout_spans": "client",
    "ParameterOffload": "apply_mode", "apply_job_spec": "apply_mode",
    "ownership_plan": "multinode_plan", "ownership_pieces": "multinode_plan",
    **{name: "zero" for name in (
        "Partition", "all_gather_partition_buffers", "all_gather_partitions", "copy_from_buffer",
        "copy_into_buffer", "fill_world_buffer", "group_partition", "group_rank_and_size",
        "job_partitions", "reduce_scatter_partitions", "scatter_world_buffer", "stage12_spec")},
}


def __getattr__(name):
    """PEP 562: the deprecated names of DEPRECATED, from their modules, with a warning."""
    module = DEPRECATED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"muon_offload.{name} is deprecated and leaves the package namespace in the "
                  f"next release: import it from muon_offload.{module} "
                  f"(from muon_offload.{module} import {name})", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return sorted(set(globals()) | set(DEPRECATED))
