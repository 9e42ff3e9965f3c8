// Apply mode (DESIGN.md 4b) on the client: a step's hyperparameters (ResolveStepHyper,
// RankSession::SetHyper and where they travel) and the rank's initial parameters over either
// transport. The steps themselves: client_session.cc; the export of the master weights:
// client_export.cc.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/daemon_call.h"
#include "client/shm_channel.h"
#include "client/span_placement.h"
#include "common/crc32c.h"
#include "common/grpc_status.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/shm_protocol.h"
#include "common/status_macros.h"

namespace muond::client {
namespace {

using common::FromGrpcStatus;

std::string Quoted(const std::string& name) { return absl::StrCat("'", name, "'"); }

// The groups of `spec`, for messages: 'muon', 'adamw'.
std::string GroupNames(const common::JobSpec& spec) {
  std::vector<std::string> names;
  for (const common::ParamGroup& g : spec.groups) names.push_back(Quoted(g.name));
  return absl::StrJoin(names, ", ");
}

// Records `value` for group `name` in values/seen; INVALID_ARGUMENT naming the group for an
// unknown or repeated group and for a value that is not finite and >= 0 (`what`: "lr",
// "weight decay").
absl::Status SetGroupValue(const common::JobSpec& spec, const char* what, const std::string& name,
                           double value, std::vector<double>* values, std::vector<bool>* seen) {
  size_t g = 0;
  while (g < spec.groups.size() && spec.groups[g].name != name) ++g;
  if (g == spec.groups.size()) {
    return absl::InvalidArgumentError(absl::StrCat("job '", spec.job_id, "': ", what,
                                                   " for unknown parameter group ", Quoted(name),
                                                   " (the job's groups: ", GroupNames(spec), ")"));
  }
  if ((*seen)[g]) {
    return absl::InvalidArgumentError(absl::StrCat("job '", spec.job_id, "': the ", what,
                                                   " of group ", Quoted(name), " is given twice"));
  }
  if (!std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrCat("job '", spec.job_id, "': the ", what,
                                                   " of group ", Quoted(name), " is ", value,
                                                   "; it must be finite and >= 0"));
  }
  (*values)[g] = value;
  (*seen)[g] = true;
  return absl::OkStatus();
}

// Writes n float32 elements from `src` (any alignment) as `dtype` at `dst`, rounding to nearest
// even.
void NarrowFloat32(const void* src, uint64_t n, common::DType dtype, char* dst) {
  if (dtype == common::DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  constexpr uint64_t kBlock = uint64_t{1} << 14;
  std::vector<float> block(std::min(n, kBlock));
  const size_t esize = common::DTypeSize(dtype);
  for (uint64_t at = 0; at < n; at += kBlock) {
    const uint64_t m = std::min(kBlock, n - at);
    std::memcpy(block.data(), static_cast<const char*>(src) + at * sizeof(float),
                m * sizeof(float));
    common::FromFloat32(block.data(), m, dtype, dst + at * esize);
  }
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// INVALID_ARGUMENT naming the tensor when `t` does not have the shape of the whole tensor `ms`,
// a dtype of float32 or its param_dtype, and the bytes of that shape and dtype.
absl::Status CheckWholeParams(const NamedTensor& t, const common::MatrixSpec& ms) {
  if (t.shape != ms.shape) {
    return absl::InvalidArgumentError(absl::StrCat("parameter ", Quoted(ms.name), ": shape ",
                                                   ShapeText(t.shape), " does not match the job's ",
                                                   ShapeText(ms.shape)));
  }
  if (t.dtype != common::DType::kFloat32 && t.dtype != ms.param_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter ", Quoted(ms.name), ": dtype ", std::string(common::DTypeName(t.dtype)),
        " is neither float32 nor the tensor's param_dtype ",
        std::string(common::DTypeName(ms.param_dtype))));
  }
  const uint64_t numel = static_cast<uint64_t>(ms.numel());
  if (t.data.size() != numel * common::DTypeSize(t.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter ", Quoted(ms.name), ": ", t.data.size(), " bytes for ", numel, " ",
                     std::string(common::DTypeName(t.dtype)), " elements"));
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT unless `params` cover the rank's spans exactly (each span of `params` inside
// one of the rank's spans, and the elements of each rank span given once in total).
absl::Status CheckCoversRank(const std::vector<GradientSpan>& params,
                             const std::vector<common::ShardSpan>& spans,
                             const common::JobSpec& spec) {
  std::vector<uint64_t> covered(spans.size(), 0);
  for (const GradientSpan& p : params) {
    size_t i = 0;
    while (i < spans.size() && !(spans[i].matrix == p.matrix && p.offset >= spans[i].offset &&
                                 p.offset - spans[i].offset <= spans[i].length &&
                                 p.length <= spans[i].length - (p.offset - spans[i].offset))) {
      ++i;
    }
    if (i == spans.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter span of tensor ", Quoted(spec.matrices[p.matrix].name), " elements [",
          p.offset, ", ", p.offset + p.length, ") is outside the rank's shard"));
    }
    covered[i] += p.length;
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    if (covered[i] != spans[i].length) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", Quoted(spec.matrices[spans[i].matrix].name),
                       ": the parameter spans cover ", covered[i], " of the rank's ",
                       spans[i].length, " elements at element ", spans[i].offset));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GroupHyperValues> ResolveStepHyper(const common::JobSpec& spec,
                                                  const StepHyper& hyper) {
  if (spec.mode != common::JobMode::kApply) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", spec.job_id,
                     "' is in mode 'update': its steps take no lr, weight decay or "
                     "gradient divisor (those are for mode 'apply' jobs)"));
  }
  const size_t groups = spec.groups.size();
  GroupHyperValues v;
  v.lr.assign(groups, 0);
  v.weight_decay.resize(groups);
  for (size_t g = 0; g < groups; ++g) v.weight_decay[g] = spec.groups[g].weight_decay;
  std::vector<bool> lr_seen(groups, false), wd_seen(groups, false);
  for (const auto& [name, value] : hyper.lr) {
    RETURN_IF_ERROR(SetGroupValue(spec, "lr", name, value, &v.lr, &lr_seen));
  }
  for (const auto& [name, value] : hyper.weight_decay) {
    RETURN_IF_ERROR(SetGroupValue(spec, "weight decay", name, value, &v.weight_decay, &wd_seen));
  }
  for (size_t g = 0; g < groups; ++g) {
    if (!lr_seen[g]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", spec.job_id, "': no lr for parameter group ", Quoted(spec.groups[g].name),
          "; a step of a mode 'apply' job carries the lr of every group (", GroupNames(spec), ")"));
    }
  }
  if (!std::isfinite(hyper.grad_divisor) || hyper.grad_divisor <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("job '", spec.job_id, "': gradient divisor ",
                                                   hyper.grad_divisor, " must be finite and > 0"));
  }
  v.grad_divisor = hyper.grad_divisor;
  return v;
}

