// The end of a Job's step: commit (the momentum store changes here and only here), refusal and
// abort (the store untouched; an abort fences the job), a rank that leaves, and reset. See job.h.
#include <algorithm>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "server/jobs/gradient_check.h"
#include "server/jobs/job.h"
#include "server/ops/daemon_metrics.h"
#include "server/ops/status_history.h"
#include "server/optim/muon_math.h"

namespace muond::server {

namespace {

// Job::ApplyCommit's pass, over the CPUs. The choice (DESIGN.md 4, "commit after the last shard
// is checked"): the EMA is applied at commit from the ranks' input buffers, split over every CPU,
// not computed during the step (per matrix as it retires, overlapping the device) into a staged
// copy that the commit swaps in, as apply mode's ParamStore does. Why:
//  - Overlap needs that copy. The store may change only once the step is known clean, and until
//    its last batch retired a device error refuses the step with the store untouched; new momentum
//    computed earlier must therefore live beside the committed one: a second pinned copy of the
//    whole momentum for the job's life. Update mode holds the momentum, the gather budget and the
//    gradient buffers (JobFootprint counts that; tests/integration/memory_test.cc bounds it);
//    doubling its largest part, in pinned memory, costs more than a memory-bound pass over all
//    CPUs that touches each gradient byte once.
//  - A staged EMA would come from the host's fp32 staging of each matrix, which the direct-copy
//    path (step_pipeline.h: ranks' regions to the device by DMA) does not have.
// Each piece is widened block by block into a private buffer that stays in cache between the
// non-finite check and the EMA: the values checked are the values applied even if a shared-memory
// peer rewrites its region meanwhile (a check in place and a second read would not be). A bad
// value means the store is partly changed (the serial pass was too): the job is fenced.
// ApplyMomentum works element by element, so cutting the spans changes no bit: the store ends as
// the serial pass over every rank's spans leaves it.

// Elements of one piece of work (a thread takes pieces one at a time) and of one block (widened
// into the private buffer: 64 KiB of float, with the momentum it meets well inside L2).
constexpr uint64_t kCommitPiece = uint64_t{1} << 20;
constexpr size_t kCommitBlock = size_t{1} << 14;

// `spans` consecutive spans of `rank` from span `span`; with one span, elements
// [begin, begin + length) of it (a large span is cut into several pieces), else all of each.
// Small spans are grouped so that a layout of many tiny spans (ZeRO-3 at a large world size)
// makes about as many pieces as its elements call for, not one per span.
struct CommitPiece {
  int rank;
  size_t span;
  size_t spans;
  uint64_t begin;
  uint64_t length;
};

// A piece's first non-finite value: the rank's span and the matrix element (-1: none).
struct CommitFound {
  size_t span = 0;
  int64_t element = -1;
};

// Cuts every rank's spans into pieces of about kCommitPiece elements, in the order of the serial
// pass (rank, span, element); returns the bytes the pass moves (for ParallelFor).
uint64_t CommitPieces(const common::JobSpec& spec, const JobLayout& layout,
                      std::vector<CommitPiece>* pieces) {
  uint64_t bytes = 0;
  for (int r = 0; r < spec.world_size; ++r) {
    const std::vector<common::ShardSpan>& spans = layout.spans(r);
    CommitPiece group{r, 0, 0, 0, 0};  // whole small spans gathered so far
    for (size_t i = 0; i < spans.size(); ++i) {
      const uint64_t n = spans[i].length;
      bytes += n * (common::DTypeSize(spec.matrices[spans[i].matrix].dtype) + 2 * sizeof(float));
      if (group.spans > 0 && group.length + n > kCommitPiece) {
        pieces->push_back(group);
        group = {r, 0, 0, 0, 0};
      }
      if (n >= kCommitPiece) {
        for (uint64_t b = 0; b < n; b += kCommitPiece) {
          pieces->push_back({r, i, 1, b, std::min(kCommitPiece, n - b)});
        }
        continue;
      }
      if (group.spans == 0) group.span = i;
      ++group.spans;
      group.length += n;
    }
    if (group.spans > 0) pieces->push_back(group);
  }
  return bytes;
}

// The EMA of `length` elements of `dtype` at `grad` into `momentum`, block by block through
// `wide` (kCommitBlock floats, private to the thread; see above). Returns the index of the first
// non-finite element (nothing from its block on is applied) or -1.
int64_t CommitRun(const common::MuonConfig& muon, common::DType dtype, const char* grad,
                  float* momentum, uint64_t length, float* wide) {
  const size_t esize = common::DTypeSize(dtype);
  for (uint64_t at = 0; at < length; at += kCommitBlock) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kCommitBlock, length - at));
    common::ToFloat32(dtype, grad + at * esize, n, wide);
    if (const int64_t bad = common::FindNonFinite(wide, n); bad >= 0) {
      return static_cast<int64_t>(at) + bad;
    }
    ApplyMomentum(muon, wide, momentum + at, n);
  }
  return -1;
}

}  // namespace

void Job::Commit(StepState& state) {
  if (spec_.two_phase()) {
    Prepare(state);
    return;
  }
  CommitNow(state);
}

