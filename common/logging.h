// A small leveled logger for the daemon and tools (Abseil 20220623 has no absl/log).
//
//   MUOND_LOG(INFO) << "listening on " << address;
//
// Each statement writes one line to stderr: "<UTC time> <level> <file>:<line>] message", atomically
// with respect to other log statements. Lines below the minimum level (SetMinLogLevel) are dropped.
// Thread-safe.
#ifndef MUOND_COMMON_LOGGING_H_
#define MUOND_COMMON_LOGGING_H_

#include <sstream>
#include <string_view>

namespace muond::common {

enum class LogLevel { kDEBUG = 0, kINFO = 1, kWARNING = 2, kERROR = 3 };

void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();
// "debug", "info", "warning", "error"; false for anything else.
bool ParseLogLevel(std::string_view name, LogLevel* level);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

}  // namespace muond::common

// A one-pass for loop (rather than if/else) keeps `if (x) MUOND_LOG(INFO) << ...;` unambiguous.
#define MUOND_LOG(level)                                                                   \
  for (bool muond_log_on_ = ::muond::common::LogLevel::k##level >=                         \
                            ::muond::common::MinLogLevel();                                \
       muond_log_on_; muond_log_on_ = false)                                               \
  ::muond::common::LogMessage(::muond::common::LogLevel::k##level, __FILE__, __LINE__).stream()

#endif  // MUOND_COMMON_LOGGING_H_
