// The state of a job's step in flight, shared by the Job (ranks, commit) and its StepPipeline
// (the device work), and the bookkeeping of a refused step. Internal to server/jobs.
#ifndef MUOND_SERVER_ENGINE_STEP_STATE_H_
#define MUOND_SERVER_ENGINE_STEP_STATE_H_

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/engine/heap_trimmer.h"
#include "server/engine/step_io.h"

namespace muond::server {

// Largest data chunk accepted on any data path.
inline constexpr size_t kMaxChunkBytes = size_t{4} << 20;
// Separate pieces (not adjacent to one another) of one span a gRPC rank may have sent at once.
inline constexpr size_t kMaxClaimedRanges = 4096;
// Claims elements [offset, offset + count) in `claimed` (one span's element ranges received so far
// over gRPC: a step's gradient chunks, or an upload of initial parameters). Adjacent ranges merge,
// so a span sent in order is one entry; a client that scatters tiny chunks is bounded to
// kMaxClaimedRanges separate pieces (the bookkeeping is memory the client makes the daemon hold).
enum class ClaimResult { kClaimed, kOverlaps, kTooManyPieces };
inline ClaimResult ClaimRange(std::map<uint64_t, uint64_t>& claimed, uint64_t offset,
                              uint64_t count) {
  auto next = claimed.lower_bound(offset);
  if ((next != claimed.end() && next->first < offset + count) ||
      (next != claimed.begin() && std::prev(next)->second > offset)) {
    return ClaimResult::kOverlaps;
  }
  auto prev = next == claimed.begin() ? claimed.end() : std::prev(next);
  if (prev != claimed.end() && prev->second == offset) {
    prev->second = offset + count;
    if (next != claimed.end() && next->first == prev->second) {
      prev->second = next->second;
      claimed.erase(next);
    }
  } else if (next != claimed.end() && next->first == offset + count) {
    const uint64_t end = next->second;
    claimed.erase(next);
    claimed.emplace(offset, end);
  } else if (claimed.size() >= kMaxClaimedRanges) {
    return ClaimResult::kTooManyPieces;
  } else {
    claimed.emplace(offset, offset + count);
  }
  return ClaimResult::kClaimed;
}

// How often a rank waiting for the step's commit checks whether it went away.
inline constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

// One rank's input for the step: where the gradient bytes of each of its spans are. A gRPC rank's
// chunks are copied into `owned`; a shared-memory rank's spans point into its gradient region.
struct RankInput {
  std::vector<const char*> span_in;                   // per span, the matrix dtype
  std::vector<std::string> owned;                     // gRPC: the storage span_in points into
  std::vector<std::map<uint64_t, uint64_t>> claimed;  // gRPC, per span: element ranges received
  std::vector<uint64_t> span_received;                // per span: elements in
  SharedDone done;                                    // shared memory: the completion
  std::shared_ptr<const void> keepalive;              // shared memory: the regions
  bool begun = false;
  bool finished = false;
  bool parts_open = false;  // shared memory: the rank sends the step in parts, the last not in
  // Update mode with max_grad_norm: the rank's sum of squares of its gradients outside the job
  // (the tensors the trainer updates itself), which came with its last part (gRPC: StepEnd).
  double outside_sum_sq = 0;
  // The rank has sent its whole part: a gRPC rank's StepEnd, a shared-memory rank's submission
  // (its done callback is set).
  bool pushed() const { return finished || done != nullptr; }
};

// The step in flight. Guarded by the owning Job's mu_, except the bytes of the input buffers
// (written outside the lock into ranges claimed under it, read by compute once a matrix is
// complete) and of the output buffers (written by compute, read after commit).
struct StepState {
  HeapTrimmer::Activity activity;  // the heap is trimmed when no step is in flight
  int64_t step = 0;
  absl::Time start;       // the step's first gradient byte in (its first rank began)
  absl::Time last_input;  // its last gradient byte in: the last matrix became complete
  std::vector<RankInput> ranks;
  std::vector<std::shared_ptr<RankUpdate>> outputs;  // per rank, set when the rank begins
  std::vector<uint64_t> matrix_received;             // elements, all ranks
  size_t matrices_complete = 0;                      // matrices whose every element is in
  std::vector<uint32_t> ready;                       // complete matrices not yet taken
  bool drain_queued = false;                         // a DrainReady task is queued or running
  size_t matrices_done = 0;
  // No shared-memory rank that began the step still owes its last part. Only then may the step
  // commit, even when every matrix is computed: until its last part such a rank may still drop
  // the step (a part that refuses it: DESIGN.md 4d, "nothing of the step committed"). A gRPC rank
  // does not hold the commit: its step commits once all data is in, and a chunk after that is
  // answered as part of the committed step (it has no way to drop a step but closing its stream).
  bool last_parts_in() const {
    for (const RankInput& r : ranks) {
      if (r.keepalive != nullptr && !r.pushed()) return false;
    }
    return true;
  }
  // Update mode with max_grad_norm: the step's norm adds every rank's outside_sum_sq, which comes
  // with the rank's last part (gRPC: its StepEnd), so the norm, the clip and the commit wait for
  // every rank's, gRPC ranks' included.
  bool every_rank_pushed() const {
    for (const RankInput& r : ranks) {
      if (!r.pushed()) return false;
    }
    return true;
  }
  // The raw sum of squares of the step's gradients (before any divisor): the job's tensors' on
  // this daemon, tensor by tensor in order (apply mode; update mode with max_grad_norm), plus
  // every rank's outside_sum_sq (0 but in update mode with max_grad_norm). Complete when every
  // tensor is done and, for the outside shares, every rank's last part is in.
  double TotalSumSq() const {
    double total = 0;
    for (double ss : sum_sq) total += ss;
    for (const RankInput& r : ranks) total += r.outside_sum_sq;
    return total;
  }
  // The step is sealed: every matrix complete, every shared-memory rank's last part in (and, in
  // update mode with max_grad_norm, every rank's outside share). Every gradient was checked on
  // arrival, so nothing but a device error (or a peer that rewrote its region: the device checks
  // again) can refuse the step from here; the state store may then be updated in place.
  bool sealed(size_t matrices, bool clips_outside_share) const {
    return matrices_complete == matrices && last_parts_in() &&
           (!clips_outside_share || every_rank_pushed());
  }
  // The state store: the pipeline began this step on it (StateBuffers::BeginStep), the step
  // window bytes its matrices computed before the seal reserved, and whether it planned any
  // matrix in place (then the step can no longer be refused with the state unchanged: a failure
  // fences the job, FailStep).
  bool store_begun = false;
  uint64_t window_reserved = 0;
  bool in_place = false;
  double device_seconds = 0;  // the simulated device's clock spent on this step (DrainReady)
  bool done = false;
  // Set when the step ended as a skipped step ("nonfinite": "skip"; done is set, result OK):
  // every rank's answer (`outputs` stay, the pipeline may still be writing them).
  std::shared_ptr<const RankUpdate> skipped_update;
  bool skipped() const { return skipped_update != nullptr; }
  // Set (under the job's lock) when every matrix succeeded and Commit starts changing the store:
  // from then on the step can no longer be aborted or refused; it ends committed (or, if Commit
  // itself finds a changed gradient, fenced). Whoever races with it learns the commit.
  bool committing = false;
  // Two-phase jobs (multinode, job_prepare.cc): every matrix succeeded, the ranks have their
  // results, and the state store is unchanged until CommitStep (or AbortStep drops the step).
  // Nothing else fails a prepared step: FailStep leaves it alone.
  bool prepared = false;
  absl::Time prepared_at;  // when `prepared` was set (the prepare timeout counts from it)
  absl::Status result;
  absl::CondVar cv;
  // Seconds per phase of the step, for the metrics: assembly, copy-in, Newton-Schulz, writeback,
  // return (scatter into the ranks' outputs). Written by the executor thread only.
  double phase_seconds[5] = {0, 0, 0, 0, 0};
  // Seconds Job::Commit spent changing the state store (update mode: the momentum EMA over every
  // rank's span; apply mode: the flip), for the "commit" phase. Written by the committing thread.
  double commit_seconds = 0;

