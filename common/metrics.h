// Metrics: a registry of counter, gauge and histogram families with labels, rendered in the
// Prometheus text exposition format 0.0.4. Shaped like prometheus-cpp, written for muond.
//
//   Registry& registry = DefaultRegistry();
//   Family<Counter>* steps = registry.AddCounter("muond_steps_total", "Steps completed.").value();
//   Counter& job_steps = steps->Add({{"job", "a"}});   // declare once, keep the reference
//   job_steps.Increment();                              // then update from anywhere, lock-free
//
// Names follow the Prometheus data model and the conventions promtool lints for: counter names end
// in `_total`, no family other than a histogram ends in `_bucket`, `_sum` or `_count`, every family
// has help text, and `le` / `quantile` are not usable as label names. Anything else is refused with
// INVALID_ARGUMENT when the family is added; a second family with a name already used is refused
// with ALREADY_EXISTS.
//
// Thread-safety: every class here is thread-safe. Counter/Gauge/Histogram updates are atomic and
// never block; Family::Add/Remove and Registry methods take short internal locks.
// Ownership: the Registry owns its families and a Family owns its children. A Family pointer stays
// valid as long as the Registry; a child reference stays valid until Family::Remove(child) or the
// Registry's destruction.
#ifndef MUOND_COMMON_METRICS_H_
#define MUOND_COMMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics_text.h"

namespace muond::common {

enum class MetricType { kCounter, kGauge, kHistogram };

// "counter", "gauge", "histogram": the word on a `# TYPE` line.
const char* MetricTypeName(MetricType type);

template <typename T>
class Family;

// A value that only goes up (requests served, bytes sent). Starts at 0.
class Counter {
 public:
  static constexpr MetricType kType = MetricType::kCounter;

  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // Adds `v`. A counter never goes down: a negative or NaN `v` is refused, the value is left as it
  // was, and false is returned. True when `v` was added.
  bool Increment(double v = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  template <typename T>
  friend class Family;
  void AppendSamples(std::string_view name, const Labels& labels, std::string* out) const;

  std::atomic<double> value_{0.0};
};

// A value that goes up and down (queue depth, bytes pinned). Starts at 0.
class Gauge {
 public:
  static constexpr MetricType kType = MetricType::kGauge;

  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Increment(double v = 1.0);
  void Decrement(double v = 1.0) { Increment(-v); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  template <typename T>
  friend class Family;
  void AppendSamples(std::string_view name, const Labels& labels, std::string* out) const;

  std::atomic<double> value_{0.0};
};

// A consistent view of a histogram, as a scrape renders it.
struct HistogramSnapshot {
  // cumulative_counts[i]: observations <= bounds[i]; the last entry (one past the bounds) is the
  // +Inf bucket and equals `count`.
  std::vector<uint64_t> cumulative_counts;
  double sum = 0;
  uint64_t count = 0;
};

// Observations counted into fixed buckets (upper bounds inclusive, as Prometheus' `le`), plus their
// sum and count. The bounds belong to the family; every child of a family shares them.
class Histogram {
 public:
  static constexpr MetricType kType = MetricType::kHistogram;

  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // Counts `v` in the first bucket whose bound is >= v (+Inf when none) and adds it to the sum.
  // NaN is ignored: it belongs to no bucket and would poison the sum for the process's lifetime.
  void Observe(double v);

  const std::vector<double>& bounds() const { return bounds_; }
  HistogramSnapshot Snapshot() const;

 private:
  template <typename T>
  friend class Family;
  explicit Histogram(const std::vector<double>& bounds);
  void AppendSamples(std::string_view name, const Labels& labels, std::string* out) const;

  const std::vector<double>& bounds_;
  // Per bucket (not cumulative), bounds_.size() + 1 entries; the last one is the overflow bucket.
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
};

// `count` bounds start, start*factor, start*factor^2, ...
// REQUIRES: start > 0, factor > 1, count >= 1 (otherwise the result is empty).
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// `count` bounds start, start+width, start+2*width, ...
// REQUIRES: width > 0, count >= 1 (otherwise the result is empty).
std::vector<double> LinearBuckets(double start, double width, int count);

// What the Registry sees of a family, whatever its child type.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }

