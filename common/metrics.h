// Metrics on prometheus-cpp (Debian's prometheus-cpp-dev): the daemon's registry is a
// prometheus::Registry, its counters, gauges and histograms are prometheus-cpp families, and the
// exposition is prometheus-cpp's TextSerializer (text format 0.0.4). This header adds the two
// things prometheus-cpp leaves to its user:
//
//  - promtool's naming conventions, checked when a family is added (prometheus-cpp checks only the
//    character set): counter names end in `_total`, no family other than a histogram ends in
//    `_bucket`, `_sum` or `_count`, and every family has help text. prometheus-cpp 1.0.1 writes
//    help text unescaped, so a backslash or a newline in it is refused rather than corrupting a
//    scrape.
//  - collect callbacks, run at the start of every Serialize(), for values read at scrape time
//    (queue depths, memory in use) instead of being updated continuously.
//
//   MetricsRegistry& registry = DefaultRegistry();
//   Family<Counter>* steps = registry.AddCounter("muond_steps_total", "Steps completed.").value();
//   Counter& job_steps = steps->Add({{"job", "a"}});   // declare once, keep the reference
//   job_steps.Increment();                              // then update from anywhere
//   // Histogram children take their bucket bounds when added:
//   registry.AddHistogram("muond_x_seconds", "X.").value()->Add({}, ExponentialBuckets(1e-3, 2,
//   8));
//
// Thread-safety: every method is thread-safe (prometheus-cpp's families and registry lock
// internally; the callbacks have their own mutex). Ownership: the MetricsRegistry owns its families
// (through the prometheus::Registry); a family pointer stays valid for the registry's lifetime, a
// child reference until Family::Remove(child).
#ifndef MUOND_COMMON_METRICS_H_
#define MUOND_COMMON_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/labels.h"
#include "prometheus/registry.h"

namespace muond::common {

using Labels = prometheus::Labels;  // label name -> value, ordered
using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

// `count` bounds start, start*factor, start*factor^2, ...
// REQUIRES: start > 0, factor > 1, count >= 1 (otherwise the result is empty).
Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count);

class MetricsRegistry {
 public:
  using CallbackId = uint64_t;

  MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Adds a family. INVALID_ARGUMENT when the name is not a Prometheus metric name or breaks the
  // conventions above, or the help text is empty or holds a backslash or a newline;
  // ALREADY_EXISTS when a family of that name was added before. The pointer stays valid for the
  // registry's lifetime.
  absl::StatusOr<Family<Counter>*> AddCounter(std::string_view name, std::string_view help);
  absl::StatusOr<Family<Gauge>*> AddGauge(std::string_view name, std::string_view help);
  absl::StatusOr<Family<Histogram>*> AddHistogram(std::string_view name, std::string_view help);

  // Registers `callback` to run at the start of every Serialize(). Callbacks run one at a time, in
  // registration order, on the scraping thread.
  // REQUIRES: a callback does not call AddCollectCallback or RemoveCollectCallback (deadlock).
  CallbackId AddCollectCallback(std::function<void()> callback) ABSL_LOCKS_EXCLUDED(callbacks_mu_);
  // Unregisters a callback; after it returns the callback is not running and will not run again.
  // False when `id` is unknown.
  bool RemoveCollectCallback(CallbackId id) ABSL_LOCKS_EXCLUDED(callbacks_mu_);

  // Runs the collect callbacks, then serializes every family that has a series with
  // prometheus::TextSerializer.
  std::string Serialize() const ABSL_LOCKS_EXCLUDED(callbacks_mu_);

  // The prometheus-cpp registry itself (for a prometheus::Exposer or a push gateway).
  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

 private:
  const std::shared_ptr<prometheus::Registry> registry_;
  mutable absl::Mutex callbacks_mu_;
  std::map<CallbackId, std::function<void()>> callbacks_ ABSL_GUARDED_BY(callbacks_mu_);
  CallbackId next_callback_id_ ABSL_GUARDED_BY(callbacks_mu_) = 1;
};

// Logs `status` and aborts: see MustRegister.
[[noreturn]] void AbortOnMetricsError(const absl::Status& status);

// The family a daemon cannot run without: a failure to add it is a programming error (a bad name,
// or declared twice), so it aborts at the first scrape or update rather than exporting less.
template <typename T>
T* MustRegister(absl::StatusOr<T*> family) {
  if (!family.ok()) AbortOnMetricsError(family.status());
  return *family;
}

// Removes the series of `labels` from `family`, if it has one (a reference to it dangles after).
template <typename T>
void RemoveSeries(Family<T>* family, const Labels& labels) {
  if (!family->Has(labels)) return;
  if constexpr (std::is_same_v<T, Histogram>) {
    family->Remove(&family->Add(labels, Histogram::BucketBoundaries{}));
  } else {
    family->Remove(&family->Add(labels));
  }
}

// The process-wide registry that the daemon serves; never destroyed.
MetricsRegistry& DefaultRegistry();

}  // namespace muond::common

#endif  // MUOND_COMMON_METRICS_H_
