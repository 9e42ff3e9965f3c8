#include "common/job_spec_proto.h"

#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace muond::common {

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kFloat16:
      return v1::DTYPE_FLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype enum value ", dtype));
}

namespace {

absl::StatusOr<NsMethod> NsMethodFromProto(v1::NsMethod m) {
  switch (m) {
    case v1::NS_METHOD_UNSPECIFIED:
    case v1::NS_METHOD_STANDARD:
      return NsMethod::kStandard;
    case v1::NS_METHOD_GRAM:
      return NsMethod::kGram;
    case v1::NS_METHOD_POLAR_EXPRESS:
      return NsMethod::kPolarExpress;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("muon.ns_method: unknown enum value ", m));
}

v1::NsMethod NsMethodToProto(NsMethod m) {
  switch (m) {
    case NsMethod::kStandard:
      return v1::NS_METHOD_STANDARD;
    case NsMethod::kGram:
      return v1::NS_METHOD_GRAM;
    case NsMethod::kPolarExpress:
      return v1::NS_METHOD_POLAR_EXPRESS;
  }
  return v1::NS_METHOD_UNSPECIFIED;
}

absl::StatusOr<ScaleMode> ScaleModeFromProto(v1::ScaleMode m) {
  switch (m) {
    case v1::SCALE_MODE_UNSPECIFIED:
    case v1::SCALE_MODE_ORIGINAL:
      return ScaleMode::kOriginal;
    case v1::SCALE_MODE_MATCH_RMS_ADAMW:
      return ScaleMode::kMatchRmsAdamw;
    case v1::SCALE_MODE_NONE:
      return ScaleMode::kNone;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("muon.scale_mode: unknown enum value ", m));
}

v1::ScaleMode ScaleModeToProto(ScaleMode m) {
  switch (m) {
    case ScaleMode::kOriginal:
      return v1::SCALE_MODE_ORIGINAL;
    case ScaleMode::kMatchRmsAdamw:
      return v1::SCALE_MODE_MATCH_RMS_ADAMW;
    case ScaleMode::kNone:
      return v1::SCALE_MODE_NONE;
  }
  return v1::SCALE_MODE_UNSPECIFIED;
}

absl::Status TensorApplyFieldsFromProto(const v1::MatrixSpec& pm, int i, MatrixSpec* ms) {
  switch (pm.optimizer()) {
    case v1::OPTIMIZER_UNSPECIFIED:
    case v1::OPTIMIZER_MUON:
      ms->optimizer = Optimizer::kMuon;
      break;
    case v1::OPTIMIZER_ADAMW:
      ms->optimizer = Optimizer::kAdamW;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("matrices[", i, "].optimizer: unknown enum value ", pm.optimizer()));
  }
  ms->group = pm.group();
  ms->param_dtype = ms->dtype;
  if (pm.has_param_dtype()) {
    auto dtype = DTypeFromProto(pm.param_dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrices[", i, "].param_dtype: ", dtype.status().message()));
    }
    ms->param_dtype = *dtype;
  }
  return absl::OkStatus();
}

absl::Status ApplyFieldsFromProto(const v1::JobSpec& proto, JobSpec* spec) {
  switch (proto.mode()) {
    case v1::JOB_MODE_UNSPECIFIED:
    case v1::JOB_MODE_UPDATE:
      spec->mode = JobMode::kUpdate;
      break;
    case v1::JOB_MODE_APPLY:
      spec->mode = JobMode::kApply;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("mode: unknown enum value ", proto.mode()));
  }
  if (proto.groups_size() > static_cast<int>(kMaxParamGroups)) {
    return absl::InvalidArgumentError(
        absl::StrCat("groups: ", proto.groups_size(), " groups; at most ", kMaxParamGroups));
  }
  for (const v1::ParamGroup& g : proto.groups()) {
    spec->groups.push_back({g.name(), g.lr(), g.weight_decay()});
  }
  const v1::AdamWConfig& a = proto.adamw();
  if (a.has_beta1()) spec->adamw.beta1 = a.beta1();
  if (a.has_beta2()) spec->adamw.beta2 = a.beta2();
  if (a.has_eps()) spec->adamw.eps = a.eps();
  spec->max_grad_norm = proto.max_grad_norm();
  spec->init_from = proto.init_from();
  FillApplyDefaults(spec);
  return absl::OkStatus();
}

