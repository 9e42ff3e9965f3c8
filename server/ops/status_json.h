// The daemon's status as JSON: what `/api/v1/status` on the metrics address serves and the status
// page (server/ops/status_page.h) draws. Read-only, and it never holds a job token (the daemon
// keeps only their hashes, and those are not shown either).
//
//   {"format": "muond-status", "format_version": 1, "now_unix_ms",
//    "daemon": {"version", "backend", "backend_why", "device", "cpu_math", "metrics_address",
//               "start_unix_ms", "uptime_seconds", "limits": {KEY: VALUE},
//               "jobs", "state_bytes", "momentum_bytes", "compute_queue_depth",
//               "shm_sessions", "pinned_bytes", "memlock_limit_bytes" (null: unlimited)},
//    "phases": ["assembly", ...],
//    "jobs": [{"id", "mode", "world_size", "zero_stage", "tensors",
//              "ranks_attached", "ranks": [{"rank", "attached", "transport", "in_step"}],
//              "next_step", "step_in_flight" (null: none), "steps_completed", "steps_refused",
//              "steps_aborted", "fenced", "fence_reason", "state_bytes", "state_kind",
//              "checkpoint": null | {"step", "unix_ms", "age_seconds"},
//              "recent_steps": [{"step", "unix_ms", "seconds", "phases": [seconds...]}],
//              "optimizer": {"newton_schulz": [{"shape", "per_step", "matrices", "seconds",
//                                               "mean_seconds"}],
//                            "orthogonality": null | {"step", "value", "matrices"},
//                            "trainer": null | {"step", "visible_seconds", "wait_seconds"},
//                            "qk_clip": null | {"threshold", "pairs", "heads_clipped",
//                                               "max_logit" (null: no step yet)},
//                            "matrices_waiting", "gather_in_use_bytes",
//                            "pinned_bytes": {"momentum", "masters", "moments",
//                                             "session_regions", "staging"}}}],
//    "broken_jobs": [{"directory", "reason"}],
//    "operations": [{"job", "kind", "target", "bytes_done", "bytes_total", "started_unix_ms",
//                    "ended_unix_ms", "done", "error"}]}
//
// Thread-safety: Render is thread-safe (it reads the registry, the shared-memory server and the
// step history, each thread-safe).
#ifndef MUOND_SERVER_OPS_STATUS_JSON_H_
#define MUOND_SERVER_OPS_STATUS_JSON_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace muond::server {

class JobRegistry;
class ShmServer;

// What the daemon is, fixed at start.
struct StatusInfo {
  std::string version;
  std::string backend;      // "cpu", "cuda", ...
  std::string backend_why;  // why it was chosen (the backend probe's words)
  std::string device;
  std::string cpu_math;  // the CPU math path, server/optim/cpu_isa.h DescribeCpuMathPath
  std::string metrics_address;  // "HOST:PORT" as bound (SetMetricsAddress)
  int64_t start_unix_ms = 0;
  std::vector<std::pair<std::string, double>> limits;  // server/record/daemon_limits.h LimitValues
};

class StatusSource {
 public:
  // REQUIRES: `jobs` (and `shm`, which may be null) outlive the source.
  StatusSource(const JobRegistry* jobs, const ShmServer* shm, StatusInfo info);

  // The JSON above, as of now. Also prunes the step history and finished operations of jobs that
  // are gone (so their memory is bounded by the jobs that exist).
  std::string Render() const ABSL_LOCKS_EXCLUDED(mu_);
  // The address the metrics server bound (known once it started).
  void SetMetricsAddress(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const JobRegistry* const jobs_;
  const ShmServer* const shm_;
  mutable absl::Mutex mu_;
  StatusInfo info_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_OPS_STATUS_JSON_H_
