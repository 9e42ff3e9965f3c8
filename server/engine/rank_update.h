// What a rank gets back from a step: its spans of the update, in the order of common::RankSpans.
#ifndef MUOND_SERVER_ENGINE_RANK_UPDATE_H_
#define MUOND_SERVER_ENGINE_RANK_UPDATE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/shm_protocol.h"

namespace muond::server {

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
};

// Flags of a shared-memory completion, as the protocol writes them (Completion.flags).
inline constexpr uint32_t kDoneReplayed = common::shm::kCompletionReplayed;
inline constexpr uint32_t kDoneSkipped = common::shm::kCompletionSkipped;

// Called once when a shared-memory submission ends: OK (the update is in the rank's update
// region, or with kDoneSkipped the step was skipped), or why not; `grad_sum_sq` as
// RankUpdate::grad_sum_sq. Runs with the job's lock held: it must not call back into the Job.
using SharedDone = std::function<void(const absl::Status& status, uint32_t flags, double seconds,
                                      double grad_sum_sq)>;

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_RANK_UPDATE_H_