void ApplyFieldsToProto(const JobSpec& spec, v1::JobSpec* proto) {
  proto->set_mode(v1::JOB_MODE_APPLY);
  for (const ParamGroup& g : spec.groups) {
    v1::ParamGroup* pg = proto->add_groups();
    pg->set_name(g.name);
    pg->set_lr(g.lr);
    pg->set_weight_decay(g.weight_decay);
  }
  proto->mutable_adamw()->set_beta1(spec.adamw.beta1);
  proto->mutable_adamw()->set_beta2(spec.adamw.beta2);
  proto->mutable_adamw()->set_eps(spec.adamw.eps);
  proto->set_max_grad_norm(spec.max_grad_norm);
  proto->set_init_from(spec.init_from);
}

// The Muon hyperparameters: a field the message leaves unset keeps its default.
absl::Status MuonConfigFromProto(const v1::MuonConfig& m, MuonConfig* muon) {
  if (m.has_momentum()) muon->momentum = m.momentum();
  if (m.has_nesterov()) muon->nesterov = m.nesterov();
  if (m.has_ns_steps()) muon->ns_steps = m.ns_steps();
  if (m.has_fp32_iterations()) muon->fp32_iterations = m.fp32_iterations();
  ASSIGN_OR_RETURN(muon->ns_method, NsMethodFromProto(m.ns_method()));
  ASSIGN_OR_RETURN(muon->scale_mode, ScaleModeFromProto(m.scale_mode()));
  auto compute = DTypeFromProto(m.compute_dtype());
  if (!compute.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("muon.compute_dtype: ", compute.status().message()));
  }
  muon->compute_dtype = *compute;
  return absl::OkStatus();
}

// matrices[i] of the message.
absl::StatusOr<MatrixSpec> MatrixFromProto(const v1::MatrixSpec& pm, int i) {
  MatrixSpec ms;
  ms.name = pm.name();
  ms.shape.assign(pm.shape().begin(), pm.shape().end());
  ms.num_heads = pm.num_heads() == 0 ? 1 : pm.num_heads();
  auto dtype = DTypeFromProto(pm.dtype());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrices[", i, "].dtype: ", dtype.status().message()));
  }
  ms.dtype = *dtype;
  ms.row_offset = pm.row_offset();
  ms.full_rows = pm.full_rows();
  RETURN_IF_ERROR(TensorApplyFieldsFromProto(pm, i, &ms));
  return ms;
}

v1::StateDType StateDTypeToProto(StateDType dtype) {
  switch (dtype) {
    case StateDType::kBFloat16:
      return v1::STATE_DTYPE_BFLOAT16;
    case StateDType::kInt8:
      return v1::STATE_DTYPE_INT8;
    case StateDType::kFloat32:
      break;
  }
  return v1::STATE_DTYPE_FLOAT32;
}

// The "state" block; an unknown enum value (a newer client) is INVALID_ARGUMENT naming it.
absl::Status StateStorageFromProto(const v1::JobSpec& proto, StateStorage* out) {
  for (const auto& [name, value, dtype] :
       {std::tuple<const char*, int, StateDType*>{"state.momentum_dtype",
                                                  proto.state().momentum_dtype(), &out->momentum},
        {"state.adamw_dtype", proto.state().adamw_dtype(), &out->adamw}}) {
    switch (value) {
      case v1::STATE_DTYPE_FLOAT32:
        *dtype = StateDType::kFloat32;
        break;
      case v1::STATE_DTYPE_BFLOAT16:
        *dtype = StateDType::kBFloat16;
        break;
      case v1::STATE_DTYPE_INT8:
        *dtype = StateDType::kInt8;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(name, ": unknown state dtype ", value,
                                                       " (expected float32, bfloat16 or int8)"));
    }
  }
  return absl::OkStatus();
}

