// Which elements of which matrix each rank of a job owns (DESIGN.md section 4).
//
// A span is a run of consecutive elements of one matrix (row-major, flattened). For zero_stage 0
// (world size 1) rank 0 owns every matrix whole. Stage 1/2 and stage 3 partitions are computed here
// so that the daemon and clients agree on them. Pure functions; thread-safe.
#ifndef MUOND_COMMON_LAYOUT_H_
#define MUOND_COMMON_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/job_spec.h"

namespace muond::common {

struct ShardSpan {
  uint32_t matrix = 0;     // index into JobSpec::matrices
  uint64_t offset = 0;     // first element in the matrix
  uint64_t length = 0;     // elements
  uint64_t rank_offset = 0;  // where the span starts in the rank's flat (partition) buffer
  bool operator==(const ShardSpan& o) const {
    return matrix == o.matrix && offset == o.offset && length == o.length &&
           rank_offset == o.rank_offset;
  }
};

// The spans of `rank`: for stages 0-3 ordered by (matrix, offset); for an explicit layout in the
// order the layout lists them. rank_offset is where each span starts in the rank's flat buffer:
// stage 1/2 the partition (P = ceil(total / world) elements, tail padded); stage 3 one padded
// chunk of ceil(numel / world) per matrix; stage 0 and explicit layouts the spans back to back.
// REQUIRES: spec passed ValidateJobSpec; 0 <= rank < spec.world_size.
std::vector<ShardSpan> RankSpans(const JobSpec& spec, int rank);

// Elements in `rank`'s flat buffer (with padding), as described above.
uint64_t RankBufferElements(const JobSpec& spec, int rank);

// Checks that the explicit layout's spans of all ranks tile every matrix exactly once.
// INVALID_ARGUMENT naming the matrix and the first gap or overlap (with the ranks involved).
absl::Status ValidateExplicitLayout(const JobSpec& spec);

}  // namespace muond::common

#endif  // MUOND_COMMON_LAYOUT_H_