absl::Status RankSession::RequireApply(const char* what) const {
  if (apply()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": job '", spec_.job_id,
      "' is in mode 'update' (the trainer keeps its weights); this is for mode 'apply' jobs"));
}

absl::Status RankSession::SetHyper(const StepHyper& hyper) {
  ASSIGN_OR_RETURN(GroupHyperValues values, ResolveStepHyper(spec_, hyper));
  hyper_ = std::move(values);
  return absl::OkStatus();
}

absl::Status RankSession::SetGlobalClip(int mode, double sum_sq) {
  RETURN_IF_ERROR(RequireApply("SetGlobalClip"));
  if (mode < 0 || mode > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("global clip mode ", mode,
                     " (0: none, 1: speculate with clip 1, 2: clip by a global sum)"));
  }
  if (mode == 2 && (!std::isfinite(sum_sq) || sum_sq < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("global clip: the sum of squares ", sum_sq, " must be finite and >= 0"));
  }
  global_clip_mode_ = mode;
  global_sum_sq_ = mode == 2 ? sum_sq : 0;
  return absl::OkStatus();
}

absl::Status RankSession::SetMaxLogits(std::vector<float> logits) {
  RETURN_IF_ERROR(RequireApply("SetMaxLogits"));
  if (!spec_.qk_clip.enabled()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetMaxLogits: job '", spec_.job_id, "' has no qk_clip pairs (job.json \"qk_clip\")"));
  }
  RETURN_IF_ERROR(common::CheckMaxLogits(spec_, logits, "SetMaxLogits"));
  max_logits_ = std::move(logits);
  return absl::OkStatus();
}

