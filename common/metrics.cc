#include "common/metrics.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/utf8.h"

namespace muond::common {
namespace {

// std::atomic<double>::fetch_add is C++20.
void AtomicAdd(std::atomic<double>* target, double v) {
  double current = target->load(std::memory_order_relaxed);
  while (!target->compare_exchange_weak(current, current + v, std::memory_order_relaxed)) {
  }
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string Quoted(std::string_view s) { return absl::StrCat("\"", std::string(s), "\""); }

absl::Status CheckFamilyName(std::string_view name, std::string_view help, MetricType type) {
  if (!IsValidMetricName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric name ", Quoted(name), " does not match [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  if (help.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("metric ", Quoted(name), " has no help text"));
  }
  if (type == MetricType::kCounter && !EndsWith(name, "_total")) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter name ", Quoted(name), " must end in \"_total\""));
  }
  if (type != MetricType::kHistogram) {
    for (std::string_view suffix : {"_bucket", "_sum", "_count"}) {
      if (EndsWith(name, suffix)) {
        return absl::InvalidArgumentError(
            absl::StrCat(MetricTypeName(type), " name ", Quoted(name), " ends in \"",
                         std::string(suffix), "\", which is reserved for histogram series"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBounds(std::string_view name, const std::vector<double>& bounds) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram ", Quoted(name), ": bucket bound ", FormatSampleValue(bounds[i]),
                       " is not finite (the +Inf bucket is implicit)"));
    }
    if (i > 0 && !(bounds[i - 1] < bounds[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram ", Quoted(name), ": bucket bounds must be strictly increasing, but ",
          FormatSampleValue(bounds[i - 1]), " is followed by ", FormatSampleValue(bounds[i])));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLabels(std::string_view family, const Labels& labels) {
  for (const auto& [name, value] : labels) {
    if (!IsValidLabelName(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", Quoted(family), ": label name ", Quoted(name),
                       " does not match [a-zA-Z_][a-zA-Z0-9_]* or starts with \"__\""));
    }
    if (name == "le" || name == "quantile") {
      return absl::InvalidArgumentError(absl::StrCat("metric ", Quoted(family), ": label name ",
                                                     Quoted(name),
                                                     " is reserved for histograms and summaries"));
    }
    if (!IsValidUtf8(value)) {
      return absl::InvalidArgumentError(absl::StrCat("metric ", Quoted(family), ": value of label ",
                                                     Quoted(name), " is not valid UTF-8"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* MetricTypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// ---- Counter, Gauge, Histogram ----

bool Counter::Increment(double v) {
  if (!(v >= 0)) return false;  // Negative or NaN.
  AtomicAdd(&value_, v);
  return true;
}

void Counter::AppendSamples(std::string_view name, const Labels& labels, std::string* out) const {
  AppendSampleLine(name, labels, "", "", Value(), out);
}

void Gauge::Increment(double v) { AtomicAdd(&value_, v); }

void Gauge::AppendSamples(std::string_view name, const Labels& labels, std::string* out) const {
  AppendSampleLine(name, labels, "", "", Value(), out);
}

Histogram::Histogram(const std::vector<double>& bounds)
    : bounds_(bounds), counts_(new std::atomic<uint64_t>[bounds.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  if (std::isnan(v)) return;
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(&sum_, v);
}

HistogramSnapshot Histogram::Snapshot() const {
  HistogramSnapshot s;
  s.cumulative_counts.resize(bounds_.size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    s.cumulative_counts[i] = running;
  }
  // The count is the +Inf bucket by construction, so the two always agree in a scrape even while
  // other threads observe; the sum may lag or lead them by the observations in flight.
  s.count = running;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

void Histogram::AppendSamples(std::string_view name, const Labels& labels, std::string* out) const {
  const HistogramSnapshot s = Snapshot();
  const std::string bucket_name = absl::StrCat(std::string(name), "_bucket");
  for (size_t i = 0; i < bounds_.size(); ++i) {
    AppendSampleLine(bucket_name, labels, "le", FormatSampleValue(bounds_[i]),
                     static_cast<double>(s.cumulative_counts[i]), out);
  }
  AppendSampleLine(bucket_name, labels, "le", "+Inf", static_cast<double>(s.count), out);
  AppendSampleLine(absl::StrCat(std::string(name), "_sum"), labels, "", "", s.sum, out);
  AppendSampleLine(absl::StrCat(std::string(name), "_count"), labels, "", "",
                   static_cast<double>(s.count), out);
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  if (!(start > 0) || !(factor > 1) || count < 1) return {};
  std::vector<double> bounds(count);
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds[i] = bound;
  return bounds;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  if (!(width > 0) || count < 1) return {};
  std::vector<double> bounds(count);
  // start + i * width rather than a running sum, so errors do not accumulate.
  for (int i = 0; i < count; ++i) bounds[i] = start + i * width;
  return bounds;
}

// ---- Family ----

template <typename T>
Family<T>::Family(std::string name, std::string help, std::vector<double> bounds)
    : FamilyBase(std::move(name), std::move(help), T::kType), bounds_(std::move(bounds)) {}

template <typename T>
std::unique_ptr<T> Family<T>::MakeChild() const {
  if constexpr (std::is_same_v<T, Histogram>) {
    return std::unique_ptr<T>(new Histogram(bounds_));
  } else {
    return std::make_unique<T>();
  }
}

template <typename T>
absl::StatusOr<T*> Family<T>::TryAdd(const Labels& labels) {
  // Fast path: an existing child.
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = children_.find(labels);
    if (it != children_.end()) return it->second.get();
  }
  if (absl::Status s = CheckLabels(name(), labels); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  std::unique_ptr<T>& slot = children_[labels];
  if (slot == nullptr) slot = MakeChild();
  return slot.get();
}

template <typename T>
T& Family<T>::Add(const Labels& labels) {
  absl::StatusOr<T*> child = TryAdd(labels);
  if (child.ok()) return **child;
  absl::MutexLock lock(&mu_);
  if (!logged_invalid_) {
    logged_invalid_ = true;
    MUOND_LOG(ERROR) << "metrics: " << child.status().message()
                     << "; updates to this series are dropped";
  }
  if (detached_ == nullptr) detached_ = MakeChild();
  return *detached_;
}

template <typename T>
bool Family<T>::Remove(const T* child) {
  absl::MutexLock lock(&mu_);
  for (auto it = children_.begin(); it != children_.end(); ++it) {
    if (it->second.get() == child) {
      children_.erase(it);
      return true;
    }
  }
  return false;
}

template <typename T>
size_t Family<T>::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return children_.size();
}

template <typename T>
void Family<T>::Render(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  if (children_.empty()) return;
  absl::StrAppend(out, "# HELP ", name(), " ", EscapeHelp(help()), "\n");
  absl::StrAppend(out, "# TYPE ", name(), " ", MetricTypeName(type()), "\n");
  for (const auto& [labels, child] : children_) child->AppendSamples(name(), labels, out);
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---- Registry ----

template <typename T>
absl::StatusOr<Family<T>*> Registry::AddFamily(std::string_view name, std::string_view help,
                                               std::vector<double> bounds) {
  if (absl::Status s = CheckFamilyName(name, help, T::kType); !s.ok()) return s;
  if (absl::Status s = CheckBounds(name, bounds); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (families_.find(name) != families_.end()) {
    return absl::AlreadyExistsError(
        absl::StrCat("metric ", Quoted(name), " is already registered"));
  }
  auto* family = new Family<T>(std::string(name), std::string(help), std::move(bounds));
  families_.emplace(std::string(name), std::unique_ptr<FamilyBase>(family));
  return family;
}

absl::StatusOr<Family<Counter>*> Registry::AddCounter(std::string_view name,
                                                      std::string_view help) {
  return AddFamily<Counter>(name, help, {});
}

absl::StatusOr<Family<Gauge>*> Registry::AddGauge(std::string_view name, std::string_view help) {
  return AddFamily<Gauge>(name, help, {});
}

absl::StatusOr<Family<Histogram>*> Registry::AddHistogram(std::string_view name,
                                                          std::string_view help,
                                                          std::vector<double> bounds) {
  return AddFamily<Histogram>(name, help, std::move(bounds));
}

Registry::CallbackId Registry::AddCollectCallback(std::function<void()> callback) {
  absl::MutexLock lock(&callbacks_mu_);
  const CallbackId id = next_callback_id_++;
  callbacks_.emplace(id, std::move(callback));
  return id;
}

bool Registry::RemoveCollectCallback(CallbackId id) {
  absl::MutexLock lock(&callbacks_mu_);
  return callbacks_.erase(id) > 0;
}

std::string Registry::Serialize() const {
  {
    // Held while the callbacks run, so RemoveCollectCallback waits for a running one to finish.
    absl::MutexLock lock(&callbacks_mu_);
    for (const auto& [id, callback] : callbacks_) callback();
  }
  // Families are never removed, so the pointers outlive the lock.
  std::vector<const FamilyBase*> families;
  {
    absl::ReaderMutexLock lock(&mu_);
    families.reserve(families_.size());
    for (const auto& [name, family] : families_) families.push_back(family.get());
  }
  std::string out;
  for (const FamilyBase* family : families) family->Render(&out);
  return out;
}

Registry& DefaultRegistry() {
  static Registry* const registry = new Registry();
  return *registry;
}

}  // namespace muond::common
