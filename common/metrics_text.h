// The pieces of the Prometheus text exposition format 0.0.4 that common/metrics.h renders with:
// name validation per the Prometheus data model, escaping, and number formatting.
//
// Reference: https://prometheus.io/docs/instrumenting/exposition_formats/ (text format 0.0.4) and
// https://prometheus.io/docs/concepts/data_model/ (names). All functions are pure and thread-safe.
#ifndef MUOND_COMMON_METRICS_TEXT_H_
#define MUOND_COMMON_METRICS_TEXT_H_

#include <map>
#include <string>
#include <string_view>

namespace muond::common {

// A label set: label name -> value. Ordered, so a set renders (and sorts) the same way every time.
using Labels = std::map<std::string, std::string>;

// True when `name` matches [a-zA-Z_:][a-zA-Z0-9_:]* (a metric name).
bool IsValidMetricName(std::string_view name);

// True when `name` matches [a-zA-Z_][a-zA-Z0-9_]* and does not start with "__" (reserved for
// Prometheus' internal use).
bool IsValidLabelName(std::string_view name);

// Label values: backslash -> \\, double quote -> \", newline -> \n.
std::string EscapeLabelValue(std::string_view value);

// HELP text: backslash -> \\, newline -> \n (double quotes stay as they are).
std::string EscapeHelp(std::string_view help);

// The shortest decimal text that parses back to exactly `value` ("0.1", "42", "1e+21"); infinities
// and NaN as Prometheus (Go's ParseFloat) spells them: "+Inf", "-Inf", "NaN".
std::string FormatSampleValue(double value);

// Appends one sample line: `name{k="v",...,extra_name="extra_value"} value\n`. The braces are left
// out when there is no label at all; the extra label (used for a histogram's `le`) goes last and is
// skipped when `extra_name` is empty.
void AppendSampleLine(std::string_view name, const Labels& labels, std::string_view extra_name,
                      std::string_view extra_value, double value, std::string* out);

}  // namespace muond::common

#endif  // MUOND_COMMON_METRICS_TEXT_H_
