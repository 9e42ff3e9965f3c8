// Apply mode's side of a Job (DESIGN.md 4b): the entry rules of a step (initial weights complete,
// one set of hyperparameters for every rank), the initial weights (ranks' uploads and init_from),
// and the export of the masters. The step itself: step_pipeline.cc with apply_step.cc; the
// commit flips the ParamStore (job_commit.cc); checkpoints: job_checkpoint.cc. See job.h.
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/engine/apply_step.h"
#include "server/jobs/job_impl.h"
#include "server/optim/grad_norm.h"

namespace muond::server {
namespace {

// The tensor's initial-parameter dtype on the wire.
common::DType UploadDType(const common::MatrixSpec& ms, bool float32) {
  return float32 ? common::DType::kFloat32 : ms.param_dtype;
}

}  // namespace

absl::Status JobImpl::CheckApplyEntry(int64_t step, const StepHyper* hyper) const {
  const std::string where = absl::StrCat("job '", id(), "' step ", step);
  if (!apply()) {
    if (hyper == nullptr) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     ": the job is in mode 'update'; a step takes no lr, weight decay or gradient "
                     "divisor there"));
  }
  if (hyper == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": mode 'apply' needs the lr of every group with each step (",
                     spec_.groups.size(), " groups)"));
  }
  RETURN_IF_ERROR(CheckStepHyper(spec_, *hyper, where));
  const std::vector<int> missing = RanksMissingWeights();
  if (missing.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(where, " cannot run: the initial weights of rank",
                   missing.size() > 1 ? "s " : " ", absl::StrJoin(missing, ", "),
                   " are not in; upload them (muonctl params init, InitParams) "
                   "or create the job with init_from; nothing changed"));
}

absl::Status JobImpl::AgreeHyper(StepState& state, int rank, const StepHyper& hyper) {
  if (state.hyper_rank < 0) {
    state.hyper = hyper;
    state.hyper_rank = rank;
    if (hyper.clip_source == ClipSource::kGlobal) {  // the nodes' norm, known before the step
      const double d = hyper.grad_divisor;
      state.clip = ClipCoefficient(hyper.global_sum_sq / (d * d), spec_.max_grad_norm);
    }
    state.grad_scale = ApplyStep::GradScale(state.clip, hyper.grad_divisor);
    return absl::OkStatus();
  }
  if (state.hyper == hyper) {
    // QK-Clip: the step's per-head maxima are the maximum over its ranks'. Validated (count and
    // finiteness) by CheckStepHyper before.
    std::vector<float>& merged = state.hyper.max_logits;
    for (size_t i = 0; i < merged.size() && i < hyper.max_logits.size(); ++i) {
      merged[i] = std::max(merged[i], hyper.max_logits[i]);
    }
    return absl::OkStatus();
  }
  std::string what;
  for (size_t g = 0; g < spec_.groups.size() && what.empty(); ++g) {
    if (hyper.lr[g] != state.hyper.lr[g]) {
      what = absl::StrCat("lr of group '", spec_.groups[g].name, "': ", hyper.lr[g], " vs ",
                          state.hyper.lr[g]);
    } else if (hyper.weight_decay[g] != state.hyper.weight_decay[g]) {
      what = absl::StrCat("weight decay of group '", spec_.groups[g].name,
                          "': ", hyper.weight_decay[g], " vs ", state.hyper.weight_decay[g]);
    }
  }
  for (uint32_t t = 0; t < spec_.matrices.size() && what.empty(); ++t) {
    if (hyper.absent_at(t) != state.hyper.absent_at(t)) {
      what = absl::StrCat("tensor '", spec_.matrices[t].name, "' has ",
                          hyper.absent_at(t) ? "no gradient" : "a gradient", " vs ",
                          state.hyper.absent_at(t) ? "none" : "one",
                          " (the presence mask; reduce it over the ranks first)");
    }
  }
  if (what.empty() && (hyper.clip_source != state.hyper.clip_source ||
                       hyper.global_sum_sq != state.hyper.global_sum_sq)) {
    what = absl::StrCat("global clip: mode ", static_cast<int>(hyper.clip_source), " sum ",
                        hyper.global_sum_sq, " vs mode ",
                        static_cast<int>(state.hyper.clip_source), " sum ",
                        state.hyper.global_sum_sq);
  }
  if (what.empty()) {
    what = absl::StrCat("gradient divisor: ", hyper.grad_divisor, " vs ", state.hyper.grad_divisor);
  }
  const absl::Status bad = absl::InvalidArgumentError(
      absl::StrCat("job '", id(), "' step ", state.step, ": rank ", rank, " and rank ",
                   state.hyper_rank, " disagree on the step's hyperparameters (", what,
                   "); the step is refused for every rank, nothing changed"));
  FailStep(state, bad, /*fence=*/false);
  (void)refusal_.Take(rank, state.step);  // this rank learns of it from this very answer
  return bad;
}