  // Apply mode. `hyper` is set by the first rank to enter (hyper_rank).
  StepHyper hyper;
  int hyper_rank = -1;
  // Per tensor: the float64 sum of squares of its raw gradient (before the divisor), written by
  // the executor thread when the tensor is assembled (apply mode; update mode with max_grad_norm).
  std::vector<double> sum_sq;
  // What every gradient value is multiplied by: clip / grad_divisor, rounded to float once.
  float grad_scale = 1;
  // The clip coefficient (1 until the norm is known to exceed max_grad_norm) and whether the step
  // is being recomputed with it.
  float clip = 1;
  bool clip_redo = false;
  // One copy of the state (README "Memory"): the clip is decided at the seal, from every tensor's
  // sum (the norm pass, step_pipeline_clip.cc), before anything is written in place; the tensors
  // computed before it (`speculated`, clip 1, into the step window) are the only ones recomputed
  // when it clips.
  bool clip_decided = false;
  std::vector<uint32_t> speculated;
  // With clipping on: per tensor, the CRC32C of each assembly slice of the raw gradients as they
  // were first read (its first computation, or the norm pass); a later read (the clip redo, or the
  // computation after the norm pass) refuses the step if any changed (a peer that rewrote its
  // region before the step ended). Executor thread only.
  std::vector<std::vector<uint32_t>> read_crc;
  double grad_norm = 0;  // after the divisor, before clipping; known when every tensor is done
  // QK-Clip (ApplyStep::QkClip): query heads clipped, and the largest max logit of the step.
  int qk_heads_clipped = 0;
  float qk_max_logit = -std::numeric_limits<float>::infinity();
};

// The last refused step: ranks that had not begun it when it was refused get the refusal once
// when they begin it, so every rank learns of it and none mixes old gradients into a retry.
class StepRefusal {
 public:
  // Step `step` was refused with `status`; `owed[r]`: rank r has not been told.
  void Record(int64_t step, absl::Status status, std::vector<bool> owed) {
    step_ = step;
    status_ = std::move(status);
    owed_ = std::move(owed);
  }
  // The refusal `rank` is owed for `step`, if any (and marks it told).
  absl::Status Take(int rank, int64_t step) {
    if (!Owes(rank, step)) return absl::OkStatus();
    owed_[rank] = false;
    return status_;
  }
  bool Owes(int rank, int64_t step) const {
    return step_ == step && static_cast<size_t>(rank) < owed_.size() && owed_[rank];
  }
  void Clear() { *this = StepRefusal(); }

 private:
  int64_t step_ = -1;
  absl::Status status_;
  std::vector<bool> owed_;  // per rank: has not been told yet
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_STEP_STATE_H_