// How the job runs: its gather budget, probe, non-finite policy, checkpoints and step timeout.
absl::Status RunOptionsFromProto(const v1::JobSpec& proto, JobSpec* spec) {
  // uint64 on the wire, but job.json (what the daemon stores and reads back at restart) holds
  // them as JSON integers up to INT64_MAX: a larger value is refused here as it is there, rather
  // than accepted now and unreadable after a restart.
  for (const auto& [name, value] :
       {std::pair<const char*, uint64_t>{"gather_budget_bytes", proto.gather_budget_bytes()},
        {"step_window_bytes", proto.step_window_bytes()},
        {"checkpoint_every_steps", proto.checkpoint_every_steps()}}) {
    if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", value, " is out of range (at most 2^63 - 1)"));
    }
  }
  spec->gather_budget_bytes = proto.gather_budget_bytes();
  spec->step_window_bytes = proto.step_window_bytes();
  RETURN_IF_ERROR(StateStorageFromProto(proto, &spec->state));
  spec->transport_probe = proto.transport_probe();
  switch (proto.nonfinite()) {
    case v1::NONFINITE_REFUSE:
      break;
    case v1::NONFINITE_SKIP:
      spec->nonfinite_skip = true;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "nonfinite: unknown value ", static_cast<int>(proto.nonfinite()),
          " (accepted: NONFINITE_REFUSE, NONFINITE_SKIP)"));
  }
  spec->checkpoint_every_steps = proto.checkpoint_every_steps();
  spec->checkpoint_keep = proto.checkpoint_keep() == 0 ? 3 : proto.checkpoint_keep();
  spec->step_timeout_seconds = proto.step_timeout_seconds();
  spec->step_buffers = proto.step_buffers() == 0 ? 2 : proto.step_buffers();
  return absl::OkStatus();
}

