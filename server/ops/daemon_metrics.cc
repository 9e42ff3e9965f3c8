#include "server/ops/daemon_metrics.h"

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
#include "server/ops/optimizer_metrics.h"

namespace muond::server {
namespace {

using common::Counter;
using common::Family;
using common::Gauge;
using common::Histogram;
using common::Labels;
using common::MustRegister;

constexpr char kJobLabel[] = "muond_job";

// The buckets of the duration histograms (prometheus-cpp gives them to each child).
const Histogram::BucketBoundaries& StepBuckets() {
  static const auto* buckets =
      new Histogram::BucketBoundaries(common::ExponentialBuckets(0.001, 2, 16));
  return *buckets;
}
const Histogram::BucketBoundaries& PhaseBuckets() {
  static const auto* buckets =
      new Histogram::BucketBoundaries(common::ExponentialBuckets(0.0001, 2, 18));
  return *buckets;
}
const Histogram::BucketBoundaries& CheckpointBuckets() {
  static const auto* buckets =
      new Histogram::BucketBoundaries(common::ExponentialBuckets(0.001, 2, 18));
  return *buckets;
}

// Every family of the daemon, registered once in the default registry on first use.
struct Families {
  Families() {
    common::MetricsRegistry& r = common::DefaultRegistry();
    build_info =
        MustRegister(r.AddGauge("muond_build_info",
                                "The running muond: version, compute backend and CPU math path "
                                "(cpu_isa: the widest ISA the optimizer math uses; cpu_bf16: "
                                "native or emulated bf16 products); always 1."));
    device_info = MustRegister(
        r.AddGauge("muond_device_info", "The compute device in use, by backend; always 1."));
    start_time = MustRegister(r.AddGauge(
        "muond_start_time_seconds", "When this muond started, in seconds since the Unix epoch."));
    jobs = MustRegister(r.AddGauge("muond_jobs", "Jobs that exist on this daemon."));
    ranks_attached =
        MustRegister(r.AddGauge("muond_ranks_attached", "Rank sessions attached, all jobs."));
    momentum = MustRegister(r.AddGauge("muond_momentum_bytes", "fp32 momentum held, all jobs."));
    momentum_limit = MustRegister(
        r.AddGauge("muond_momentum_limit_bytes", "--max-momentum-bytes (absent when unlimited)."));
    limit = MustRegister(r.AddGauge("muond_limit",
                                    "A limit in force (muond --help, Limits): its value by key; "
                                    "max_state_bytes 0 means unlimited."));
    queue_depth = MustRegister(
        r.AddGauge("muond_compute_queue_depth", "Compute tasks waiting for the compute thread."));
    shm_sessions =
        MustRegister(r.AddGauge("muond_shm_sessions", "Shared-memory rank sessions attached."));
    pinned = MustRegister(
        r.AddGauge("muond_pinned_bytes", "Host memory locked (mlock) for shared-memory sessions."));
    memlock_limit = MustRegister(
        r.AddGauge("muond_memlock_limit_bytes",
                   "This process's RLIMIT_MEMLOCK soft limit (+Inf when unlimited; root with "
                   "CAP_IPC_LOCK is not bound by it)."));

    job_world_size = MustRegister(r.AddGauge("muond_job_world_size", "Ranks in the job's world."));
    job_ranks_attached =
        MustRegister(r.AddGauge("muond_job_ranks_attached", "Ranks of the job with a session."));
    job_next_step =
        MustRegister(r.AddGauge("muond_job_next_step", "The step the job expects next."));
    job_fenced = MustRegister(r.AddGauge(
        "muond_job_fenced", "1 while the job is fenced (an aborted step; needs a reset)."));
    job_momentum =
        MustRegister(r.AddGauge("muond_job_momentum_bytes", "fp32 momentum the job holds."));
    job_gather_budget = MustRegister(r.AddGauge(
        "muond_job_gather_budget_bytes", "Bytes of whole matrices the job may assemble at once."));
    job_gather_peak = MustRegister(
        r.AddGauge("muond_job_gather_peak_bytes", "The most bytes the job has assembled at once."));
    job_multinode = MustRegister(r.AddGauge(
        "muond_job_multinode_info",
        "A multi-node job's part on this daemon (DESIGN.md 4c): its global job id and node; 1."));
    job_checkpoint_age = MustRegister(r.AddGauge(
        "muond_checkpoint_newest_age_seconds",
        "Seconds since the newest checkpoint generation this daemon wrote or loaded for the job."));
    steps_completed =
        MustRegister(r.AddCounter("muond_steps_completed_total", "Optimizer steps committed."));
    steps_refused = MustRegister(r.AddCounter(
        "muond_steps_refused_total", "Steps refused (bad input; momentum left unchanged)."));
    steps_skipped = MustRegister(r.AddCounter(
        "muond_steps_skipped_total",
        "Steps skipped for a non-finite gradient on some rank (job option nonfinite=skip: the "
        "step number advanced, nothing in the job's state changed)."));
    steps_aborted = MustRegister(r.AddCounter(
        "muond_steps_aborted_total", "Steps aborted after they started (the job is fenced)."));
    clip_redo = MustRegister(r.AddCounter(
        "muond_clip_redo_steps_total",
        "Apply-mode steps recomputed because global gradient clipping triggered (max_grad_norm)."));
    transport_copy = MustRegister(r.AddCounter(
        "muond_transport_copy_bytes_total",
        "Bytes a transport copied on the host between its buffers and the job's, per job "
        "(gRPC chunks and updates, shared-memory replays)."));

    step_seconds = MustRegister(r.AddHistogram(
        "muond_step_duration_seconds", "Wall time of a committed step, first gradient to commit."));
    phase_seconds = MustRegister(
        r.AddHistogram("muond_step_phase_duration_seconds", "Wall time of each phase of a step."));
    Family<Counter>* transfer = MustRegister(r.AddCounter(
        "muond_transfer_bytes_total", "Gradient (in) and update (out) bytes, by transport."));
    for (Transport t : {Transport::kGrpc, Transport::kShm}) {
      for (Direction d : {Direction::kIn, Direction::kOut}) {
        bytes[static_cast<int>(t)][static_cast<int>(d)] =
            &transfer->Add({{"transport", t == Transport::kGrpc ? "grpc" : "shm"},
                            {"direction", d == Direction::kIn ? "in" : "out"}});
      }
    }
    rpc_errors = MustRegister(
        r.AddCounter("muond_rpc_errors_total", "RPCs that ended with an error, by gRPC code."));
    checkpoint_saves = MustRegister(r.AddCounter(
        "muond_checkpoint_saves_total", "Checkpoint saves of the job, by result (ok, error)."));
    checkpoint_bytes = MustRegister(r.AddCounter("muond_checkpoint_written_bytes_total",
                                                 "Bytes of checkpoint payload written durably."));
    checkpoint_seconds =
        MustRegister(r.AddHistogram("muond_checkpoint_save_duration_seconds",
                                    "Wall time of a checkpoint save, snapshot to durable."));
  }

