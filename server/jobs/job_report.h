// A job's state as its status reports it (muonctl job show, the metrics, the API's JobStatus):
// plain values, taken at one moment under the job's lock. server/api converts it to the proto.
#ifndef MUOND_SERVER_JOBS_JOB_REPORT_H_
#define MUOND_SERVER_JOBS_JOB_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/job_spec.h"

namespace muond::server {

// Host bytes of a job by what they are for (muonctl job show, the status page,
// muond_job_memory_bytes{muond_job,kind}). A report holds two: what the job holds now, and what
// admission reserved for it (its JobFootprint, server/jobs/job_footprint.h).
struct JobMemory {
  uint64_t state = 0;        // the committed state: fp32 masters, momentum, AdamW moments
  uint64_t step_window = 0;  // where steps write the next state before their commit
  uint64_t buffers = 0;      // the ranks' gradient and update buffers (shared regions, gRPC input)
  uint64_t replay = 0;       // private copies of the last committed update, for replays
  uint64_t save_copy = 0;    // committed state a save in progress still needs after a change
  uint64_t gather = 0;       // whole matrices assembled for the device, and the buffers kept for it
  uint64_t tables = 0;       // layout and step bookkeeping (an upper bound, not measured)
  // The job's share of the Newton-Schulz scratch the compute threads keep (all jobs' scratch over
  // the number of jobs; sized by the largest batch so far, which the gather budget bounds).
  uint64_t scratch = 0;
  uint64_t total() const {
    return state + step_window + buffers + replay + save_copy + gather + tables + scratch;
  }
};
// The kinds by name (the `kind` label and the report's keys), in report order.
inline std::vector<std::pair<const char*, uint64_t>> MemoryKinds(const JobMemory& m) {
  return {{"state", m.state},   {"step_window", m.step_window}, {"buffers", m.buffers},
          {"replay", m.replay}, {"save_copy", m.save_copy},     {"gather", m.gather},
          {"tables", m.tables}, {"scratch", m.scratch}};
}

struct RankReport {
  int rank = 0;
  bool attached = false;
  uint64_t session_id = 0;
  bool in_step = false;           // begun the step in flight
  bool finished_pushing = false;  // sent its whole part of the step in flight
  uint64_t elements = 0;          // elements of all its spans
};

struct JobReport {
  common::JobSpec spec;
  std::string backend;
  int64_t created_unix_ms = 0;
  uint64_t gather_budget_bytes = 0;
  uint64_t gather_peak_bytes = 0;
  uint64_t momentum_bytes = 0;  // all fp32 state (apply mode: the ParamStore, both buffers)
  // Apply mode.
  bool weights_complete = false;
  std::vector<int> ranks_missing_weights;
  int64_t clip_redo_steps = 0;
  double last_grad_norm = 0;
  int64_t next_step = 0;
  int64_t steps_completed = 0;
  int64_t steps_refused = 0;
  int64_t steps_skipped = 0;  // "nonfinite": "skip": steps committed as skipped
  int64_t steps_aborted = 0;
  bool fenced = false;
  std::string fence_reason;
  double last_step_device_seconds = 0;
  // Bytes the transports copied on the host (see Job::CountTransportCopy).
  uint64_t transport_copy_bytes = 0;
  std::optional<int64_t> last_checkpoint_step;
  int64_t last_checkpoint_unix_ms = 0;
  std::string checkpoint_dir;
  std::optional<int64_t> owner_uid;
  std::string owner;
  int32_t step_timeout_seconds = 0;
  std::optional<int64_t> step_in_flight;
  std::optional<int64_t> step_prepared;  // two-phase jobs: computed, awaiting commit or abort
  std::vector<RankReport> ranks;

  // Host bytes by kind: held now, and reserved at admission. `memory.buffers` counts gRPC ranks'
  // input only: the shared-memory sessions' regions are the shared-memory server's, and whoever
  // reports them (the API, the status page, the collector) adds them there.
  JobMemory memory;
  JobMemory footprint;

  // What operators see beyond the counters (server/engine/step_observer.h, trainer_clock.h).
  uint64_t matrices_waiting = 0;  // complete matrices of the step in flight not yet on the device
  uint64_t gather_in_use_bytes = 0;
  // Host memory pinned for the job by kind (the sessions' regions are the shared-memory
  // server's, not the job's: the daemon's collector adds them).
  uint64_t pinned_momentum_bytes = 0;
  uint64_t pinned_masters_bytes = 0;
  uint64_t pinned_moments_bytes = 0;
  uint64_t pinned_staging_bytes = 0;
  struct ShapeTime {
    std::string shape;
    uint64_t per_step = 0;
    uint64_t matrices = 0;
    double seconds = 0;
  };
  std::vector<ShapeTime> newton_schulz;  // by shape class, since the job was created
  std::optional<int64_t> orthogonality_step;
  double orthogonality = 0;
  int orthogonality_matrices = 0;
  // QK-Clip jobs: query heads clipped over the committed steps, and the newest committed step's
  // largest per-head max logit.
  int64_t qk_heads_clipped = 0;
  std::optional<double> qk_max_logit;
  std::optional<int64_t> trainer_step;  // the newest step timed as its trainer saw it
  double trainer_visible_seconds = 0;
  double trainer_wait_seconds = 0;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_JOB_REPORT_H_
