#include "server/ops/metrics_collector.h"

#include <sys/resource.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "server/api/shm_server.h"
#include "server/jobs/job_registry.h"
#include "server/record/optimizer_metrics.h"

namespace muond::server {
namespace {

using common::Counter;
using common::Labels;

// Adds the change of a count since the last scrape; a count that went down (the job was reset or
// replaced) restarts from 0, so the counter itself never goes down.
template <typename N>
void Advance(Counter& counter, N now, N* seen) {
  const N delta = now >= *seen ? now - *seen : now;
  if (delta > 0) counter.Increment(static_cast<double>(delta));
  *seen = now;
}

// The daemon-wide gauges read at each scrape; returns the shared-memory plane's usage (empty
// without one).
ShmServer::Usage SetDaemonGauges(DaemonFamilies& f, const JobRegistry& registry,
                                 const ShmServer* shm, size_t job_count) {
  f.jobs->Add({}).Set(static_cast<double>(job_count));
  f.momentum->Add({}).Set(static_cast<double>(registry.momentum_bytes()));
  f.queue_depth->Add({}).Set(static_cast<double>(registry.compute_queue_depth()));
  ShmServer::Usage usage;
  if (shm != nullptr) {
    usage = shm->usage();
    f.shm_sessions->Add({}).Set(static_cast<double>(usage.sessions));
    f.pinned->Add({}).Set(static_cast<double>(usage.pinned_bytes));
  } else {
    f.shm_sessions->Add({}).Set(0);
    f.pinned->Add({}).Set(0);
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0) {
    f.memlock_limit->Add({}).Set(limit.rlim_cur == RLIM_INFINITY
                                     ? std::numeric_limits<double>::infinity()
                                     : static_cast<double>(limit.rlim_cur));
  }
  return usage;
}

// A job's gauges; returns how many of its ranks are attached.
int SetJobGauges(DaemonFamilies& f, const JobReport& st) {
  const Labels labels{{kMetricsJobLabel, st.spec.job_id}};
  int attached = 0;
  for (const RankReport& r : st.ranks) attached += r.attached ? 1 : 0;
  f.job_world_size->Add(labels).Set(std::max(1, st.spec.world_size));
  f.job_ranks_attached->Add(labels).Set(attached);
  f.job_next_step->Add(labels).Set(static_cast<double>(st.next_step));
  f.job_fenced->Add(labels).Set(st.fenced ? 1 : 0);
  f.job_momentum->Add(labels).Set(static_cast<double>(st.momentum_bytes));
  f.job_gather_budget->Add(labels).Set(static_cast<double>(st.gather_budget_bytes));
  f.job_gather_peak->Add(labels).Set(static_cast<double>(st.gather_peak_bytes));
  if (st.last_checkpoint_step) {
    f.job_checkpoint_age->Add(labels).Set(
        static_cast<double>(absl::ToUnixMillis(absl::Now()) - st.last_checkpoint_unix_ms) / 1000.0);
  }
  return attached;
}

// What the job holds and waits for (record/optimizer_metrics.h), with its sessions' regions.
JobPressure PressureOf(const JobReport& st, const ShmServer::Usage& usage) {
  JobPressure pressure;
  pressure.matrices_waiting = st.matrices_waiting;
  pressure.gather_in_use_bytes = st.gather_in_use_bytes;
  pressure.momentum_bytes = st.pinned_momentum_bytes;
  pressure.masters_bytes = st.pinned_masters_bytes;
  pressure.moments_bytes = st.pinned_moments_bytes;
  pressure.staging_bytes = st.pinned_staging_bytes;
  const auto it = usage.pinned_bytes_by_job.find(st.spec.job_id);
  if (it != usage.pinned_bytes_by_job.end()) pressure.session_region_bytes = it->second;
  JobMemory memory = st.memory;
  memory.buffers += usage.region_bytes(st.spec.job_id);
  for (const auto& [kind, bytes] : MemoryKinds(memory)) pressure.memory.emplace_back(kind, bytes);
  pressure.footprint_bytes = st.footprint.total();
  return pressure;
}

}  // namespace

std::string CpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, "model name")) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
  }
  return "unknown cpu";
}