std::vector<int> JobImpl::RanksMissingWeights() const {
  std::vector<int> missing;
  for (int r = 0; r < spec_.world_size; ++r) {
    if (!weights_in_[r]) missing.push_back(r);
  }
  return missing;
}

bool JobImpl::WeightsComplete() const {
  absl::MutexLock lock(&mu_);
  return apply() && RanksMissingWeights().empty();
}

absl::StatusOr<uint64_t> JobImpl::InitParams(int rank, uint64_t session,
                                         const std::vector<const char*>& in, bool float32) {
  RETURN_IF_ERROR(CheckRank(rank));
  const std::string where = absl::StrCat("job '", id(), "' rank ", rank, " initial parameters");
  if (!apply()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": the job is in mode 'update' and holds no parameters"));
  }
  const std::vector<common::ShardSpan>& spans = layout_.spans(rank);
  if (in.size() != spans.size()) {
    return absl::InternalError(absl::StrCat(where, ": ", in.size(), " spans for ", spans.size()));
  }
  uint64_t elements = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const common::MatrixSpec& ms = spec_.matrices[spans[i].matrix];
    const int64_t bad = common::FindNonFiniteRaw(UploadDType(ms, float32), in[i], spans[i].length);
    if (bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": tensor '", ms.name, "' element ",
                                                     spans[i].offset + bad,
                                                     " is not finite; nothing changed"));
    }
    elements += spans[i].length;
  }
  ParamStore::Lock store(*params_);
  absl::MutexLock lock(&mu_);
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  RETURN_IF_ERROR(CheckCurrentSession(rank, session, "; attach the rank first"));
  RETURN_IF_ERROR(CheckNoStepInFlight("upload initial parameters"));
  InstallParams(store, rank, in, float32);
  // A shared-memory peer could have changed its region after the check above: what went in is
  // checked again, and a rank whose masters are not finite must upload again.
  for (size_t i = 0; i < spans.size(); ++i) {
    const float* w = params_->front(spans[i].matrix, ParamStore::kMaster) + spans[i].offset;
    if (common::FindNonFinite(w, spans[i].length) >= 0) {
      weights_in_[rank] = false;
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": tensor '", spec_.matrices[spans[i].matrix].name,
          "' changed to a non-finite value while it was read; upload the rank's weights again"));
    }
  }
  weights_in_[rank] = true;
  MUOND_LOG(INFO) << where << ": " << elements << " elements installed";
  return elements;
}

void JobImpl::InstallParams(ParamStore::Lock& store, int rank, const std::vector<const char*>& in,
                        bool float32) {
  rollback_step_.store(-1);  // the front's masters change: the old front would lose them
  const std::vector<common::ShardSpan>& spans = layout_.spans(rank);
  for (size_t i = 0; i < spans.size(); ++i) {
    const common::MatrixSpec& ms = spec_.matrices[spans[i].matrix];
    float* w = store.mutable_front(spans[i].matrix, ParamStore::kMaster) + spans[i].offset;
    common::ToFloat32(UploadDType(ms, float32), in[i], spans[i].length, w);
  }
}

absl::StatusOr<std::unique_ptr<ParamUpload>> JobImpl::BeginParamUpload(int rank, uint64_t session,
                                                                   bool float32) {
  RETURN_IF_ERROR(CheckRank(rank));
  absl::MutexLock lock(&mu_);
  if (!apply()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' is in mode 'update' and holds no parameters to upload"));
  }
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  RETURN_IF_ERROR(CheckCurrentSession(rank, session, "; attach the rank first"));
  if (uploading_[rank]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", id(), "' rank ", rank, " already has an upload of initial parameters running"));
  }
  uploading_[rank] = true;
  return std::unique_ptr<ParamUpload>(new ParamUpload(shared_from_this(), rank, session, float32));
}

ParamUpload::ParamUpload(std::shared_ptr<JobImpl> job, int rank, uint64_t session, bool float32)
    : job_(std::move(job)), rank_(rank), session_(session), float32_(float32) {
  const size_t n = job_->layout_.spans(rank).size();
  data_.resize(n);
  claimed_.resize(n);
  received_.assign(n, 0);
}

ParamUpload::~ParamUpload() {
  absl::MutexLock lock(&job_->mu_);
  job_->uploading_[rank_] = false;
}

