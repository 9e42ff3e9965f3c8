// What crosses the step engine's edge, plain values only (no pipeline, store or device type): what
// comes into a step with a rank's part (StepHyper) and what a rank gets back (RankUpdate: its spans
// of the update, in the order of common::RankSpans; SharedDone and SharedProgress for shared-memory
// ranks). The jobs room's face (server/jobs/job.h) and the transports above it use these; the rest
// of the engine is visible to the jobs room only (server/LAYERS).
#ifndef MUOND_SERVER_ENGINE_STEP_IO_H_
#define MUOND_SERVER_ENGINE_STEP_IO_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/shm_protocol.h"

namespace muond::server {

// Apply mode (DESIGN.md 4b): a step's hyperparameters, per group in the job's order. Every rank
// of a step sends them; the first rank's are the step's, and a rank whose differ refuses the step.
// Many nodes, apply mode with max_grad_norm (DESIGN.md 4c): where a node's step takes its clip
// coefficient from. The gradient norm spans the nodes, so a node job never clips by its own norm:
// the coordinating client first has every node compute with clip 1 and report its raw sum of
// squares (kSpeculate); when the sum over the nodes calls for clipping, each node computes the
// step again with that global sum (kGlobal).
enum class ClipSource : uint8_t {
  kLocal = 0,      // the job's own norm (a job on one node)
  kSpeculate = 1,  // clip 1; report the node's sum of squares
  kGlobal = 2,     // the clip of `global_sum_sq`, the raw sum of squares over every node
};

struct StepHyper {
  std::vector<double> lr;
  std::vector<double> weight_decay;
  double grad_divisor = 1;
  ClipSource clip_source = ClipSource::kLocal;
  double global_sum_sq = 0;  // kGlobal
  // The presence mask: per job tensor, 1 when no rank has its gradient this step (it is skipped:
  // state, step count and parameters unchanged), else 0. Empty: every tensor has one.
  std::vector<uint8_t> absent;
  // QK-Clip jobs (DESIGN.md 4e): the largest attention logit of each query head, pair after pair
  // (QkClip::logits() values). Not agreed but merged: the step's are the maximum over its ranks'
  // (Job::AgreeHyper), so operator== leaves them out.
  std::vector<float> max_logits;
  bool absent_at(uint32_t t) const { return t < absent.size() && absent[t] != 0; }
  bool operator==(const StepHyper& o) const {
    return lr == o.lr && weight_decay == o.weight_decay && grad_divisor == o.grad_divisor &&
           clip_source == o.clip_source && global_sum_sq == o.global_sum_sq && SameAbsent(o);
  }
  bool SameAbsent(const StepHyper& o) const {
    const size_t n = std::max(absent.size(), o.absent.size());
    for (uint32_t t = 0; t < n; ++t) {
      if (absent_at(t) != o.absent_at(t)) return false;
    }
    return true;
  }
};

// One span of a rank's update, in the matrix's dtype: `size` bytes at `data`, which points into
// the update's own storage (gRPC) or into the rank's shared update region.
struct UpdateSpan {
  uint32_t matrix = 0;
  uint64_t offset = 0;  // elements
  char* data = nullptr;
  size_t size = 0;
};

// A shared-memory rank's progress words (common/shm_protocol.h): `words[i]` is set to step + 1
// when span i's result is in the rank's update region, and `notify` wakes the rank. Empty for
// gRPC ranks.
struct SharedProgress {
  int64_t* words = nullptr;
  std::function<void()> notify;
};

struct RankUpdate {
  int64_t step = -1;
  std::vector<UpdateSpan> spans;  // in the order of common::RankSpans
  double compute_seconds = 0;
  // Apply mode: the raw sum of squares of the step's gradients on this daemon (before the divisor;
  // a node of a multi-node job reports it for the global norm).
  double grad_sum_sq = 0;
  std::vector<std::string> storage;       // owned span bytes (gRPC ranks)
  std::shared_ptr<const void> keepalive;  // the shared region the spans point into (shm ranks)
  SharedProgress progress;                // shm ranks: where finished spans are announced
  // The gradients this update was computed from, as CRC32Cs of kDigestSlice-byte slices of each
  // span in order (set at commit): a replay of the step must re-send the same bytes.
  static constexpr size_t kDigestSlice = size_t{4} << 20;
  std::vector<uint32_t> input_digest;
  // The step was skipped (a non-finite gradient on some rank, "nonfinite": "skip"): no spans, no
  // digest; every rank (and every replay of the step) is told so.
  bool skipped = false;
  // Apply mode, a committed step kept only for replays: the spans say where and how many bytes
  // (data null, no storage); a replay writes them from the committed masters, of which the new
  // parameters are the rounding (ApplyStep::WriteParameters), so no copy of the update is kept.
  bool from_masters = false;
};

// One group's values as a rank sent them (gRPC: GroupHyper).
struct GroupValue {
  std::string group;
  double lr = 0;
  std::optional<double> weight_decay;  // absent: the group's weight_decay
};
// The step's hyper from named values: every group exactly once (INVALID_ARGUMENT naming an unknown,
// repeated or missing group); divisor 0 means 1. Values are checked by CheckStepHyper.
absl::StatusOr<StepHyper> ResolveStepHyper(const common::JobSpec& spec,
                                           const std::vector<GroupValue>& values,
                                           double grad_divisor);
// INVALID_ARGUMENT (prefixed with `where`) unless there is one lr and weight decay per group, each
// finite and >= 0, and the divisor is finite and > 0.
absl::Status CheckStepHyper(const common::JobSpec& spec, const StepHyper& hyper,
                            const std::string& where);
// Part of CheckStepHyper: a multi-node job with max_grad_norm needs a global clip (kSpeculate or
// kGlobal with a finite sum >= 0; FAILED_PRECONDITION without one: no coordinating client), and
// no other job takes one (INVALID_ARGUMENT).
absl::Status CheckClipSource(const common::JobSpec& spec, const StepHyper& hyper,
                             const std::string& where);

// Flags of a shared-memory completion, as the protocol writes them (Completion.flags).
inline constexpr uint32_t kDoneReplayed = common::shm::kCompletionReplayed;
inline constexpr uint32_t kDoneSkipped = common::shm::kCompletionSkipped;

// Called once when a shared-memory submission ends: OK (the update is in the rank's update
// region, or with kDoneSkipped the step was skipped), or why not; `grad_sum_sq` as
// RankUpdate::grad_sum_sq. Runs with the job's lock held: it must not call back into the Job.
using SharedDone = std::function<void(const absl::Status& status, uint32_t flags, double seconds,
                                      double grad_sum_sq)>;

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_STEP_IO_H_