// QK-Clip's threshold, alpha and pairs (checked by ValidateJobSpec, but for their number).
absl::Status QkClipFromProto(const v1::QkClip& q, QkClip* qk_clip) {
  if (static_cast<size_t>(q.pairs_size()) > kMaxQkClipPairs) {
    return absl::InvalidArgumentError(
        absl::StrCat("qk_clip.pairs: ", q.pairs_size(), " pairs; at most ", kMaxQkClipPairs));
  }
  qk_clip->threshold = q.threshold();
  if (q.has_alpha()) qk_clip->alpha = q.alpha();
  for (const v1::QkClipPair& p : q.pairs()) {
    qk_clip->pairs.push_back({p.q(), p.k(), p.q_heads(), p.kv_heads(), p.head_dim()});
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<JobSpec> JobSpecFromProto(const v1::JobSpec& proto) {
  JobSpec spec;
  spec.job_id = proto.job_id();
  spec.world_size = proto.world_size() == 0 ? 1 : proto.world_size();
  spec.zero_stage = proto.zero_stage();
  RETURN_IF_ERROR(MuonConfigFromProto(proto.muon(), &spec.muon));
  for (int i = 0; i < proto.matrices_size(); ++i) {
    ASSIGN_OR_RETURN(MatrixSpec ms, MatrixFromProto(proto.matrices(i), i));
    spec.matrices.push_back(std::move(ms));
  }
  RETURN_IF_ERROR(ApplyFieldsFromProto(proto, &spec));
  RETURN_IF_ERROR(RunOptionsFromProto(proto, &spec));
  if (proto.has_multinode()) {
    spec.multinode = {proto.multinode().global_job_id(), proto.multinode().node(),
                      proto.multinode().nodes()};
  }
  if (proto.has_qk_clip()) {
    RETURN_IF_ERROR(QkClipFromProto(proto.qk_clip(), &spec.qk_clip));
  }
  for (const v1::RankLayout& rank : proto.layout()) {
    std::vector<LayoutSpan> spans;
    for (const v1::Span& s : rank.spans())
      spans.push_back({s.matrix_index(), s.offset(), s.length()});
    spec.explicit_layout.push_back(std::move(spans));
  }
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  return spec;
}

v1::JobSpec JobSpecToProto(const JobSpec& spec) {
  v1::JobSpec proto;
  proto.set_job_id(spec.job_id);
  proto.set_world_size(spec.world_size);
  proto.set_zero_stage(spec.zero_stage);
  v1::MuonConfig* m = proto.mutable_muon();
  m->set_momentum(spec.muon.momentum);
  m->set_nesterov(spec.muon.nesterov);
  m->set_ns_steps(spec.muon.ns_steps);
  m->set_ns_method(NsMethodToProto(spec.muon.ns_method));
  m->set_scale_mode(ScaleModeToProto(spec.muon.scale_mode));
  m->set_compute_dtype(DTypeToProto(spec.muon.compute_dtype));
  if (spec.muon.fp32_iterations != 0) m->set_fp32_iterations(spec.muon.fp32_iterations);
  for (const MatrixSpec& ms : spec.matrices) {
    v1::MatrixSpec* pm = proto.add_matrices();
    pm->set_name(ms.name);
    for (int64_t d : ms.shape) pm->add_shape(d);
    pm->set_num_heads(ms.num_heads);
    pm->set_dtype(DTypeToProto(ms.dtype));
    pm->set_row_offset(ms.row_offset);
    pm->set_full_rows(ms.full_rows);
    if (spec.mode == JobMode::kApply) {
      pm->set_optimizer(ms.optimizer == Optimizer::kAdamW ? v1::OPTIMIZER_ADAMW
                                                          : v1::OPTIMIZER_MUON);
      pm->set_group(ms.group);
      pm->set_param_dtype(DTypeToProto(ms.param_dtype));
    }
  }
  if (spec.mode == JobMode::kApply) ApplyFieldsToProto(spec, &proto);
  if (spec.mode == JobMode::kUpdate) proto.set_max_grad_norm(spec.max_grad_norm);  // clips too
  proto.set_gather_budget_bytes(spec.gather_budget_bytes);
  proto.set_transport_probe(spec.transport_probe);
  proto.set_nonfinite(spec.nonfinite_skip ? v1::NONFINITE_SKIP : v1::NONFINITE_REFUSE);
  proto.set_checkpoint_every_steps(spec.checkpoint_every_steps);
  proto.set_checkpoint_keep(spec.checkpoint_keep);
  proto.set_step_timeout_seconds(spec.step_timeout_seconds);
  proto.set_step_buffers(spec.step_buffers);
  proto.set_step_window_bytes(spec.step_window_bytes);
  if (spec.state.compressed()) {
    proto.mutable_state()->set_momentum_dtype(StateDTypeToProto(spec.state.momentum));
    proto.mutable_state()->set_adamw_dtype(StateDTypeToProto(spec.state.adamw));
  }
  if (spec.multinode.nodes > 0) {
    proto.mutable_multinode()->set_global_job_id(spec.multinode.global_job_id);
    proto.mutable_multinode()->set_node(spec.multinode.node);
    proto.mutable_multinode()->set_nodes(spec.multinode.nodes);
  }
  if (spec.qk_clip.enabled()) {
    v1::QkClip* q = proto.mutable_qk_clip();
    q->set_threshold(spec.qk_clip.threshold);
    q->set_alpha(spec.qk_clip.alpha);
    for (const QkClipPair& p : spec.qk_clip.pairs) {
      v1::QkClipPair* pp = q->add_pairs();
      pp->set_q(p.q);
      pp->set_k(p.k);
      pp->set_q_heads(p.q_heads);
      pp->set_kv_heads(p.kv_heads);
      pp->set_head_dim(p.head_dim);
    }
  }
  for (const auto& rank : spec.explicit_layout) {
    v1::RankLayout* pr = proto.add_layout();
    for (const LayoutSpan& s : rank) {
      v1::Span* ps = pr->add_spans();
      ps->set_matrix_index(s.matrix);
      ps->set_offset(s.offset);
      ps->set_length(s.length);
    }
  }
  return proto;
}

}  // namespace muond::common
