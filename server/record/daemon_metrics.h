// The daemon's Prometheus metrics: every muond_* family declared once, in
// common::DefaultRegistry(), with the small functions the data path calls to update them (room
// record/: the jobs, the engine and api call them). The collector that reads the rest at scrape
// time is ops/metrics_collector.h.
//
// Conventions: base units (seconds, bytes), `_total` for counters, labels of low cardinality only:
// `muond_job` (the job id; named so because Prometheus keeps `job` for the scrape job and would
// rename ours to `exported_job`), `phase`, `transport`, `direction`, `rpc`, `code`. Never a step
// id.
//
// Two sources:
//  - Events the Job cannot count itself (durations, bytes by transport, RPC errors) are recorded by
//    the Record* functions where they happen.
//  - State the daemon already keeps (jobs, ranks, momentum, gather budget and peak, the jobs' step
//    counters, queue depth, shared-memory sessions, pinned bytes) is read at scrape time by
//    DaemonMetricsCollector (ops/metrics_collector.h), so Prometheus and `muonctl status` never disagree. The step counters
//    (muond_steps_{completed,refused,aborted}_total) come from JobStatus this way: they advance by
//    the change since the previous scrape and never go down while the job exists; a deleted job's
//    series disappear at the next scrape (a job created again under the same id starts again at 0,
//    which Prometheus' rate() treats as a counter reset).
//
// Thread-safety: all functions and the collector are thread-safe; Record* never block for long
// (a short mutex that orders per-job series creation against their removal).
#ifndef MUOND_SERVER_RECORD_DAEMON_METRICS_H_
#define MUOND_SERVER_RECORD_DAEMON_METRICS_H_

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"

namespace muond::server {

// The phases of a step, as muond_step_phase_duration_seconds{phase=...} names them.
enum class StepPhase {
  kAssembly,      // "assembly": gathering a matrix's spans from the ranks' buffers
  kCopyIn,        // "copy_in": host to device (or into the compute buffers)
  kNewtonSchulz,  // "newton_schulz": the orthogonalization
  kWriteback,     // "writeback": the update back into the ranks' output spans
  kReturn,        // "return": the update back to the ranks (gRPC messages, completions)
  kCommit,        // "commit": the state store changed (update mode: momentum EMA; apply: flip)
};
const char* StepPhaseName(StepPhase phase);

enum class Transport { kGrpc, kShm };  // "grpc", "shm"
enum class Direction { kIn, kOut };    // "in": gradients to the daemon; "out": updates to ranks

// A committed step of `job` took `seconds` (first gradient byte to commit):
// muond_step_duration_seconds{muond_job}. Call once per committed step (not per rank, not for
// replays).
void RecordStepCompleted(const std::string& job, double seconds);
// An apply-mode step of `job` was recomputed because global gradient clipping triggered.
void RecordClipRedo(const std::string& job);
// A checkpoint save of `job` ended: muond_checkpoint_saves_total{muond_job,result},
// muond_checkpoint_save_duration_seconds{muond_job} and muond_checkpoint_written_bytes_total
// {muond_job} (successful saves).
void RecordCheckpointSave(const std::string& job, bool ok, double seconds, uint64_t bytes);
// One phase of a step of `job` took `seconds`: muond_step_phase_duration_seconds{muond_job,phase}.
// Call once per phase per step (sum the batches of a phase that runs in several).
void RecordPhase(const std::string& job, StepPhase phase, double seconds);
// `bytes` of gradients (kIn) or updates (kOut) moved over `transport`:
// muond_transfer_bytes_total{transport,direction}. Recorded by muond_service.cc (grpc) and
// shm_server.cc (shm); the Job does not call it.
void RecordBytes(Transport transport, Direction direction, uint64_t bytes);
// An RPC ended with a non-OK status: muond_rpc_errors_total{rpc,code}, code as the canonical
// name ("INVALID_ARGUMENT"). `rpc` is the method name ("Step").
void RecordRpcError(const char* rpc, absl::StatusCode code);

// The label of every per-job series ("muond_job").
inline constexpr char kMetricsJobLabel[] = "muond_job";

// Every family of the daemon, registered in the default registry on first use
// (DaemonMetricFamilies()): the Record* functions above write events into them, the collector
// (ops/metrics_collector.h) sets the state it reads at scrape time and removes a gone job's series.
struct DaemonFamilies {
  DaemonFamilies();
  // Removes every series of `job` from the per-job families.
  void RemoveJob(const std::string& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_series_mu);

  common::Family<common::Gauge>* limit;
  common::Family<common::Gauge>*build_info, *device_info, *start_time, *jobs, *ranks_attached, *momentum,
      *momentum_limit, *queue_depth, *shm_sessions, *pinned, *memlock_limit;
  common::Family<common::Gauge>*job_world_size, *job_ranks_attached, *job_next_step, *job_fenced, *job_momentum,
      *job_gather_budget, *job_gather_peak, *job_checkpoint_age, *job_multinode;
  common::Family<common::Counter>*steps_completed, *steps_refused, *steps_skipped, *steps_aborted,
      *transport_copy, *rpc_errors, *checkpoint_saves, *checkpoint_bytes, *clip_redo;
  common::Family<common::Histogram>*step_seconds, *phase_seconds, *checkpoint_seconds;
  common::Counter* bytes[2][2];
  // Orders the creation of per-job series by Record* against their removal by the collector, so
  // a child is never used after Family::Remove destroyed it.
  absl::Mutex job_series_mu;
  // Jobs with series created by Record* (the collector removes those of jobs that are gone, even
  // ones that never lived through a scrape).
  std::set<std::string> recorded_jobs ABSL_GUARDED_BY(job_series_mu);
};
DaemonFamilies& DaemonMetricFamilies();

}  // namespace muond::server

#endif  // MUOND_SERVER_RECORD_DAEMON_METRICS_H_
