#include "server/record/daemon_metrics.h"

#include <set>
#include <string>

namespace muond::server {
namespace {

using common::Counter;
using common::Family;
using common::Gauge;
using common::Histogram;
using common::Labels;
using common::MustRegister;

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

// The daemon-wide gauges: what runs, what it holds and its limits.
void RegisterDaemonGauges(common::MetricsRegistry& r, DaemonFamilies& f) {
  f.build_info =
      MustRegister(r.AddGauge("muond_build_info",
                              "The running muond: version, compute backend and CPU math path "
                              "(cpu_isa: the widest ISA the optimizer math uses; cpu_bf16: "
                              "native or emulated bf16 products); always 1."));
  f.device_info = MustRegister(
      r.AddGauge("muond_device_info", "The compute device in use, by backend; always 1."));
  f.start_time = MustRegister(r.AddGauge(
      "muond_start_time_seconds", "When this muond started, in seconds since the Unix epoch."));
  f.jobs = MustRegister(r.AddGauge("muond_jobs", "Jobs that exist on this daemon."));
  f.ranks_attached =
      MustRegister(r.AddGauge("muond_ranks_attached", "Rank sessions attached, all jobs."));
  f.momentum = MustRegister(r.AddGauge("muond_momentum_bytes", "fp32 momentum held, all jobs."));
  f.momentum_limit = MustRegister(
      r.AddGauge("muond_momentum_limit_bytes", "--max-momentum-bytes (absent when unlimited)."));
  f.limit = MustRegister(r.AddGauge("muond_limit",
                                    "A limit in force (muond --help, Limits): its value by key; "
                                    "max_state_bytes 0 means unlimited."));
  f.queue_depth = MustRegister(
      r.AddGauge("muond_compute_queue_depth", "Compute tasks waiting for the compute thread."));
  f.shm_sessions =
      MustRegister(r.AddGauge("muond_shm_sessions", "Shared-memory rank sessions attached."));
  f.pinned = MustRegister(
      r.AddGauge("muond_pinned_bytes", "Host memory locked (mlock) for shared-memory sessions."));
  f.memlock_limit = MustRegister(
      r.AddGauge("muond_memlock_limit_bytes",
                 "This process's RLIMIT_MEMLOCK soft limit (+Inf when unlimited; root with "
                 "CAP_IPC_LOCK is not bound by it)."));
}

// The per-job gauges (series labelled by job, removed with the job).
void RegisterJobGauges(common::MetricsRegistry& r, DaemonFamilies& f) {
  f.job_world_size = MustRegister(r.AddGauge("muond_job_world_size", "Ranks in the job's world."));
  f.job_ranks_attached =
      MustRegister(r.AddGauge("muond_job_ranks_attached", "Ranks of the job with a session."));
  f.job_next_step =
      MustRegister(r.AddGauge("muond_job_next_step", "The step the job expects next."));
  f.job_fenced = MustRegister(r.AddGauge(
      "muond_job_fenced", "1 while the job is fenced (an aborted step; needs a reset)."));
  f.job_momentum =
      MustRegister(r.AddGauge("muond_job_momentum_bytes", "fp32 momentum the job holds."));
  f.job_gather_budget = MustRegister(r.AddGauge(
      "muond_job_gather_budget_bytes", "Bytes of whole matrices the job may assemble at once."));
  f.job_gather_peak = MustRegister(
      r.AddGauge("muond_job_gather_peak_bytes", "The most bytes the job has assembled at once."));
  f.job_multinode = MustRegister(r.AddGauge(
      "muond_job_multinode_info",
      "A multi-node job's part on this daemon (DESIGN.md 4c): its global job id and node; 1."));
  f.job_checkpoint_age = MustRegister(r.AddGauge(
      "muond_checkpoint_newest_age_seconds",
      "Seconds since the newest checkpoint generation this daemon wrote or loaded for the job."));
}

// The step counters, by job.
void RegisterStepCounters(common::MetricsRegistry& r, DaemonFamilies& f) {
  f.steps_completed =
      MustRegister(r.AddCounter("muond_steps_completed_total", "Optimizer steps committed."));
  f.steps_refused = MustRegister(r.AddCounter(
      "muond_steps_refused_total", "Steps refused (bad input; momentum left unchanged)."));
  f.steps_skipped = MustRegister(r.AddCounter(
      "muond_steps_skipped_total",
      "Steps skipped for a non-finite gradient on some rank (job option nonfinite=skip: the "
      "step number advanced, nothing in the job's state changed)."));
  f.steps_aborted = MustRegister(r.AddCounter(
      "muond_steps_aborted_total", "Steps aborted after they started (the job is fenced)."));
  f.clip_redo = MustRegister(r.AddCounter(
      "muond_clip_redo_steps_total",
      "Steps that recomputed tensors computed before their clip was known, because global "
      "gradient clipping (max_grad_norm) triggered."));
  f.transport_copy = MustRegister(r.AddCounter(
      "muond_transport_copy_bytes_total",
      "Bytes a transport copied on the host between its buffers and the job's, per job "
      "(gRPC chunks and updates, shared-memory replays)."));
}

// The durations, the bytes moved by transport, RPC errors and checkpoint saves.
void RegisterTrafficAndCheckpoints(common::MetricsRegistry& r, DaemonFamilies& f) {
  f.step_seconds = MustRegister(r.AddHistogram(
      "muond_step_duration_seconds", "Wall time of a committed step, first gradient to commit."));
  f.phase_seconds = MustRegister(
      r.AddHistogram("muond_step_phase_duration_seconds", "Wall time of each phase of a step."));
  Family<Counter>* transfer = MustRegister(r.AddCounter(
      "muond_transfer_bytes_total", "Gradient (in) and update (out) bytes, by transport."));
  for (Transport t : {Transport::kGrpc, Transport::kShm}) {
    for (Direction d : {Direction::kIn, Direction::kOut}) {
      f.bytes[static_cast<int>(t)][static_cast<int>(d)] =
          &transfer->Add({{"transport", t == Transport::kGrpc ? "grpc" : "shm"},
                          {"direction", d == Direction::kIn ? "in" : "out"}});
    }
  }
  f.rpc_errors = MustRegister(
      r.AddCounter("muond_rpc_errors_total", "RPCs that ended with an error, by gRPC code."));
  f.checkpoint_saves = MustRegister(r.AddCounter(
      "muond_checkpoint_saves_total", "Checkpoint saves of the job, by result (ok, error)."));
  f.checkpoint_bytes = MustRegister(r.AddCounter("muond_checkpoint_written_bytes_total",
                                                 "Bytes of checkpoint payload written durably."));
  f.checkpoint_seconds =
      MustRegister(r.AddHistogram("muond_checkpoint_save_duration_seconds",
                                  "Wall time of a checkpoint save, snapshot to durable."));
}

}  // namespace

DaemonFamilies::DaemonFamilies() {
  common::MetricsRegistry& r = common::DefaultRegistry();
  RegisterDaemonGauges(r, *this);
  RegisterJobGauges(r, *this);
  RegisterStepCounters(r, *this);
  RegisterTrafficAndCheckpoints(r, *this);
}

void DaemonFamilies::RemoveJob(const std::string& job) {
  const Labels labels{{kMetricsJobLabel, job}};
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
    common::RemoveSeries(checkpoint_saves, {{kMetricsJobLabel, job}, {"result", result}});
  }
  common::RemoveSeries(step_seconds, labels);
  common::RemoveSeries(checkpoint_seconds, labels);
  for (StepPhase p : {StepPhase::kAssembly, StepPhase::kCopyIn, StepPhase::kNewtonSchulz,
                      StepPhase::kWriteback, StepPhase::kReturn, StepPhase::kCommit}) {
    common::RemoveSeries(phase_seconds, {{kMetricsJobLabel, job}, {"phase", StepPhaseName(p)}});
  }
}

