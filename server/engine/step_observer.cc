#include "server/engine/step_observer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "server/optim/muon_math.h"
#include "server/optim/orthogonality.h"
#include "server/record/optimizer_metrics.h"

namespace muond::server {
namespace {

std::atomic<int64_t> orthogonality_every{100};

}  // namespace

void SetOrthogonalityEvery(int64_t every) {
  orthogonality_every.store(std::max<int64_t>(0, every));
}
int64_t OrthogonalityEvery() { return orthogonality_every.load(); }

StepObserver::StepObserver(const common::JobSpec& spec, std::string backend)
    : spec_(spec),
      backend_(std::move(backend)),
      dtype_(common::DTypeName(spec.muon.compute_dtype)),
      class_of_(spec.matrices.size(), 0),
      flops_(spec.matrices.size(), 0),
      muon_index_(spec.matrices.size(), 0) {
  // The distinct shapes of the Muon matrices, with their FLOPs over the job.
  std::vector<std::string> order;
  std::map<std::string, double> flops_of;
  std::vector<std::string> label(spec.matrices.size());
  for (uint32_t m = 0; m < spec.matrices.size(); ++m) {
    const common::MatrixSpec& ms = spec.matrices[m];
    if (ms.optimizer != common::Optimizer::kMuon) continue;
    muon_index_[m] = muon_.size();
    muon_.push_back(m);
    flops_[m] = NewtonSchulzFlops(spec.muon, ms);
    label[m] = absl::StrJoin(ms.shape, "x");
    if (flops_of.count(label[m]) == 0) order.push_back(label[m]);
    flops_of[label[m]] += flops_[m];
  }
  // The kMaxShapeClasses heaviest shapes keep their own class, in the job's order.
  std::vector<std::string> heaviest = order;
  std::stable_sort(
      heaviest.begin(), heaviest.end(),
      [&](const std::string& a, const std::string& b) { return flops_of[a] > flops_of[b]; });
  if (heaviest.size() > kMaxShapeClasses) heaviest.resize(kMaxShapeClasses);
  std::map<std::string, size_t> index;
  for (const std::string& s : order) {
    if (std::find(heaviest.begin(), heaviest.end(), s) == heaviest.end()) continue;
    index[s] = classes_.size();
    classes_.push_back(s);
  }
  if (order.size() > heaviest.size()) classes_.push_back("other");
  times_.resize(classes_.size());
  for (size_t c = 0; c < classes_.size(); ++c) times_[c].shape = classes_[c];
  for (uint32_t m : muon_) {
    auto it = index.find(label[m]);
    class_of_[m] = it != index.end() ? it->second : classes_.size() - 1;
    ++times_[class_of_[m]].per_step;
  }
}

void StepObserver::Attribute(const std::vector<uint32_t>& matrices, double compute_seconds) {
  if (matrices.empty() || !(compute_seconds >= 0)) return;
  double total = 0;
  for (uint32_t m : matrices) total += flops_[m];
  if (!(total > 0)) return;
  std::vector<double> share(matrices.size());
  for (size_t i = 0; i < matrices.size(); ++i) {
    share[i] = compute_seconds * (flops_[matrices[i]] / total);
    RecordNewtonSchulz(spec_.job_id, ShapeClassOf(matrices[i]), dtype_, backend_, share[i]);
  }
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < matrices.size(); ++i) {
    ShapeTime& t = times_[class_of_[matrices[i]]];
    ++t.matrices;
    t.seconds += share[i];
  }
}

bool StepObserver::Samples(int64_t step, uint32_t m) const {
  const int64_t every = OrthogonalityEvery();
  if (every <= 0 || step % every != 0 || muon_.empty() ||
      spec_.matrices[m].optimizer != common::Optimizer::kMuon) {
    return false;
  }
  // The Muon matrices in kOrthogonalitySample strided picks, shifted by one each sampled step.
  const size_t stride = (muon_.size() + kOrthogonalitySample - 1) / kOrthogonalitySample;
  const size_t turn = static_cast<size_t>(step / every) % stride;
  return muon_index_[m] % stride == turn;
}

void StepObserver::Measure(int64_t step, uint32_t m, const float* update) {
  const absl::Time start = absl::Now();
  const double value = UpdateOrthogonalityError(spec_.muon, spec_.matrices[m], update);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  double worst = value;
  {
    absl::MutexLock lock(&mu_);
    if (orthogonality_ && orthogonality_->step == step) {
      worst = std::max(orthogonality_->value, value);
      if (std::isnan(value)) worst = value;
      orthogonality_->value = worst;
      ++orthogonality_->matrices;
    } else {
      orthogonality_ = Orthogonality{step, value, 1};
    }
  }
  RecordOrthogonality(spec_.job_id, worst, seconds);
}

std::vector<StepObserver::ShapeTime> StepObserver::ShapeTimes() const {
  absl::MutexLock lock(&mu_);
  return times_;
}

std::optional<StepObserver::Orthogonality> StepObserver::LastOrthogonality() const {
  absl::MutexLock lock(&mu_);
  return orthogonality_;
}

}  // namespace muond::server
