"""muon_offload: the Muon optimizer with its state in the muond daemon, for PyTorch.

    from muon_offload import MuonWithAuxAdam
    hidden = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for p in model.parameters() if all(p is not h for h in hidden)]
    opt = MuonWithAuxAdam([dict(params=hidden, use_muon=True, lr=0.02, weight_decay=0.01),
                           dict(params=other, use_muon=False, lr=3e-4, betas=(0.9, 0.95))])

Modules: client (Client, Session, layout_spans over the C ABI of libmuond_client.so), optim
(MuonWithAuxAdam; mode="apply" offloads the whole optimizer, DESIGN.md 4b), loss_scaler
(DynamicLossScaler for fp16 with skipped steps), cuda_pinning (shared memory registered with
CUDA), apply_mode (the
trainer side of apply mode), checkpoints (its daemon-side checkpoints), rank_group (collectives
that fail on every rank), zero (ZeRO partitions and their collectives for torch.distributed
ranks), multinode (MultiNodeMuonWithAuxAdam: one daemon per node, DESIGN.md 4c), qk_clip
(QK-Clip on the masters in apply mode: MaxLogitRecorder, head_max_logits), reference (the Muon update of DESIGN.md section 3 in PyTorch, and ApplyReference).
Errors: MuondError with the gRPC code and message.
"""
from ._native import CODE_NAMES, CODES, MuondError, library_path
from .client import Client, Session, layout_spans
from .optim import MuonWithAuxAdam
from .loss_scaler import DynamicLossScaler
from .apply_mode import ParameterOffload, apply_job_spec
from .flat_shard import FlatShardOptimizer
from .multinode import MultiNodeMuonWithAuxAdam
from .multinode_plan import ownership_pieces, ownership_plan
from .qk_clip import (MaxLogitRecorder, head_max_logits, multihead_attention_pair,
                      watch_multihead_attention)
from .reference import ApplyReference, muon_update, newton_schulz
from .zero import (Partition, all_gather_partition_buffers, all_gather_partitions,
                   copy_from_buffer, copy_into_buffer, fill_world_buffer, group_partition,
                   group_rank_and_size, job_partitions, reduce_scatter_partitions,
                   scatter_world_buffer, stage12_spec)

__all__ = [
    "CODE_NAMES", "CODES", "MuondError", "library_path", "Client", "Session", "layout_spans",
    "MuonWithAuxAdam", "DynamicLossScaler", "FlatShardOptimizer", "MultiNodeMuonWithAuxAdam", "ownership_plan", "ownership_pieces", "ParameterOffload", "apply_job_spec", "ApplyReference", "muon_update",
    "newton_schulz", "Partition", "all_gather_partition_buffers", "all_gather_partitions",
    "copy_from_buffer", "copy_into_buffer", "fill_world_buffer", "group_partition",
    "group_rank_and_size", "job_partitions", "reduce_scatter_partitions",
    "scatter_world_buffer", "stage12_spec", "MaxLogitRecorder", "head_max_logits",
    "multihead_attention_pair", "watch_multihead_attention",
]