void Job::CommitNow(StepState& state) {
  const absl::Time commit_start = absl::Now();
  if (apply()) {
    // The step computed the next state into the store's back buffers: it becomes the front.
    // Held to the end, as below.
    ParamStore::Lock store(*params_);
    store.Flip();
    state.commit_seconds = absl::ToDoubleSeconds(absl::Now() - commit_start);
    FinishCommit(state, absl::OkStatus());
    return;
  }
  // Every matrix succeeded and every gradient value was checked: apply the momentum EMA to the
  // store. The store changes under its lock (a save in progress gets the old values first).
  // Held to the end: a save cannot begin between the change and the step counter's advance.
  MomentumStore::Lock store(momentum_);
  absl::Status changed;
  if (!spec_.transport_probe) changed = ApplyCommit(state, store);
  state.commit_seconds = absl::ToDoubleSeconds(absl::Now() - commit_start);
  FinishCommit(state, changed);
}

void Job::FinishCommit(StepState& state, const absl::Status& changed) {
  const double seconds = absl::ToDoubleSeconds(absl::Now() - state.start);
  if (changed.ok()) {
    // Outside the job's lock: a scrape reads job status while holding the metrics' locks.
    RecordStepCompleted(id(), seconds);
    const StepPhase phases[5] = {StepPhase::kAssembly, StepPhase::kCopyIn, StepPhase::kNewtonSchulz,
                                 StepPhase::kWriteback, StepPhase::kReturn};
    for (int p = 0; p < 5; ++p) RecordPhase(id(), phases[p], state.phase_seconds[p]);
    RecordPhase(id(), StepPhase::kCommit, state.commit_seconds);
    StepHistory::Default().Record(
        id(), created_unix_ms_,
        {state.step, absl::ToUnixMillis(absl::Now()), seconds,
         {state.phase_seconds[0], state.phase_seconds[1], state.phase_seconds[2],
          state.phase_seconds[3], state.phase_seconds[4], state.commit_seconds}});
    if (state.clip_redo) RecordClipRedo(id());
  }
  absl::MutexLock lock(&mu_);
  state.committing = false;
  if (!changed.ok()) {
    FailStep(state, changed, /*fence=*/true);
    return;
  }
  for (auto& out : state.outputs) out->compute_seconds = seconds;
  last_step_device_seconds_ = state.device_seconds;
  last_updates_.assign(state.outputs.begin(), state.outputs.end());
  state.done = true;
  state.result = absl::OkStatus();
  input_pool_.resize(spec_.world_size);
  for (int r = 0; r < spec_.world_size; ++r) {
    if (!state.ranks[r].owned.empty()) input_pool_[r] = std::move(state.ranks[r].owned);
  }
  ++next_step_;
  ++steps_completed_;
  if (state.clip_redo) ++clip_redo_steps_;
  last_grad_norm_ = state.grad_norm;
  if (in_flight_.get() == &state) in_flight_ = nullptr;
  for (RankInput& in : state.ranks) {
    if (in.done) std::exchange(in.done, nullptr)(absl::OkStatus(), false, seconds);
  }
  state.cv.SignalAll();
  if (spec_.checkpoint_every_steps > 0 && !spec_.transport_probe &&
      static_cast<uint64_t>(steps_completed_) % spec_.checkpoint_every_steps == 0) {
    SaveCheckpointInBackground();
  }
}

absl::Status Job::ApplyCommit(StepState& state, MomentumStore::Lock& store) {
  // Writable pointers first, on this thread: the first hands a save in progress the old values.
  std::vector<float*> momentum(spec_.matrices.size());
  for (uint32_t m = 0; m < momentum.size(); ++m) momentum[m] = store.mutable_data(m);
  std::vector<CommitPiece> pieces;
  const uint64_t bytes = CommitPieces(spec_, layout_, &pieces);
  std::vector<CommitFound> found(pieces.size());
  common::ParallelFor(pieces.size(), bytes, [&](size_t k) {
    const CommitPiece& p = pieces[k];
    const RankInput& in = state.ranks[p.rank];
    const std::unique_ptr<float[]> wide(new float[kCommitBlock]);
    for (size_t i = p.span; i < p.span + p.spans && found[k].element < 0; ++i) {
      const common::ShardSpan& span = layout_.spans(p.rank)[i];
      const uint64_t begin = p.spans == 1 ? p.begin : 0;
      const uint64_t length = p.spans == 1 ? p.length : span.length;
      const common::DType dtype = spec_.matrices[span.matrix].dtype;
      const int64_t bad =
          CommitRun(spec_.muon, dtype, in.span_in[i] + begin * common::DTypeSize(dtype),
                    momentum[span.matrix] + span.offset + begin, length, wide.get());
      if (bad >= 0) found[k] = {i, static_cast<int64_t>(span.offset + begin) + bad};
    }
  });
  // The first bad value in the serial pass's order (rank, span, element). The store is then
  // partly changed (pieces run concurrently), and the job is fenced.
  for (size_t k = 0; k < pieces.size(); ++k) {
    if (found[k].element < 0) continue;
    const common::ShardSpan& span = layout_.spans(pieces[k].rank)[found[k].span];
    return NonFiniteAtCommit(
        absl::StrCat("job '", id(), "' step ", state.step, " rank ", pieces[k].rank),
        spec_.matrices[span.matrix], static_cast<uint64_t>(found[k].element));
  }
  return absl::OkStatus();
}