  // Appends the family's HELP and TYPE lines and its samples, children in label-set order. Appends
  // nothing when the family has no child.
  virtual void Render(std::string* out) const = 0;

 protected:
  FamilyBase(std::string name, std::string help, MetricType type)
      : name_(std::move(name)), help_(std::move(help)), type_(type) {}

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
};

// The children of one metric name, one per label set. Created by Registry::Add*.
template <typename T>
class Family final : public FamilyBase {
 public:
  // Returns the child for `labels`, creating it on first use; the same label set always returns the
  // same child. The empty set is the family's unlabelled child.
  // INVALID_ARGUMENT when a label name is not valid (IsValidLabelName) or reserved ("le",
  // "quantile"), or a value is not valid UTF-8.
  absl::StatusOr<T*> TryAdd(const Labels& labels) ABSL_LOCKS_EXCLUDED(mu_);

  // TryAdd for call sites that cannot handle an error: on an invalid label set it logs an error
  // (once per family) and returns a detached child that is updated normally but never rendered.
  T& Add(const Labels& labels) ABSL_LOCKS_EXCLUDED(mu_);

  // Removes `child` from the family; its series disappears from the next scrape and any reference
  // to it dangles. False (and nothing happens) when `child` is not a child of this family.
  bool Remove(const T* child) ABSL_LOCKS_EXCLUDED(mu_);

  // Number of children (label sets) rendered.
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

  void Render(std::string* out) const override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class Registry;
  Family(std::string name, std::string help, std::vector<double> bounds);
  std::unique_ptr<T> MakeChild() const;

  const std::vector<double> bounds_;  // Histograms only; empty otherwise.
  mutable absl::Mutex mu_;
  std::map<Labels, std::unique_ptr<T>> children_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<T> detached_ ABSL_GUARDED_BY(mu_);
  bool logged_invalid_ ABSL_GUARDED_BY(mu_) = false;
};

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

// A set of families with unique names, rendered together.
class Registry {
 public:
  using CallbackId = uint64_t;

  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Add a family. `help` is required (promtool flags a family without one). Errors: see the file
  // comment. The returned pointer stays valid for the Registry's lifetime.
  absl::StatusOr<Family<Counter>*> AddCounter(std::string_view name, std::string_view help);
  absl::StatusOr<Family<Gauge>*> AddGauge(std::string_view name, std::string_view help);
  // `bounds`: the buckets' upper bounds, finite and strictly increasing (may be empty: then only
  // the implicit +Inf bucket); INVALID_ARGUMENT otherwise.
  absl::StatusOr<Family<Histogram>*> AddHistogram(std::string_view name, std::string_view help,
                                                  std::vector<double> bounds);

  // Registers `callback` to run at the start of every Serialize(), so values that are cheap to read
  // but not worth updating continuously (queue depths, memory in use) are set at scrape time.
  // Callbacks run one at a time, in registration order, on the scraping thread.
  // REQUIRES: a callback does not call AddCollectCallback or RemoveCollectCallback (deadlock).
  CallbackId AddCollectCallback(std::function<void()> callback) ABSL_LOCKS_EXCLUDED(callbacks_mu_);
  // Unregisters a callback; after it returns the callback is not running and will not run again.
  // False when `id` is unknown.
  bool RemoveCollectCallback(CallbackId id) ABSL_LOCKS_EXCLUDED(callbacks_mu_);

  // Runs the collect callbacks, then renders every family in name order (text format 0.0.4).
  std::string Serialize() const ABSL_LOCKS_EXCLUDED(mu_, callbacks_mu_);

 private:
  template <typename T>
  absl::StatusOr<Family<T>*> AddFamily(std::string_view name, std::string_view help,
                                       std::vector<double> bounds) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<FamilyBase>, std::less<>> families_ ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex callbacks_mu_;
  std::map<CallbackId, std::function<void()>> callbacks_ ABSL_GUARDED_BY(callbacks_mu_);
  CallbackId next_callback_id_ ABSL_GUARDED_BY(callbacks_mu_) = 1;
};

// The process-wide registry that the daemon serves; never destroyed.
Registry& DefaultRegistry();

}  // namespace muond::common

#endif  // MUOND_COMMON_METRICS_H_
