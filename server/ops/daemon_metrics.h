// The daemon's Prometheus metrics: every muond_* family declared once, in
// common::DefaultRegistry(), with the small functions the data path calls to update them and a
// collector that reads the rest at scrape time.
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
//    DaemonMetricsCollector, so Prometheus and `muonctl status` never disagree. The step counters
//    (muond_steps_{completed,refused,aborted}_total) come from JobStatus this way: they advance by
//    the change since the previous scrape and never go down while the job exists; a deleted job's
//    series disappear at the next scrape (a job created again under the same id starts again at 0,
//    which Prometheus' rate() treats as a counter reset).
//
// Thread-safety: all functions and the collector are thread-safe; Record* never block for long
// (a short mutex that orders per-job series creation against their removal).
#ifndef MUOND_SERVER_OPS_DAEMON_METRICS_H_
#define MUOND_SERVER_OPS_DAEMON_METRICS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"

namespace muond::server {

class JobRegistry;
class ShmServer;

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

// What the daemon runs on, for muond_build_info and muond_device_info.
struct DaemonInfo {
  std::string version;
  std::string backend;              // "cpu", "cuda", ...
  std::string device;               // e.g. the CPU model or the GPU name
  // The CPU math path (server/optim/cpu_isa.h): "amx", "avx512", "avx2" or "baseline", and bf16
  // "native" or "emulated" (muond_build_info's cpu_isa and cpu_bf16 labels).
  std::string cpu_isa;
  std::string cpu_bf16;
  uint64_t max_momentum_bytes = 0;  // 0: unlimited (muond_momentum_limit_bytes is then absent)
  // muond_limit{limit=KEY}: every limit in force (server/ops/daemon_limits.h LimitValues).
  std::vector<std::pair<std::string, double>> limits;
};

// The CPU model ("model name" in /proc/cpuinfo), or "unknown cpu".
std::string CpuModelName();

// Registers a collect callback on DefaultRegistry() that sets, at every scrape, the metrics read
// from `jobs` and `shm` (which may be null: no shared-memory plane), and sets muond_build_info,
// muond_device_info and muond_start_time_seconds once. Unregisters it on destruction (after which
// no callback runs).
// REQUIRES: `jobs` and `shm` outlive the collector. At most one collector at a time.
class DaemonMetricsCollector {
 public:
  DaemonMetricsCollector(const JobRegistry* jobs, const ShmServer* shm, DaemonInfo info);
  ~DaemonMetricsCollector();
  DaemonMetricsCollector(const DaemonMetricsCollector&) = delete;
  DaemonMetricsCollector& operator=(const DaemonMetricsCollector&) = delete;

  // Runs what a scrape runs (tests call it; the registry calls it through the callback).
  void Collect() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A job's counters as seen at the previous scrape.
  struct Seen {
    int64_t completed = 0;
    int64_t refused = 0;
    int64_t skipped = 0;
    int64_t aborted = 0;
    uint64_t transport_copy_bytes = 0;
    common::Labels multinode;  // the series of muond_job_multinode_info, if any
  };

  const JobRegistry* const jobs_;
  const ShmServer* const shm_;
  common::MetricsRegistry::CallbackId callback_id_ = 0;
  absl::Mutex mu_;
  std::map<std::string, Seen> seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_OPS_DAEMON_METRICS_H_