  // Removes every series of `job` from the per-job families.
  void RemoveJob(const std::string& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_series_mu) {
    const Labels labels{{kJobLabel, job}};
    for (Family<Gauge>* f :
         {job_world_size, job_ranks_attached, job_next_step, job_fenced, job_momentum,
          job_gather_budget, job_gather_peak, job_checkpoint_age}) {
      common::RemoveSeries(f, labels);
    }
    for (Family<Counter>* f : {steps_completed, steps_refused, steps_skipped, steps_aborted,
                               transport_copy, checkpoint_bytes, clip_redo}) {
      common::RemoveSeries(f, labels);
    }
    for (const char* result : {"ok", "error"}) {
      common::RemoveSeries(checkpoint_saves, {{kJobLabel, job}, {"result", result}});
    }
    common::RemoveSeries(step_seconds, labels);
    common::RemoveSeries(checkpoint_seconds, labels);
    for (StepPhase p : {StepPhase::kAssembly, StepPhase::kCopyIn, StepPhase::kNewtonSchulz,
                        StepPhase::kWriteback, StepPhase::kReturn, StepPhase::kCommit}) {
      common::RemoveSeries(phase_seconds, {{kJobLabel, job}, {"phase", StepPhaseName(p)}});
    }
  }

  Family<Gauge>* limit;
  Family<Gauge>*build_info, *device_info, *start_time, *jobs, *ranks_attached, *momentum,
      *momentum_limit, *queue_depth, *shm_sessions, *pinned, *memlock_limit;
  Family<Gauge>*job_world_size, *job_ranks_attached, *job_next_step, *job_fenced, *job_momentum,
      *job_gather_budget, *job_gather_peak, *job_checkpoint_age, *job_multinode;
  Family<Counter>*steps_completed, *steps_refused, *steps_skipped, *steps_aborted,
      *transport_copy, *rpc_errors, *checkpoint_saves, *checkpoint_bytes, *clip_redo;
  Family<Histogram>*step_seconds, *phase_seconds, *checkpoint_seconds;
  Counter* bytes[2][2];
  // Orders the creation of per-job series by Record* against their removal by the collector, so
  // a child is never used after Family::Remove destroyed it.
  absl::Mutex job_series_mu;
  // Jobs with series created by Record* (the collector removes those of jobs that are gone, even
  // ones that never lived through a scrape).
  std::set<std::string> recorded_jobs ABSL_GUARDED_BY(job_series_mu);
};

Families& F() {
  static Families* families = new Families();
  return *families;
}

// Adds the change of a count since the last scrape; a count that went down (the job was reset or
// replaced) restarts from 0, so the counter itself never goes down.
template <typename N>
void Advance(Counter& counter, N now, N* seen) {
  const N delta = now >= *seen ? now - *seen : now;
  if (delta > 0) counter.Increment(static_cast<double>(delta));
  *seen = now;
}

}  // namespace

const char* StepPhaseName(StepPhase phase) {
  switch (phase) {
    case StepPhase::kAssembly:
      return "assembly";
    case StepPhase::kCopyIn:
      return "copy_in";
    case StepPhase::kNewtonSchulz:
      return "newton_schulz";
    case StepPhase::kWriteback:
      return "writeback";
    case StepPhase::kReturn:
      return "return";
    case StepPhase::kCommit:
      return "commit";
  }
  return "unknown";
}

void RecordStepCompleted(const std::string& job, double seconds) {
  Families& f = F();
  absl::MutexLock lock(&f.job_series_mu);
  f.recorded_jobs.insert(job);
  f.step_seconds->Add({{kJobLabel, job}}, StepBuckets()).Observe(seconds);
}

void RecordClipRedo(const std::string& job) {
  Families& f = F();
  absl::MutexLock lock(&f.job_series_mu);
  f.recorded_jobs.insert(job);
  f.clip_redo->Add({{kJobLabel, job}}).Increment();
}

void RecordCheckpointSave(const std::string& job, bool ok, double seconds, uint64_t bytes) {
  Families& f = F();
  absl::MutexLock lock(&f.job_series_mu);
  f.recorded_jobs.insert(job);
  f.checkpoint_saves->Add({{kJobLabel, job}, {"result", ok ? "ok" : "error"}}).Increment();
  if (ok) {
    f.checkpoint_seconds->Add({{kJobLabel, job}}, CheckpointBuckets()).Observe(seconds);
    f.checkpoint_bytes->Add({{kJobLabel, job}}).Increment(static_cast<double>(bytes));
  }
}

void RecordPhase(const std::string& job, StepPhase phase, double seconds) {
  Families& f = F();
  absl::MutexLock lock(&f.job_series_mu);
  f.recorded_jobs.insert(job);
  f.phase_seconds->Add({{kJobLabel, job}, {"phase", StepPhaseName(phase)}}, PhaseBuckets())
      .Observe(seconds);
}

void RecordBytes(Transport transport, Direction direction, uint64_t bytes) {
  F().bytes[static_cast<int>(transport)][static_cast<int>(direction)]->Increment(
      static_cast<double>(bytes));
}

void RecordRpcError(const char* rpc, absl::StatusCode code) {
  F().rpc_errors->Add({{"rpc", rpc}, {"code", absl::StatusCodeToString(code)}}).Increment();
}

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
  Families& f = F();
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
  Families& f = F();
  const auto jobs = jobs_->List();
  f.jobs->Add({}).Set(static_cast<double>(jobs.size()));
  f.momentum->Add({}).Set(static_cast<double>(jobs_->momentum_bytes()));
  f.queue_depth->Add({}).Set(static_cast<double>(jobs_->compute_queue_depth()));
  ShmServer::Usage usage;
  if (shm_ != nullptr) {
    usage = shm_->usage();
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

  absl::MutexLock lock(&mu_);
  std::set<std::string> present;
  int64_t ranks_total = 0;
  for (const auto& job : jobs) {
    const JobReport st = job->Report();
    const std::string& id = st.spec.job_id;
    present.insert(id);
    const Labels labels{{kJobLabel, id}};
    int attached = 0;
    for (const RankReport& r : st.ranks) attached += r.attached ? 1 : 0;
    ranks_total += attached;
    f.job_world_size->Add(labels).Set(std::max(1, st.spec.world_size));
    f.job_ranks_attached->Add(labels).Set(attached);
    f.job_next_step->Add(labels).Set(static_cast<double>(st.next_step));
    f.job_fenced->Add(labels).Set(st.fenced ? 1 : 0);
    f.job_momentum->Add(labels).Set(static_cast<double>(st.momentum_bytes));
    f.job_gather_budget->Add(labels).Set(static_cast<double>(st.gather_budget_bytes));
    f.job_gather_peak->Add(labels).Set(static_cast<double>(st.gather_peak_bytes));
    if (st.last_checkpoint_step) {
      f.job_checkpoint_age->Add(labels).Set(
          static_cast<double>(absl::ToUnixMillis(absl::Now()) - st.last_checkpoint_unix_ms) /
          1000.0);
    }
    Seen& seen = seen_[id];
    if (st.spec.multinode.nodes > 0 && seen.multinode.empty()) {
      seen.multinode = {{kJobLabel, id},
                        {"global_job", st.spec.multinode.global_job_id},
                        {"node", std::to_string(st.spec.multinode.node)}};
      f.job_multinode->Add(seen.multinode).Set(1);
    }
    Advance(f.steps_completed->Add(labels), st.steps_completed, &seen.completed);
    Advance(f.steps_refused->Add(labels), st.steps_refused, &seen.refused);
    Advance(f.steps_skipped->Add(labels), st.steps_skipped, &seen.skipped);
    Advance(f.steps_aborted->Add(labels), st.steps_aborted, &seen.aborted);
    Advance(f.transport_copy->Add(labels), st.transport_copy_bytes, &seen.transport_copy_bytes);
    JobPressure pressure;
    pressure.matrices_waiting = st.matrices_waiting;
    pressure.gather_in_use_bytes = st.gather_in_use_bytes;
    pressure.momentum_bytes = st.pinned_momentum_bytes;
    pressure.masters_bytes = st.pinned_masters_bytes;
    pressure.moments_bytes = st.pinned_moments_bytes;
    pressure.staging_bytes = st.pinned_staging_bytes;
    if (auto it = usage.pinned_bytes_by_job.find(id); it != usage.pinned_bytes_by_job.end()) {
      pressure.session_region_bytes = it->second;
    }
    SetJobPressure(id, pressure);
  }
  RemoveJobsNotIn(present);
  f.ranks_attached->Add({}).Set(static_cast<double>(ranks_total));
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
