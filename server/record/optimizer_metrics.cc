#include "server/record/optimizer_metrics.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"

namespace muond::server {
namespace {

using common::Counter;
using common::Family;
using common::Gauge;
using common::Histogram;
using common::Labels;
using common::MustRegister;
using common::RemoveSeries;

constexpr char kJobLabel[] = "muond_job";
constexpr const char* kPinnedKinds[] = {"momentum", "masters", "moments", "session_regions",
                                        "staging"};

struct Families {
  Families() {
    common::MetricsRegistry& r = common::DefaultRegistry();
    newton_schulz = MustRegister(r.AddHistogram(
        "muond_newton_schulz_seconds",
        "Device seconds of one matrix's Newton-Schulz (its FLOP share of its batch's compute "
        "time), by shape class, compute dtype and backend."));
    orthogonality = MustRegister(r.AddGauge(
        "muond_update_orthogonality",
        "||U U^T - I||_F / sqrt(r) of the orthogonalized update direction, worst of the newest "
        "sampled step's matrices (--orthogonality-every)."));
    orthogonality_seconds = MustRegister(
        r.AddCounter("muond_orthogonality_check_seconds_total",
                     "Seconds the daemon spent measuring the orthogonality of updates."));
    orthogonality_checks = MustRegister(r.AddCounter(
        "muond_orthogonality_checks_total", "Matrices whose update orthogonality was measured."));
    visible = MustRegister(r.AddHistogram(
        "muond_step_trainer_visible_seconds",
        "A committed step from its first gradient byte in to its last update byte out."));
    wait = MustRegister(r.AddHistogram(
        "muond_step_trainer_wait_seconds",
        "The part of a committed step after its last gradient byte arrived: what the trainer "
        "waits for."));
    waiting =
        MustRegister(r.AddGauge("muond_job_matrices_waiting",
                                "Complete matrices of the step in flight waiting for the device."));
    gather_in_use = MustRegister(
        r.AddGauge("muond_job_gather_in_use_bytes",
                   "Bytes of the job's gather budget in batches being assembled or in flight."));
    qk_clipped = MustRegister(r.AddCounter(
        "muond_qk_clip_heads_clipped_total",
        "Query heads whose master weights QK-Clip rescaled (max attention logit over the "
        "threshold), summed over the committed steps."));
    qk_max_logit = MustRegister(r.AddGauge(
        "muond_qk_max_logit",
        "The largest per-head max attention logit of the newest committed QK-Clip step."));
    pinned =
        MustRegister(r.AddGauge("muond_job_pinned_bytes",
                                "Host memory the job holds pinned (locked, registered with the "
                                "device), by kind."));
    memory = MustRegister(r.AddGauge(
        "muond_job_memory_bytes",
        "Host memory the job holds now, by kind: state, step_window, buffers, replay, save_copy, "
        "gather, tables (README, Memory)."));
    footprint = MustRegister(
        r.AddGauge("muond_job_footprint_bytes",
                   "Host memory admission reserved for the job (its footprint, all kinds)."));
  }

