// Reading a muond metrics endpoint from muonctl: one HTTP/1.0 GET of /metrics and a parser of the
// Prometheus text format 0.0.4 samples (comments and HELP/TYPE lines skipped).
//
// Thread-safe (no shared state). ScrapeMetrics blocks for at most about `timeout_seconds` per
// socket operation.
#ifndef MUOND_CLIENT_METRICS_SCRAPE_H_
#define MUOND_CLIENT_METRICS_SCRAPE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muond::client {

struct MetricSample {
  std::string name;  // e.g. "muond_step_duration_seconds_sum"
  std::map<std::string, std::string> labels;
  double value = 0;
};

// GET http://ADDRESS/metrics, ADDRESS "HOST:PORT". The body on a 200 answer. INVALID_ARGUMENT for
// an address that is not HOST:PORT; UNAVAILABLE when it cannot be reached or answers otherwise.
absl::StatusOr<std::string> FetchMetricsText(const std::string& address,
                                             double timeout_seconds = 2);

// Parses text format 0.0.4. INVALID_ARGUMENT naming the line for a sample line that does not parse.
absl::StatusOr<std::vector<MetricSample>> ParseMetricsText(const std::string& text);

// FetchMetricsText + ParseMetricsText.
absl::StatusOr<std::vector<MetricSample>> ScrapeMetrics(const std::string& address,
                                                        double timeout_seconds = 2);

// The value of the first sample named `name` whose labels include all of `labels`; `fallback`
// when there is none.
double FindSample(const std::vector<MetricSample>& samples, const std::string& name,
                  const std::map<std::string, std::string>& labels, double fallback);

}  // namespace muond::client

#endif  // MUOND_CLIENT_METRICS_SCRAPE_H_
