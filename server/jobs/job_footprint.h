// What a job will hold, computed from its spec alone before anything is allocated: shard spans,
// fp32 state bytes and the bytes of its layout and step tables. The registry checks these against
// the daemon's limits (server/ops/daemon_limits.h) and counts them while the job exists.
// Pure functions; thread-safe.
#ifndef MUOND_SERVER_JOBS_JOB_FOOTPRINT_H_
#define MUOND_SERVER_JOBS_JOB_FOOTPRINT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "server/ops/daemon_limits.h"

namespace muond::server {

struct JobFootprint {
  uint64_t spans = 0;        // shard spans over all ranks
  uint64_t state_bytes = 0;  // fp32 state, both buffers of each array (0 for a transport probe)
  // Layout tables, per-step rank and span bookkeeping (an upper bound per entry).
  uint64_t table_bytes = 0;
  uint64_t total() const { return state_bytes + table_bytes; }
};

// Overflow-checked. INVALID_ARGUMENT when a count is beyond what any limit could allow.
// REQUIRES: spec passed common::ValidateJobSpec.
absl::StatusOr<JobFootprint> MeasureJob(const common::JobSpec& spec);

// The per-job limits (world size, tensors, spans, gather budget): OK, or RESOURCE_EXHAUSTED naming
// the limit's flag, the value asked for and the value allowed.
absl::Status CheckJobLimits(const common::JobSpec& spec, const JobFootprint& footprint,
                            const DaemonLimits& limits, uint64_t daemon_gather_budget_bytes);

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_JOB_FOOTPRINT_H_
