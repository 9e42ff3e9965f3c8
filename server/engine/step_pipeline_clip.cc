// Global clipping in the step pipeline (step_pipeline_run.h): the first pass of a step is
// speculative (clip 1: most steps do not clip, and their results stand); when every tensor is done
// and the step's norm exceeds max_grad_norm, every tensor is queued again with the clip
// coefficient, recomputed from the unchanged committed state (the serial result, bit for bit),
// and what the redo reads again must be what the first pass read.
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/engine/step_pipeline_run.h"
#include "server/optim/grad_norm.h"

namespace muond::server {

bool StepPipeline::Run::RedoForClipping() {
  if (!status_.ok() || state_.done || state_.matrices_done != p_.spec_.matrices.size()) {
    return false;
  }
  if (!apply_mode()) return RedoUpdateForClipping();
  state_.grad_norm = ApplyStep::GradNorm(state_);
  // A node of a multi-node job: its clip came with the step (clip 1 while speculating).
  if (state_.hyper.clip_source == ClipSource::kGlobal) {
    state_.grad_norm = std::sqrt(state_.hyper.global_sum_sq) / state_.hyper.grad_divisor;
  }
  if (state_.clip_redo || state_.hyper.clip_source != ClipSource::kLocal) return false;
  const float clip = p_.apply_->ClipCoefficient(state_);
  if (clip >= 1.0f) return false;
  QueueEveryMatrixAgain(clip, ApplyStep::GradScale(clip, state_.hyper.grad_divisor));
  return true;
}

// Update mode with max_grad_norm: the norm spans the job's matrices and every rank's share of
// the tensors outside the job, which comes with the rank's last part; until every rank's is in
// nothing is decided (the commit waits too: Finish, Job::CommitWhenComplete).
bool StepPipeline::Run::RedoUpdateForClipping() {
  if (!p_.spec_.clips_outside_share() || state_.clip_redo || !state_.every_rank_pushed()) {
    return false;
  }
  const double total = state_.TotalSumSq();
  state_.grad_norm = std::sqrt(total);
  const float clip = server::ClipCoefficient(total, p_.spec_.max_grad_norm);
  if (clip >= 1.0f) return false;
  QueueEveryMatrixAgain(clip, clip);
  return true;
}

void StepPipeline::Run::QueueEveryMatrixAgain(float clip, float grad_scale) {
  state_.clip = clip;
  state_.clip_redo = true;
  state_.grad_scale = grad_scale;
  state_.matrices_done = 0;
  state_.ready.clear();
  for (uint32_t m = 0; m < p_.spec_.matrices.size(); ++m) state_.ready.push_back(m);
}

// The first pass keeps the CRC32C of every slice of tensor m's raw gradients it read; the redo,
// which reads them again, refuses the step (INVALID_ARGUMENT, nothing committed) when one
// differs: the step's norm and clip coefficient came from the bytes first read, and its result
// must too.
absl::Status StepPipeline::Run::CheckReread(uint32_t m,
                                            const std::vector<JobLayout::OwnerSlice>& slices,
                                            std::vector<uint32_t> crc) {
  if (state_.read_crc.empty()) state_.read_crc.resize(p_.spec_.matrices.size());
  std::vector<uint32_t>& first = state_.read_crc[m];
  if (!state_.clip_redo) {
    first = std::move(crc);
    return absl::OkStatus();
  }
  for (size_t k = 0; k < slices.size() && k < first.size(); ++k) {
    if (crc[k] == first[k]) continue;
    const JobLayout::SpanRef& ref = *slices[k].ref;
    const uint64_t begin = p_.layout_.spans(ref.rank)[ref.span].offset + slices[k].begin;
    return absl::InvalidArgumentError(absl::StrCat(
        "job '", p_.spec_.job_id, "' step ", state_.step, ": rank ", ref.rank,
        "'s gradient of tensor '", p_.spec_.matrices[m].name, "' (elements ", begin, " to ",
        begin + slices[k].length,
        ") changed after it was read, before the step ended (global clipping reads every "
        "gradient again); the step is refused and nothing changed"));
  }
  return absl::OkStatus();
}

}  // namespace muond::server