absl::Status RankSession::SetAbsent(const std::vector<uint32_t>& tensors) {
  RETURN_IF_ERROR(RequireApply("SetAbsent"));
  ASSIGN_OR_RETURN(absent_, common::PresenceMask(spec_, tensors));
  return absl::OkStatus();
}

absl::Status RankSession::CheckStepHyper(int64_t step) const {
  if (apply() && hyper_ && spec_.qk_clip.enabled() && max_logits_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step, ": job '", spec_.job_id,
        "' has QK-Clip: set the step's max attention "
        "logits first (RankSession::SetMaxLogits, muond_session_set_max_logits, muonctl step "
        "--max-logits), starting with pair q='",
        spec_.qk_clip.pairs[0].q, "'"));
  }
  if (!apply() || hyper_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", step, ": job '", spec_.job_id,
      "' is in mode 'apply': set the lr of every parameter group first (RankSession::SetHyper, "
      "muond_session_set_hyper, muonctl step --lr GROUP=VALUE)"));
}

absl::Status RankSession::WriteSharedHyper(int64_t step) {
  const size_t bytes =
      common::shm::HyperBytes(spec_.groups.size(), spec_.matrices.size(), spec_.qk_clip.logits());
  const uint64_t at = shm_->hyper_byte_offset();
  const uint64_t size = shm_->buffer_bytes();
  bool fits = at % alignof(double) == 0 && at <= size && bytes <= size - at;
  for (const ShmSpan& r : shm_->spans()) {
    // The block must not overlap a gradient span (those are the caller's bytes).
    const uint64_t begin = r.byte_offset;
    const uint64_t end = begin + r.length * common::DTypeSize(spec_.matrices[r.matrix].dtype);
    if (at < end && begin < at + bytes) fits = false;
  }
  if (!fits) {
    return absl::InternalError(absl::StrCat(
        "the daemon's shared-memory layout has no room for the step's hyperparameters (", bytes,
        " bytes at byte ", at, " of a ", size, "-byte gradient buffer, clear of the gradients)"));
  }
  std::vector<double> block;
  block.reserve(2 * spec_.groups.size() + 3);
  block.insert(block.end(), hyper_->lr.begin(), hyper_->lr.end());
  block.insert(block.end(), hyper_->weight_decay.begin(), hyper_->weight_decay.end());
  block.push_back(hyper_->grad_divisor);
  block.push_back(global_clip_mode_);
  block.push_back(global_sum_sq_);
  char* dst = shm_->GradientBuffer(step) + at;
  std::memcpy(dst, block.data(), block.size() * sizeof(double));
  // The presence mask after the doubles: one byte per tensor, 1 for an absent one.
  char* mask = dst + block.size() * sizeof(double);
  std::memset(mask, 0, spec_.matrices.size());
  if (!absent_.empty()) std::memcpy(mask, absent_.data(), absent_.size());
  if (!max_logits_.empty()) {
    std::memcpy(dst + common::shm::MaxLogitsOffset(spec_.groups.size(), spec_.matrices.size()),
                max_logits_.data(), max_logits_.size() * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status RankSession::InitParams(const std::vector<GradientSpan>& params, bool float32) {
  RETURN_IF_ERROR(RequireApply("InitParams"));
  RETURN_IF_ERROR(CheckMatrixIndices(params, spec_, "parameter"));
  RETURN_IF_ERROR(CheckCoversRank(params, spans_, spec_));
  if (shm_ != nullptr) return InitParamsShared(params, float32);
  return InitParamsOverGrpc(params, float32);
}

absl::Status RankSession::InitParamsShared(const std::vector<GradientSpan>& params, bool float32) {
  char* buffer = shm_->GradientBuffer(0);
  for (const GradientSpan& p : params) {
    ASSIGN_OR_RETURN(const BufferPlace place,
                     PlaceInBuffer(shm_->spans(), spec_, p.matrix, p.offset, p.length, "parameter",
                                   BufferLayout::kParameters));
    if (place.byte_offset + place.bytes > shm_->buffer_bytes()) {
      return absl::InternalError(
          absl::StrCat("the daemon's shared-memory layout puts the parameters of tensor '",
                       spec_.matrices[p.matrix].name, "' past the end of its ",
                       shm_->buffer_bytes(), "-byte buffer"));
    }
    // The region holds param_dtype only: float32 values are rounded to it here.
    if (float32) {
      NarrowFloat32(p.data, p.length, spec_.matrices[p.matrix].param_dtype,
                    buffer + place.byte_offset);
    } else {
      std::memcpy(buffer + place.byte_offset, p.data, place.bytes);
    }
  }
  return Annotate(shm_->RingInitParams(), "InitParams");
}

absl::Status RankSession::InitParamsOverGrpc(const std::vector<GradientSpan>& params,
                                             bool float32) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token_);
  SetStreamJob(&ctx, spec_.job_id);
  v1::InitResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::InitRequest>> writer = stub_->InitParams(&ctx, &resp);
  v1::InitRequest req;
  v1::InitBegin* begin = req.mutable_begin();
  begin->set_job_id(spec_.job_id);
  begin->set_rank(rank_);
  begin->set_session_id(session_id_);
  begin->set_float32(float32);
  bool open = writer->Write(req);
  for (size_t i = 0; open && i < params.size(); ++i) {
    const GradientSpan& p = params[i];
    const size_t esize =
        common::DTypeSize(float32 ? common::DType::kFloat32 : spec_.matrices[p.matrix].param_dtype);
    const size_t per_chunk = kChunkBytes / esize;  // elements
    const char* base = static_cast<const char*>(p.data);
    for (uint64_t at = 0; open && at < p.length; at += per_chunk) {
      const uint64_t n = std::min<uint64_t>(per_chunk, p.length - at);
      v1::DataChunk* c = req.mutable_params();
      c->set_matrix_index(p.matrix);
      c->set_element_offset(p.offset + at);
      c->set_data(base + at * esize, n * esize);
      c->set_crc32c(common::Crc32c(base + at * esize, n * esize));
      open = writer->Write(req);
    }
  }
  if (open) {
    req.mutable_end();
    open = writer->Write(req);
  }
  writer->WritesDone();
  return Annotate(FromGrpcStatus(writer->Finish()), "InitParams");
}

absl::Status RankSession::InitParamsBuffer(const void* flat, bool float32) {
  RETURN_IF_ERROR(RequireApply("InitParamsBuffer"));
  const common::DType dtype = float32 ? common::DType::kFloat32 : spec_.matrices[0].param_dtype;
  if (!float32) {
    for (const common::MatrixSpec& ms : spec_.matrices) {
      if (ms.param_dtype != dtype) {
        return absl::FailedPreconditionError(
            absl::StrCat("job '", spec_.job_id, "' mixes param dtypes (tensor '", ms.name,
                         "'); a flat rank buffer of parameters needs one: pass float32 or spans"));
      }
    }
  }
  const size_t esize = common::DTypeSize(dtype);
  std::vector<GradientSpan> params;
  for (const common::ShardSpan& s : spans_) {
    params.push_back(
        {s.matrix, s.offset, static_cast<const char*>(flat) + s.rank_offset * esize, s.length});
  }
  return InitParams(params, float32);
}

absl::Status RankSession::InitParamsTensors(const std::vector<NamedTensor>& params) {
  RETURN_IF_ERROR(RequireApply("InitParamsTensors"));
  if (spec_.zero_stage != 0 || !spec_.explicit_layout.empty()) {
    return absl::FailedPreconditionError(
        "whole-tensor initial parameters need a zero_stage 0 job without an explicit layout; "
        "upload the rank's spans with InitParams() or InitParamsBuffer()");
  }
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!by_name.emplace(params[i].name, i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", Quoted(params[i].name), " given twice"));
    }
  }
  std::vector<const NamedTensor*> ordered;
  bool all_param_dtype = true;
  for (const common::MatrixSpec& ms : spec_.matrices) {
    auto it = by_name.find(ms.name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the initial parameters of tensor ", Quoted(ms.name), " are missing"));
    }
    const NamedTensor& t = params[it->second];
    by_name.erase(it);
    RETURN_IF_ERROR(CheckWholeParams(t, ms));
    all_param_dtype = all_param_dtype && t.dtype == ms.param_dtype;
    ordered.push_back(&t);
  }
  if (!by_name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("parameter ", Quoted(by_name.begin()->first),
                                                   " is not a tensor of job '", spec_.job_id, "'"));
  }
  // One wire dtype for the upload: the param dtypes when every tensor came in its own, else
  // float32 (widening a param-dtype tensor is exact).
  std::vector<std::vector<float>> widened(ordered.size());
  std::vector<GradientSpan> spans;
  for (uint32_t m = 0; m < ordered.size(); ++m) {
    const NamedTensor& t = *ordered[m];
    const uint64_t numel = static_cast<uint64_t>(spec_.matrices[m].numel());
    const void* data = t.data.data();
    if (!all_param_dtype && t.dtype != common::DType::kFloat32) {
      widened[m].resize(numel);
      common::ToFloat32(t.dtype, t.data.data(), numel, widened[m].data());
      data = widened[m].data();
    }
    spans.push_back({m, 0, data, numel});
  }
  return InitParams(spans, !all_param_dtype);
}

