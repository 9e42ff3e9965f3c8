#include "common/metrics_text.h"

#include <charconv>
#include <cmath>
#include <system_error>

namespace muond::common {
namespace {

bool IsAsciiLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

void AppendEscaped(std::string_view in, bool escape_quote, std::string* out) {
  for (char c : in) {
    switch (c) {
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '"':
        if (escape_quote) {
          out->append("\\\"");
        } else {
          out->push_back(c);
        }
        break;
      default:
        out->push_back(c);
    }
  }
}

}  // namespace

bool IsValidMetricName(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsAsciiLetter(c) || c == '_' || c == ':' || (i > 0 && IsAsciiDigit(c));
    if (!ok) return false;
  }
  return true;
}

bool IsValidLabelName(std::string_view name) {
  if (name.empty()) return false;
  if (name.size() >= 2 && name[0] == '_' && name[1] == '_') return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsAsciiLetter(c) || c == '_' || (i > 0 && IsAsciiDigit(c));
    if (!ok) return false;
  }
  return true;
}

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  AppendEscaped(value, /*escape_quote=*/true, &out);
  return out;
}

std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  AppendEscaped(help, /*escape_quote=*/false, &out);
  return out;
}

std::string FormatSampleValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // std::to_chars without a format gives the shortest representation that round-trips.
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), value);
  if (r.ec != std::errc()) return "NaN";  // Unreachable: 64 bytes hold any double.
  return std::string(buf, r.ptr);
}

void AppendSampleLine(std::string_view name, const Labels& labels, std::string_view extra_name,
                      std::string_view extra_value, double value, std::string* out) {
  out->append(name);
  if (!labels.empty() || !extra_name.empty()) {
    out->push_back('{');
    bool first = true;
    auto append_label = [&](std::string_view k, std::string_view v) {
      if (!first) out->push_back(',');
      first = false;
      out->append(k);
      out->append("=\"");
      AppendEscaped(v, /*escape_quote=*/true, out);
      out->push_back('"');
    };
    for (const auto& [k, v] : labels) append_label(k, v);
    if (!extra_name.empty()) append_label(extra_name, extra_value);
    out->push_back('}');
  }
  out->push_back(' ');
  out->append(FormatSampleValue(value));
  out->push_back('\n');
}

}  // namespace muond::common