DaemonFamilies& DaemonMetricFamilies() {
  static DaemonFamilies* families = new DaemonFamilies();
  return *families;
}

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
  DaemonFamilies& f = DaemonMetricFamilies();
  absl::MutexLock lock(&f.job_series_mu);
  f.recorded_jobs.insert(job);
  f.step_seconds->Add({{kMetricsJobLabel, job}}, StepBuckets()).Observe(seconds);
}

void RecordClipRedo(const std::string& job) {
  DaemonFamilies& f = DaemonMetricFamilies();
  absl::MutexLock lock(&f.job_series_mu);
  f.recorded_jobs.insert(job);
  f.clip_redo->Add({{kMetricsJobLabel, job}}).Increment();
}

void RecordCheckpointSave(const std::string& job, bool ok, double seconds, uint64_t bytes) {
  DaemonFamilies& f = DaemonMetricFamilies();
  absl::MutexLock lock(&f.job_series_mu);
  f.recorded_jobs.insert(job);
  f.checkpoint_saves->Add({{kMetricsJobLabel, job}, {"result", ok ? "ok" : "error"}}).Increment();
  if (ok) {
    f.checkpoint_seconds->Add({{kMetricsJobLabel, job}}, CheckpointBuckets()).Observe(seconds);
    f.checkpoint_bytes->Add({{kMetricsJobLabel, job}}).Increment(static_cast<double>(bytes));
  }
}

void RecordPhase(const std::string& job, StepPhase phase, double seconds) {
  DaemonFamilies& f = DaemonMetricFamilies();
  absl::MutexLock lock(&f.job_series_mu);
  f.recorded_jobs.insert(job);
  f.phase_seconds->Add({{kMetricsJobLabel, job}, {"phase", StepPhaseName(phase)}}, PhaseBuckets())
      .Observe(seconds);
}

void RecordBytes(Transport transport, Direction direction, uint64_t bytes) {
  DaemonMetricFamilies().bytes[static_cast<int>(transport)][static_cast<int>(direction)]->Increment(
      static_cast<double>(bytes));
}

void RecordRpcError(const char* rpc, absl::StatusCode code) {
  DaemonMetricFamilies().rpc_errors->Add({{"rpc", rpc}, {"code", absl::StatusCodeToString(code)}}).Increment();
}

}  // namespace muond::server