void Job::DeviceFailed(StepState& state, const absl::Status& status) {
  FailStep(state, status, /*fence=*/false);
}

void Job::FailStep(StepState& state, const absl::Status& status, bool fence) {
  // A step whose commit began is committed: nothing may report it as failed.
  if (state.done || state.committing || state.prepared) return;
  // A step whose ranks are all on shared memory is owned by in_flight_ alone (no RankStep holds
  // it), and in_flight_ is reset below: keep `state` alive until this function returns.
  const std::shared_ptr<StepState> keep = in_flight_.get() == &state ? in_flight_ : nullptr;
  state.done = true;
  state.result = status;
  state.ready.clear();
  for (RankInput& in : state.ranks) {
    if (in.done) std::exchange(in.done, nullptr)(status, false, 0);
  }
  if (in_flight_.get() == &state) in_flight_ = nullptr;
  if (fence) {
    ++steps_aborted_;
    fenced_ = true;
    fence_reason_ = std::string(status.message());
    MUOND_LOG(WARNING) << "job '" << id() << "' fenced: " << status.message();
  } else {
    ++steps_refused_;
    MUOND_LOG(INFO) << "job '" << id() << "' step " << state.step
                    << " refused: " << status.message();
    if (status.code() == absl::StatusCode::kInvalidArgument) {
      std::vector<bool> owed(spec_.world_size);
      for (int r = 0; r < spec_.world_size; ++r) owed[r] = !state.ranks[r].begun;
      refusal_.Record(state.step, status, std::move(owed));
    }
  }
  state.cv.SignalAll();
}

void Job::RefuseSubmission(int rank, uint64_t session, int64_t step, const absl::Status& bad) {
  if (in_flight_ != nullptr && in_flight_->step == step) {
    FailStep(*in_flight_, bad, /*fence=*/false);
    // This rank learns of the refusal from this very answer: it is not owed it again on its
    // retry (it never began the step, so FailStep counted it among the ranks owed it).
    (void)refusal_.Take(rank, step);
  } else if (!deleted_ && !fenced_ && sessions_[rank] == session && step == next_step_) {
    // Refused before any rank began the step: the ranks that submit it later are owed the
    // refusal, or they would begin a step this rank has already left.
    if (refusal_.Owes(rank, step)) {
      (void)refusal_.Take(rank, step);  // a refusal of this same attempt; it learns of it now
    } else {
      ++steps_refused_;
      std::vector<bool> owed(spec_.world_size, true);
      owed[rank] = false;
      refusal_.Record(step, bad, std::move(owed));
      MUOND_LOG(INFO) << "job '" << id() << "' step " << step << " refused: " << bad.message();
    }
  }
}

absl::Status Job::CheckNoStepInFlight(const char* what) const {
  if (in_flight_ == nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("job '", id(), "': step ", in_flight_->step,
                                                    " is in flight; ", what, " after it ends"));
}

absl::Status Job::AbandonRank(const std::shared_ptr<StepState>& state, int rank,
                              const std::string& why) {
  absl::MutexLock lock(&mu_);
  // A commit in progress finishes: wait for it so the answer names the outcome.
  while (state->committing && !state->done) state->cv.WaitWithTimeout(&mu_, kCancelPoll);
  if (state->prepared && !state->done) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' step ", state->step, " rank ", rank, ": ", why,
                     ", but the step is prepared (all data was in): the trainer commits or "
                     "aborts it (CommitStep / AbortStep)"));
  }
  if (state->done) {
    if (!state->result.ok()) return state->result;
    return absl::UnavailableError(
        absl::StrCat("job '", id(), "' step ", state->step, " rank ", rank, ": ", why,
                     ", but the step was already committed (all data was in); ask for step ",
                     state->step, " again to receive its update"));
  }
  const absl::Status aborted = absl::AbortedError(
      absl::StrCat("job '", id(), "' step ", state->step, " aborted: rank ", rank, " ", why));
  FailStep(*state, aborted, /*fence=*/true);
  return aborted;
}

absl::Status Job::Reset(int64_t next_step) {
  if (next_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("next step ", next_step, " is negative"));
  }
  MomentumStore::Lock store(momentum_);
  std::optional<ParamStore::Lock> params;
  if (apply()) params.emplace(*params_);
  absl::MutexLock lock(&mu_);
  DropPrepared("reset");
  RETURN_IF_ERROR(CheckNoStepInFlight("reset"));
  store.Zero();
  if (params) params->ZeroOptimizerState();
  writer_.Forget();
  for (auto& u : last_updates_) u = nullptr;
  next_step_ = next_step;
  fenced_ = false;
  fence_reason_.clear();
  return absl::OkStatus();
}

}  // namespace muond::server