DaemonMetricsCollector::DaemonMetricsCollector(const JobRegistry* jobs, const ShmServer* shm,
                                               DaemonInfo info)
    : jobs_(jobs), shm_(shm) {
  DaemonFamilies& f = DaemonMetricFamilies();
  f.build_info
      ->Add({{"version", info.version},
             {"backend", info.backend},
             {"cpu_isa", info.cpu_isa},
             {"cpu_bf16", info.cpu_bf16}})
      .Set(1);
  f.device_info->Add({{"backend", info.backend}, {"device", info.device}}).Set(1);
  f.start_time->Add({}).Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  if (info.max_momentum_bytes != 0) {
    f.momentum_limit->Add({}).Set(static_cast<double>(info.max_momentum_bytes));
  }
  for (const auto& [key, value] : info.limits) f.limit->Add({{"limit", key}}).Set(value);
  callback_id_ = common::DefaultRegistry().AddCollectCallback([this] { Collect(); });
}

DaemonMetricsCollector::~DaemonMetricsCollector() {
  common::DefaultRegistry().RemoveCollectCallback(callback_id_);
}

void DaemonMetricsCollector::Collect() {
  DaemonFamilies& f = DaemonMetricFamilies();
  const auto jobs = jobs_->List();
  const ShmServer::Usage usage = SetDaemonGauges(f, *jobs_, shm_, jobs.size());

  absl::MutexLock lock(&mu_);
  std::set<std::string> present;
  int64_t ranks_total = 0;
  for (const auto& job : jobs) {
    const JobReport st = job->Report();
    present.insert(st.spec.job_id);
    ranks_total += SetJobGauges(f, st);
    AdvanceJobCounters(f, st);
    SetJobPressure(st.spec.job_id, PressureOf(st, usage));
  }
  RemoveJobsNotIn(present);
  f.ranks_attached->Add({}).Set(static_cast<double>(ranks_total));
  RemoveGoneJobs(f, present);
}

void DaemonMetricsCollector::AdvanceJobCounters(DaemonFamilies& f, const JobReport& st) {
  const std::string& id = st.spec.job_id;
  const Labels labels{{kMetricsJobLabel, id}};
  Seen& seen = seen_[id];
  if (st.spec.multinode.nodes > 0 && seen.multinode.empty()) {
    seen.multinode = {{kMetricsJobLabel, id},
                      {"global_job", st.spec.multinode.global_job_id},
                      {"node", std::to_string(st.spec.multinode.node)}};
    f.job_multinode->Add(seen.multinode).Set(1);
  }
  Advance(f.steps_completed->Add(labels), st.steps_completed, &seen.completed);
  Advance(f.steps_refused->Add(labels), st.steps_refused, &seen.refused);
  Advance(f.steps_skipped->Add(labels), st.steps_skipped, &seen.skipped);
  Advance(f.steps_aborted->Add(labels), st.steps_aborted, &seen.aborted);
  Advance(f.transport_copy->Add(labels), st.transport_copy_bytes, &seen.transport_copy_bytes);
}

void DaemonMetricsCollector::RemoveGoneJobs(DaemonFamilies& f,
                                            const std::set<std::string>& present) {
  // Jobs deleted since the last scrape: their series go.
  absl::MutexLock series_lock(&f.job_series_mu);
  std::set<std::string> gone;
  for (const auto& [id, unused] : seen_) {
    if (present.count(id) == 0) gone.insert(id);
  }
  for (const std::string& id : f.recorded_jobs) {
    if (present.count(id) == 0) gone.insert(id);
  }
  for (const std::string& id : gone) {
    if (auto it = seen_.find(id); it != seen_.end() && !it->second.multinode.empty()) {
      common::RemoveSeries(f.job_multinode, it->second.multinode);
    }
    f.RemoveJob(id);
    seen_.erase(id);
    f.recorded_jobs.erase(id);
  }
}

}  // namespace muond::server
