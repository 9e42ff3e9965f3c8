// Global clipping in the step pipeline (step_pipeline_run.h). With two copies of the state
// (multi-node jobs), the first pass of a step is speculative (clip 1: most steps do not clip, and
// their results stand); when every tensor is done and the step's norm exceeds max_grad_norm, every
// tensor is queued again with the clip coefficient, recomputed from the unchanged committed state
// (the serial result, bit for bit). With one copy, the clip is decided at the seal: the tensors
// computed before it went to the step window with clip 1; the norm pass reads the raw gradients
// of the others (their sums, bit for bit those of their assembly) and the clip is known before
// anything is written in place; only the speculated tensors are recomputed when it clips. What a
// later read reads again must be what the first read read.
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "server/engine/step_pipeline_run.h"
#include "server/optim/grad_norm.h"

namespace muond::server {

bool StepPipeline::Run::RedoForClipping() {
  if (!status_.ok() || state_.done || state_.matrices_done != p_.spec_.matrices.size()) {
    return false;
  }
  if (!apply_mode()) return RedoUpdateForClipping();
  const float clip = LocalClip();
  // A node of a multi-node job: its clip came with the step (clip 1 while speculating).
  if (state_.hyper.clip_source == ClipSource::kGlobal) {
    state_.grad_norm = std::sqrt(state_.hyper.global_sum_sq) / state_.hyper.grad_divisor;
  }
  if (state_.clip_redo || state_.hyper.clip_source != ClipSource::kLocal) return false;
  if (clip >= 1.0f) return false;
  return QueueAgain(clip, ApplyStep::GradScale(clip, state_.hyper.grad_divisor));
}

// Update mode with max_grad_norm: the norm spans the job's matrices and every rank's share of
// the tensors outside the job, which comes with the rank's last part; until every rank's is in
// nothing is decided (the commit waits too: Finish, Job::CommitWhenComplete).
bool StepPipeline::Run::RedoUpdateForClipping() {
  if (!p_.spec_.clips_outside_share() || state_.clip_redo || !state_.every_rank_pushed()) {
    return false;
  }
  const float clip = LocalClip();
  if (clip >= 1.0f) return false;
  return QueueAgain(clip, clip);
}

float StepPipeline::Run::LocalClip() {
  if (apply_mode()) {
    state_.grad_norm = ApplyStep::GradNorm(state_);
    return p_.apply_->ClipCoefficient(state_);
  }
  const double total = state_.TotalSumSq();
  state_.grad_norm = std::sqrt(total);
  return server::ClipCoefficient(total, p_.spec_.max_grad_norm);
}

bool StepPipeline::Run::QueueAgain(float clip, float grad_scale) {
  std::vector<uint32_t> again;
  if (state_.clip_decided) {
    again = state_.speculated;  // the others were computed with the clip
  } else {
    for (uint32_t m = 0; m < p_.spec_.matrices.size(); ++m) again.push_back(m);
  }
  if (again.empty()) return false;
  state_.clip = clip;
  state_.clip_redo = true;
  state_.grad_scale = grad_scale;
  state_.matrices_done -= again.size();
  state_.ready = std::move(again);
  return true;
}

bool StepPipeline::Run::NeedsNormPass() const {
  if (p_.StateTwoCopies() || p_.spec_.transport_probe || !(p_.spec_.max_grad_norm > 0)) {
    return false;
  }
  return apply_mode() ? state_.hyper.clip_source == ClipSource::kLocal
                      : p_.spec_.clips_outside_share();
}

void StepPipeline::Run::DecideClip() {
  std::vector<uint32_t> unread, speculated;
  {
    absl::MutexLock lock(p_.job_mu_);
    unread = state_.ready;  // sealed: every tensor not taken yet is ready
    speculated = state_.speculated;
  }
  if (state_.read_crc.empty()) state_.read_crc.resize(p_.spec_.matrices.size());
  for (uint32_t m : unread) {
    if (apply_mode() && state_.hyper.absent_at(m)) continue;  // carried: no gradient
    status_ = NormPassRead(m, /*sum=*/true);
    if (!status_.ok()) break;
  }
  float clip = 1.0f;
  if (status_.ok()) {
    absl::MutexLock lock(p_.job_mu_);
    clip = LocalClip();
  }
  // It clips: the speculated tensors are computed again at the end, after tensors were written
  // in place. What they read then must be what they first read: checked here too, while a
  // refusal still changes nothing.
  for (size_t i = 0; status_.ok() && clip < 1.0f && i < speculated.size(); ++i) {
    if (apply_mode() && state_.hyper.absent_at(speculated[i])) continue;
    status_ = NormPassRead(speculated[i], /*sum=*/false);
  }
  absl::MutexLock lock(p_.job_mu_);
  state_.clip_decided = true;
  if (!status_.ok()) {
    refused_ = true;
    return;
  }
  state_.clip = clip;
  state_.grad_scale = apply_mode() ? ApplyStep::GradScale(clip, state_.hyper.grad_divisor) : clip;
}

absl::Status StepPipeline::Run::NormPassRead(uint32_t m, bool sum) {
  // The slices every assembly of the tensor reads (AssembleOnHost, ReadDirectGradient).
  const std::vector<JobLayout::OwnerSlice> slices = p_.layout_.OwnerSlices(m, uint64_t{1} << 20);
  if (sum) {
    std::vector<ApplyStep::RawPiece> pieces = RawPieces(m, slices);
    double ss = 0;
    if (apply_mode()) {
      RETURN_IF_ERROR(p_.apply_->CheckRawGradient(state_, m, std::move(pieces), &ss));
    } else {
      RETURN_IF_ERROR(ApplyStep::RawSumOfSquares(p_.spec_.matrices[m], &pieces, &ss));
    }
    state_.sum_sq[m] = ss;
  }
  return CheckSlices(m, slices);
}

std::vector<ApplyStep::RawPiece> StepPipeline::Run::RawPieces(
    uint32_t m, const std::vector<JobLayout::OwnerSlice>& slices) const {
  const size_t esize = common::DTypeSize(p_.spec_.matrices[m].dtype);
  std::vector<ApplyStep::RawPiece> pieces;
  pieces.reserve(slices.size());
  for (const JobLayout::OwnerSlice& s : slices) {
    const common::ShardSpan& span = p_.layout_.spans(s.ref->rank)[s.ref->span];
    pieces.push_back({span.offset + s.begin, s.length,
                      state_.ranks[s.ref->rank].span_in[s.ref->span] + s.begin * esize});
  }
  return pieces;
}

absl::Status StepPipeline::Run::CheckSlices(uint32_t m,
                                            const std::vector<JobLayout::OwnerSlice>& slices) {
  const common::MatrixSpec& ms = p_.spec_.matrices[m];
  const size_t esize = common::DTypeSize(ms.dtype);
  std::vector<uint32_t> crc(slices.size());
  common::ParallelFor(slices.size(), static_cast<uint64_t>(ms.numel()) * esize, [&](size_t k) {
    const JobLayout::SpanRef& ref = *slices[k].ref;
    crc[k] = common::Crc32c(state_.ranks[ref.rank].span_in[ref.span] + slices[k].begin * esize,
                            slices[k].length * esize);
  });
  return CheckReread(m, slices, std::move(crc));  // the first read records, a later one compares
}

// The first read of tensor m's raw gradients (its first computation, or the norm pass) keeps the
// CRC32C of every slice; a later read (the redo, the computation after the norm pass) refuses the
// step (INVALID_ARGUMENT) when one differs: the step's norm and clip coefficient came from the
// bytes first read, and its result must too.
absl::Status StepPipeline::Run::CheckReread(uint32_t m,
                                            const std::vector<JobLayout::OwnerSlice>& slices,
                                            std::vector<uint32_t> crc) {
  if (state_.read_crc.empty()) state_.read_crc.resize(p_.spec_.matrices.size());
  std::vector<uint32_t>& first = state_.read_crc[m];
  if (first.empty()) {  // the first read of the tensor this step
    first = std::move(crc);
    return absl::OkStatus();
  }
  for (size_t k = 0; k < slices.size() && k < first.size(); ++k) {
    if (crc[k] == first[k]) continue;
    const JobLayout::SpanRef& ref = *slices[k].ref;
    const uint64_t begin = p_.layout_.spans(ref.rank)[ref.span].offset + slices[k].begin;
    return absl::InvalidArgumentError(
        absl::StrCat("job '", p_.spec_.job_id, "' step ", state_.step, ": rank ", ref.rank,
                     "'s gradient of tensor '", p_.spec_.matrices[m].name, "' (elements ", begin,
                     " to ", begin + slices[k].length,
                     ") changed after it was read, before the step ended (global clipping reads "
                     "gradients again); the step is refused and nothing changed"));
  }
  return absl::OkStatus();
}

}  // namespace muond::server
