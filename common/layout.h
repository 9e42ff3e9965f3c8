// Which elements of which matrix each rank of a job owns (DESIGN.md section 4).
//
// A span is a run of consecutive elements of one matrix (row-major, flattened). For zero_stage 0
// (world size 1) rank 0 owns every matrix whole. Stage 1/2 and stage 3 partitions are computed here
// so that the daemon and clients agree on them. Pure functions; thread-safe.
#ifndef MUOND_COMMON_LAYOUT_H_
#define MUOND_COMMON_LAYOUT_H_

#include <cstdint>
#include <vector>

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

// The spans of `rank`, ordered by (matrix, offset).
// REQUIRES: spec passed ValidateJobSpec; 0 <= rank < spec.world_size.
std::vector<ShardSpan> RankSpans(const JobSpec& spec, int rank);

}  // namespace muond::common

#endif  // MUOND_COMMON_LAYOUT_H_
