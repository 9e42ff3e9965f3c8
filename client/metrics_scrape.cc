#include "client/metrics_scrape.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace muond::client {
namespace {

absl::Status Unreachable(const std::string& address, const std::string& why) {
  return absl::UnavailableError(absl::StrCat("metrics at http://", address, "/metrics: ", why));
}

// Parses one sample line: name{labels} value [timestamp].
bool ParseSampleLine(const std::string& line, MetricSample* out) {
  size_t i = 0;
  while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
  out->name = line.substr(0, i);
  if (out->name.empty()) return false;
  out->labels.clear();
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (i < line.size() && line[i] != '}') {
      const size_t eq = line.find('=', i);
      if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') return false;
      std::string key = line.substr(i, eq - i);
      std::string value;
      size_t j = eq + 2;
      for (; j < line.size() && line[j] != '"'; ++j) {
        if (line[j] == '\\' && j + 1 < line.size()) {
          ++j;
          value += line[j] == 'n' ? '\n' : line[j];
        } else {
          value += line[j];
        }
      }
      if (j >= line.size()) return false;
      out->labels[key] = value;
      i = j + 1;
      if (i < line.size() && line[i] == ',') ++i;
    }
    if (i >= line.size()) return false;
    ++i;  // '}'
  }
  while (i < line.size() && line[i] == ' ') ++i;
  const size_t end = line.find(' ', i);
  const std::string number = line.substr(i, end == std::string::npos ? std::string::npos : end - i);
  if (number.empty()) return false;
  char* parsed_end = nullptr;
  out->value = std::strtod(number.c_str(), &parsed_end);
  return parsed_end != nullptr && *parsed_end == '\0';
}

}  // namespace

absl::StatusOr<std::string> FetchMetricsText(const std::string& address, double timeout_seconds) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\" is not HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return Unreachable(address, gai_strerror(rc));
  }
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(timeout_seconds);
    tv.tv_usec = static_cast<suseconds_t>((timeout_seconds - std::floor(timeout_seconds)) * 1e6);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));  // bounds connect() too
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return Unreachable(address, why);
  const std::string request =
      absl::StrCat("GET /metrics HTTP/1.0\r\nHost: ", address, "\r\nAccept: text/plain\r\n\r\n");
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    why = std::strerror(errno);
    close(fd);
    return Unreachable(address, why);
  }
  std::string response;
  char buf[16384];
  while (true) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      why = std::strerror(errno);
      close(fd);
      return Unreachable(address, why);
    }
    response.append(buf, static_cast<size_t>(n));
    if (response.size() > (size_t{64} << 20)) {
      close(fd);
      return Unreachable(address, "response larger than 64 MiB");
    }
  }
  close(fd);
  const size_t header_end = response.find("\r\n\r\n");
  const size_t line_end = response.find("\r\n");
  if (header_end == std::string::npos) return Unreachable(address, "malformed HTTP response");
  const std::string status_line = response.substr(0, line_end);
  if (!absl::StartsWith(status_line, "HTTP/1.") || status_line.find(" 200") == std::string::npos) {
    return Unreachable(address, absl::StrCat("answered \"", status_line, "\""));
  }
  return response.substr(header_end + 4);
}

absl::StatusOr<std::vector<MetricSample>> ParseMetricsText(const std::string& text) {
  std::vector<MetricSample> samples;
  int n = 0;
  for (absl::string_view piece : absl::StrSplit(text, '\n')) {
    ++n;
    std::string line(piece);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    MetricSample s;
    if (!ParseSampleLine(line, &s)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics line ", n, " does not parse: ", line));
    }
    samples.push_back(std::move(s));
  }
  return samples;
}

absl::StatusOr<std::vector<MetricSample>> ScrapeMetrics(const std::string& address,
                                                        double timeout_seconds) {
  absl::StatusOr<std::string> text = FetchMetricsText(address, timeout_seconds);
  if (!text.ok()) return text.status();
  return ParseMetricsText(*text);
}

double FindSample(const std::vector<MetricSample>& samples, const std::string& name,
                  const std::map<std::string, std::string>& labels, double fallback) {
  for (const MetricSample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = s.labels.find(k);
      if (it == s.labels.end() || it->second != v) {
        match = false;
        break;
      }
    }
    if (match) return s.value;
  }
  return fallback;
}

}  // namespace muond::client
