// What a job will hold, computed from its spec alone before anything is allocated: shard spans,
// fp32 state bytes and the bytes of its layout and step tables. The registry checks these against
// the daemon's limits (server/record/daemon_limits.h) and counts them while the job exists.
// Pure functions; thread-safe.
#ifndef MUOND_SERVER_JOBS_JOB_FOOTPRINT_H_
#define MUOND_SERVER_JOBS_JOB_FOOTPRINT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "server/jobs/job_report.h"
#include "server/record/daemon_limits.h"

namespace muond::server {

struct JobFootprint {
  uint64_t spans = 0;        // shard spans over all ranks
  uint64_t state_bytes = 0;  // fp32 state, one copy (0 for a transport probe)
  // The step window (StepWindowBytes): the state of tensors computed before the seal; a whole
  // second copy for the jobs that keep two.
  uint64_t window_bytes = 0;
  // Layout tables, per-step rank and span bookkeeping (an upper bound per entry), and each
  // shared-memory rank's progress words.
  uint64_t table_bytes = 0;
  // What the job's steps, sessions and saves hold beside its state, at most, all ranks together
  // (B: the ranks' gradient bytes, U: their update or new-parameter bytes):
  //  - per rank the larger of a shared-memory session's regions (two gradient and two update
  //    buffers, each as large as the larger of the rank's B and U, mlocked; a session taken over
  //    releases its regions at once; plus its hyper block, alignment and ring) and a gRPC rank's
  //    input buffers and update (B + U); and, in update mode, the private copy of the last
  //    update kept for a replay (U; apply mode replays from the masters: no copy);
  //  - the copy of the committed state a save may take when steps write arrays it has not
  //    copied yet (copy-on-write per array: at most state_bytes), and the writer's staging of
  //    one tensor's arrays (fp32 at most: a float32 export);
  //  - the whole matrices assembled at once: at most kDepth batches of the batch target (or of
  //    the largest matrix), at most the gather budget, at most all of them (per element 4 bytes
  //    on the cpu device and for AdamW tensors, else 8, 12 with a compressed momentum).
  // The buffers (2 x step_buffers x the larger of B and U, per rank more) + the replay copy.
  uint64_t step_bytes = 0;
  uint64_t grad_bytes = 0;    // B
  uint64_t update_bytes = 0;  // U
  uint64_t replay_bytes = 0;  // the replay copy: U in update mode, 0 in apply mode
  uint64_t save_copy_bytes = 0;
  uint64_t gather_bytes = 0;
  // The compute thread's Newton-Schulz scratch for the job's largest call (shared by all jobs:
  // the thread keeps its largest; counted per job so that admission never undercounts it).
  uint64_t scratch_bytes = 0;
  uint64_t total() const {
    return state_bytes + window_bytes + table_bytes + step_bytes + save_copy_bytes + gather_bytes +
           scratch_bytes;
  }
  // The same bytes by kind (JobMemory, job_report.h): step_bytes are the buffers and the replay
  // copy.
  JobMemory kinds() const;
};

// The step window of the job's state store (server/engine/state_buffers.h):
// StateBuffers::kTwoCopies for the jobs that roll a committed step back (two-phase commits of
// many nodes); else the
// spec's step_window_bytes (0: `daemon_default`), at least the largest tensor's state and at most
// the whole state. REQUIRES: spec passed common::ValidateJobSpec.
uint64_t StepWindowBytes(const common::JobSpec& spec, uint64_t daemon_default);
// True when the job keeps two copies of its state (see above).
bool KeepsTwoCopies(const common::JobSpec& spec);

// Overflow-checked. INVALID_ARGUMENT when a count is beyond what any limit could allow.
// `daemon_gather_budget_bytes`: the budget of a spec that sets none (--gather-budget-bytes).
// REQUIRES: spec passed common::ValidateJobSpec.
// `in_host_memory`: the daemon's device computes in place in host memory (the cpu backend), so a
// Muon matrix assembles only its fp32 gradient (StepPipeline::AssembledBytesOf); false counts the
// staged devices' gradient and momentum.
absl::StatusOr<JobFootprint> MeasureJob(const common::JobSpec& spec,
                                        uint64_t daemon_gather_budget_bytes,
                                        uint64_t daemon_step_window_bytes = kDefaultStepWindowBytes,
                                        bool in_host_memory = false);

// The per-job limits (world size, tensors, spans, gather budget): OK, or RESOURCE_EXHAUSTED naming
// the limit's flag, the value asked for and the value allowed.
absl::Status CheckJobLimits(const common::JobSpec& spec, const JobFootprint& footprint,
                            const DaemonLimits& limits, uint64_t daemon_gather_budget_bytes);

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_JOB_FOOTPRINT_H_
