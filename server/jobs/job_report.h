// A job's state as its status reports it (muonctl job show, the metrics, the API's JobStatus):
// plain values, taken at one moment under the job's lock. server/api converts it to the proto.
#ifndef MUOND_SERVER_JOBS_JOB_REPORT_H_
#define MUOND_SERVER_JOBS_JOB_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/job_spec.h"

namespace muond::server {

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
