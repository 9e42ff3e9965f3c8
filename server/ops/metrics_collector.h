// The collector of the daemon's metrics (ops/: it reads every room below to show it): at every
// scrape it sets what the daemon already keeps (jobs, ranks, momentum, gather budget and peak,
// the jobs' step counters, queue depth, shared-memory sessions, pinned bytes) in the families of
// record/daemon_metrics.h, so Prometheus and `muonctl status` never disagree, and removes the
// series of jobs that are gone. See record/daemon_metrics.h for the families and conventions.
// Thread-safe.
#ifndef MUOND_SERVER_OPS_METRICS_COLLECTOR_H_
#define MUOND_SERVER_OPS_METRICS_COLLECTOR_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "server/record/daemon_metrics.h"

namespace muond::server {

class JobRegistry;
class ShmServer;
struct JobReport;

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
  // muond_limit{limit=KEY}: every limit in force (server/record/daemon_limits.h LimitValues).
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

  // The job's step counters advanced by their change since the last scrape, and its multi-node
  // series set once.
  void AdvanceJobCounters(DaemonFamilies& f, const JobReport& st)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the series of the jobs not `present` (deleted since the last scrape).
  void RemoveGoneJobs(DaemonFamilies& f, const std::set<std::string>& present)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobRegistry* const jobs_;
  const ShmServer* const shm_;
  common::MetricsRegistry::CallbackId callback_id_ = 0;
  absl::Mutex mu_;
  std::map<std::string, Seen> seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_OPS_METRICS_COLLECTOR_H_