  Family<Histogram>*newton_schulz, *visible, *wait;
  Family<Gauge>*orthogonality, *waiting, *gather_in_use, *pinned, *qk_max_logit, *memory,
      *footprint;
  Family<Counter>*orthogonality_seconds, *orthogonality_checks, *qk_clipped;
  absl::Mutex mu;
  // Per job, the label sets of its Newton-Schulz series (their number is bounded by the job's
  // shape classes).
  std::map<std::string, std::vector<Labels>> shapes ABSL_GUARDED_BY(mu);
  std::set<std::string> jobs ABSL_GUARDED_BY(mu);
  std::map<std::string, std::set<std::string>> memory_kinds ABSL_GUARDED_BY(mu);  // per job
};

Families& F() {
  static Families* families = new Families();
  return *families;
}

const Histogram::BucketBoundaries& NewtonSchulzBuckets() {
  static const auto* b = new Histogram::BucketBoundaries(common::ExponentialBuckets(1e-5, 2, 22));
  return *b;
}

const Histogram::BucketBoundaries& StepBuckets() {
  static const auto* b = new Histogram::BucketBoundaries(common::ExponentialBuckets(0.0005, 2, 18));
  return *b;
}

}  // namespace

void RecordNewtonSchulz(const std::string& job, const std::string& shape, const std::string& dtype,
                        const std::string& backend, double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return;
  Families& f = F();
  Labels labels{{kJobLabel, job}, {"shape", shape}, {"dtype", dtype}, {"backend", backend}};
  absl::MutexLock lock(&f.mu);
  f.jobs.insert(job);
  if (!f.newton_schulz->Has(labels)) f.shapes[job].push_back(labels);
  f.newton_schulz->Add(labels, NewtonSchulzBuckets()).Observe(seconds);
}

void RecordOrthogonality(const std::string& job, double value, double seconds) {
  Families& f = F();
  const Labels labels{{kJobLabel, job}};
  absl::MutexLock lock(&f.mu);
  f.jobs.insert(job);
  f.orthogonality->Add(labels).Set(value);
  f.orthogonality_checks->Add(labels).Increment();
  if (std::isfinite(seconds) && seconds > 0)
    f.orthogonality_seconds->Add(labels).Increment(seconds);
}

void RecordTrainerTime(const std::string& job, double visible_seconds, double wait_seconds) {
  if (!std::isfinite(visible_seconds) || !std::isfinite(wait_seconds)) return;
  Families& f = F();
  const Labels labels{{kJobLabel, job}};
  absl::MutexLock lock(&f.mu);
  f.jobs.insert(job);
  f.visible->Add(labels, StepBuckets()).Observe(std::max(0.0, visible_seconds));
  f.wait->Add(labels, StepBuckets()).Observe(std::max(0.0, wait_seconds));
}

void RecordQkClip(const std::string& job, int heads_clipped, double max_logit) {
  Families& f = F();
  const Labels labels{{kJobLabel, job}};
  absl::MutexLock lock(&f.mu);
  f.jobs.insert(job);
  f.qk_clipped->Add(labels).Increment(std::max(0, heads_clipped));
  if (std::isfinite(max_logit)) f.qk_max_logit->Add(labels).Set(max_logit);
}

void SetJobPressure(const std::string& job, const JobPressure& p) {
  Families& f = F();
  const Labels labels{{kJobLabel, job}};
  const uint64_t pinned[] = {p.momentum_bytes, p.masters_bytes, p.moments_bytes,
                             p.session_region_bytes, p.staging_bytes};
  absl::MutexLock lock(&f.mu);
  f.jobs.insert(job);
  f.waiting->Add(labels).Set(static_cast<double>(p.matrices_waiting));
  f.gather_in_use->Add(labels).Set(static_cast<double>(p.gather_in_use_bytes));
  for (size_t k = 0; k < std::size(kPinnedKinds); ++k) {
    f.pinned->Add({{kJobLabel, job}, {"kind", kPinnedKinds[k]}})
        .Set(static_cast<double>(pinned[k]));
  }
  for (const auto& [kind, bytes] : p.memory) {
    f.memory_kinds[job].insert(kind);
    f.memory->Add({{kJobLabel, job}, {"kind", kind}}).Set(static_cast<double>(bytes));
  }
  f.footprint->Add(labels).Set(static_cast<double>(p.footprint_bytes));
}

void RemoveJobsNotIn(const std::set<std::string>& present) {
  Families& f = F();
  absl::MutexLock lock(&f.mu);
  for (auto it = f.jobs.begin(); it != f.jobs.end();) {
    const std::string& job = *it;
    if (present.count(job) != 0) {
      ++it;
      continue;
    }
    const Labels labels{{kJobLabel, job}};
    for (Family<Gauge>* g :
         {f.orthogonality, f.waiting, f.gather_in_use, f.qk_max_logit, f.footprint}) {
      RemoveSeries(g, labels);
    }
    for (Family<Counter>* c : {f.orthogonality_seconds, f.orthogonality_checks, f.qk_clipped}) {
      RemoveSeries(c, labels);
    }
    RemoveSeries(f.visible, labels);
    RemoveSeries(f.wait, labels);
    for (const char* kind : kPinnedKinds)
      RemoveSeries(f.pinned, {{kJobLabel, job}, {"kind", kind}});
    for (const std::string& kind : f.memory_kinds[job]) {
      RemoveSeries(f.memory, {{kJobLabel, job}, {"kind", kind}});
    }
    f.memory_kinds.erase(job);
    for (const Labels& l : f.shapes[job]) RemoveSeries(f.newton_schulz, l);
    f.shapes.erase(job);
    it = f.jobs.erase(it);
  }
}

}  // namespace muond::server
