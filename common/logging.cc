#include "common/logging.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <ctime>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace muond::common {
namespace {

std::atomic<int> g_min_level{static_cast<int>(LogLevel::kINFO)};

const char* LevelTag(LogLevel level) {
  switch (level) {
    case LogLevel::kDEBUG:
      return "D";
    case LogLevel::kINFO:
      return "I";
    case LogLevel::kWARNING:
      return "W";
    case LogLevel::kERROR:
      return "E";
  }
  return "?";
}

}  // namespace

void SetMinLogLevel(LogLevel level) { g_min_level.store(static_cast<int>(level)); }
LogLevel MinLogLevel() { return static_cast<LogLevel>(g_min_level.load()); }

bool ParseLogLevel(std::string_view name, LogLevel* level) {
  if (name == "debug")
    *level = LogLevel::kDEBUG;
  else if (name == "info")
    *level = LogLevel::kINFO;
  else if (name == "warning")
    *level = LogLevel::kWARNING;
  else if (name == "error")
    *level = LogLevel::kERROR;
  else
    return false;
  return true;
}

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  const char* base = std::strrchr(file, '/');
  stream_ << absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()) << ' '
          << LevelTag(level_) << ' ' << (base ? base + 1 : file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string line = stream_.str();
  // One write(2) per line keeps lines from different threads whole.
  ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
  (void)unused;
}

}  // namespace muond::common
