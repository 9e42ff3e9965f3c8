#include "common/metrics.h"

#include <cstdlib>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "prometheus/check_names.h"
#include "prometheus/text_serializer.h"

namespace muond::common {
namespace {

enum class Kind { kCounter, kGauge, kHistogram };

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kCounter:
      return "counter";
    case Kind::kGauge:
      return "gauge";
    case Kind::kHistogram:
      return "histogram";
  }
  return "metric";
}

std::string Quoted(std::string_view s) { return "\"" + std::string(s) + "\""; }

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

absl::Status CheckFamily(std::string_view name, std::string_view help, Kind kind) {
  if (!prometheus::CheckMetricName(std::string(name))) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric name ", Quoted(name), " does not match [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  if (help.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("metric ", Quoted(name), " has no help text"));
  }
  if (help.find_first_of("\\\n") != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "help text of metric ", Quoted(name),
        " holds a backslash or a newline, which prometheus-cpp would write unescaped"));
  }
  if (kind == Kind::kCounter && !EndsWith(name, "_total")) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter name ", Quoted(name), " must end in \"_total\""));
  }
  if (kind != Kind::kHistogram) {
    for (std::string_view suffix : {"_bucket", "_sum", "_count"}) {
      if (EndsWith(name, suffix)) {
        return absl::InvalidArgumentError(absl::StrCat(KindName(kind), " name ", Quoted(name),
                                                       " ends in ", Quoted(suffix),
                                                       ", which is reserved for histogram series"));
      }
    }
  }
  return absl::OkStatus();
}

// Registers the family `builder` describes. The registry refuses a second family of a name
// (InsertBehavior::Throw) by throwing; nothing else can throw once CheckFamily passed.
template <typename Builder>
auto Register(Builder builder, prometheus::Registry& registry, std::string_view name,
              std::string_view help, Kind kind)
    -> absl::StatusOr<decltype(&builder.Register(registry))> {
  if (absl::Status s = CheckFamily(name, help, kind); !s.ok()) return s;
  try {
    return &builder.Name(std::string(name)).Help(std::string(help)).Register(registry);
  } catch (const std::exception& e) {
    return absl::AlreadyExistsError(
        absl::StrCat("metric ", Quoted(name), " is already registered (", e.what(), ")"));
  }
}

}  // namespace

void AbortOnMetricsError(const absl::Status& status) {
  MUOND_LOG(ERROR) << "metrics: " << status;
  std::abort();
}

Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count) {
  Histogram::BucketBoundaries bounds;
  if (!(start > 0) || !(factor > 1) || count < 1) return bounds;
  bounds.reserve(count);
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds.push_back(bound);
  return bounds;
}

MetricsRegistry::MetricsRegistry()
    : registry_(
          std::make_shared<prometheus::Registry>(prometheus::Registry::InsertBehavior::Throw)) {}

absl::StatusOr<Family<Counter>*> MetricsRegistry::AddCounter(std::string_view name,
                                                             std::string_view help) {
  return Register(prometheus::BuildCounter(), *registry_, name, help, Kind::kCounter);
}

absl::StatusOr<Family<Gauge>*> MetricsRegistry::AddGauge(std::string_view name,
                                                         std::string_view help) {
  return Register(prometheus::BuildGauge(), *registry_, name, help, Kind::kGauge);
}

absl::StatusOr<Family<Histogram>*> MetricsRegistry::AddHistogram(std::string_view name,
                                                                 std::string_view help) {
  return Register(prometheus::BuildHistogram(), *registry_, name, help, Kind::kHistogram);
}

MetricsRegistry::CallbackId MetricsRegistry::AddCollectCallback(std::function<void()> callback) {
  absl::MutexLock lock(&callbacks_mu_);
  const CallbackId id = next_callback_id_++;
  callbacks_.emplace(id, std::move(callback));
  return id;
}

bool MetricsRegistry::RemoveCollectCallback(CallbackId id) {
  absl::MutexLock lock(&callbacks_mu_);
  return callbacks_.erase(id) > 0;
}

std::string MetricsRegistry::Serialize() const {
  {
    // Held while the callbacks run, so RemoveCollectCallback waits for a running one to finish.
    absl::MutexLock lock(&callbacks_mu_);
    for (const auto& [id, callback] : callbacks_) callback();
  }
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

MetricsRegistry& DefaultRegistry() {
  static MetricsRegistry* const registry = new MetricsRegistry();
  return *registry;
}

}  // namespace muond::common