absl::StatusOr<RankSession::View> RankSession::InitParamsView() {
  RETURN_IF_ERROR(RequireApply("InitParamsView"));
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  return View{shm_->GradientBuffer(0), shm_->buffer_bytes()};
}

absl::Status RankSession::InitParamsInPlace() {
  RETURN_IF_ERROR(RequireApply("InitParamsInPlace"));
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  return Annotate(shm_->RingInitParams(), "InitParams");
}

absl::StatusOr<uint64_t> RankSession::ParamByteOffset(size_t span) const {
  RETURN_IF_ERROR(RequireApply("param_byte_offset"));
  if (shm_ == nullptr) {
    return absl::FailedPreconditionError(
        "param_byte_offset: not a shared-memory session (over gRPC parameters travel in "
        "messages)");
  }
  if (span >= spans_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("span ", span, " out of range: rank ", rank_,
                                                   " has ", spans_.size(), " spans"));
  }
  for (const ShmSpan& r : shm_->spans()) {
    if (r.matrix == spans_[span].matrix && r.offset == spans_[span].offset) {
      return r.param_byte_offset;
    }
  }
  return absl::InternalError(absl::StrCat("span ", span, " of tensor '",
                                          spec_.matrices[spans_[span].matrix].name,
                                          "' is not in the daemon's shared-memory layout"));
}

absl::StatusOr<uint64_t> RankSession::HyperByteOffset() const {
  RETURN_IF_ERROR(RequireApply("hyper_byte_offset"));
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  return shm_->hyper_byte_offset();
}

}  // namespace muond::client