absl::Status ParamUpload::Add(uint32_t tensor, uint64_t offset, std::string_view data,
                              uint32_t crc32c) {
  const common::JobSpec& spec = job_->spec();
  const std::string where =
      absl::StrCat("job '", spec.job_id, "' rank ", rank_, " initial parameters");
  if (tensor >= spec.matrices.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": tensor index ", tensor,
                                                   " out of range (the job has ",
                                                   spec.matrices.size(), " tensors)"));
  }
  const common::MatrixSpec& ms = spec.matrices[tensor];
  const common::DType dtype = UploadDType(ms, float32_);
  const size_t esize = common::DTypeSize(dtype);
  if (data.empty() || data.size() > kMaxChunkBytes || data.size() % esize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": tensor '", ms.name, "' chunk at element ", offset, " has ",
                     data.size(), " bytes; expected a non-empty multiple of ", esize, " (",
                     std::string(DTypeName(dtype)), ") of at most ", kMaxChunkBytes));
  }
  if (common::Crc32c(data.data(), data.size()) != crc32c) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": tensor '", ms.name, "' chunk at element ", offset, ": CRC32C mismatch"));
  }
  const uint64_t count = data.size() / esize;
  const std::optional<size_t> span = job_->layout_.FindSpan(rank_, tensor, offset, count);
  if (!span) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": tensor '", ms.name, "' elements [",
                                                   offset, ", ", offset + count,
                                                   ") are outside the rank's shard of the tensor"));
  }
  if (const int64_t bad = common::FindNonFiniteRaw(dtype, data.data(), count); bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": tensor '", ms.name, "' element ", offset + bad, " is not finite"));
  }
  switch (ClaimRange(claimed_[*span], offset, count)) {
    case ClaimResult::kClaimed:
      break;
    case ClaimResult::kOverlaps:
      return absl::InvalidArgumentError(absl::StrCat(where, ": tensor '", ms.name, "' elements [",
                                                     offset, ", ", offset + count,
                                                     ") overlap data already received"));
    case ClaimResult::kTooManyPieces:
      return absl::ResourceExhaustedError(absl::StrCat(
          where, ": tensor '", ms.name, "': too many separate pieces; send chunks in order"));
  }
  const common::ShardSpan& s = job_->layout_.spans(rank_)[*span];
  if (data_[*span].empty()) data_[*span].resize(s.length * esize);  // the rank's own span
  std::memcpy(data_[*span].data() + (offset - s.offset) * esize, data.data(), data.size());
  received_[*span] += count;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ParamUpload::Finish() {
  const std::vector<common::ShardSpan>& spans = job_->layout_.spans(rank_);
  std::vector<const char*> in;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (received_[i] != spans[i].length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", job_->id(), "' rank ", rank_, " initial parameters: tensor '",
          job_->spec().matrices[spans[i].matrix].name, "' is incomplete: received ", received_[i],
          " of ", spans[i].length, " elements of the rank's span at element ", spans[i].offset,
          "; nothing changed"));
    }
    in.push_back(data_[i].data());
  }
  return job_->InitParams(rank_, session_, in, float32_);
}

absl::Status JobImpl::ExportParams(
    const std::function<absl::Status(uint32_t tensor, const std::vector<float>& w)>& sink,
    int64_t* step) {
  if (!apply()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' is in mode 'update': it holds no parameters to export"));
  }
  // The snapshot machinery is the checkpoint writer's: one at a time per job. The masters are
  // copied whole under it and handed to `sink` (the network) only after it is released, so a
  // reader that stops reading holds up none of the job's saves, loads, reset or delete.
  std::vector<std::vector<float>> masters(spec_.matrices.size());
  {
    CheckpointWriter::Exclusive exclusive(writer_);
    {
      ParamStore::Lock store(*params_, StateBuffers::Lock::AtStepBoundary{});
      absl::MutexLock lock(&mu_);
      if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
      if (const std::vector<int> missing = RanksMissingWeights(); !missing.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("job '", id(), "': the initial weights of rank ", missing[0],
                         " are not in; nothing to export"));
      }
      *step = next_step_;
      store.BeginSnapshot();
    }
    for (uint32_t t = 0; t < spec_.matrices.size(); ++t) {
      params_->CopyForSnapshot(t, ParamStore::kMaster, &masters[t]);
    }
    params_->EndSnapshot();
  }
  for (uint32_t t = 0; t < masters.size(); ++t) {
    RETURN_IF_ERROR(sink(t, masters[t]));
    std::vector<float>().swap(masters[t]);  // handed out: give the memory back early
  }
  return absl::OkStatus();
}

}  // namespace muond::server
