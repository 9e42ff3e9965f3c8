// Level Zero return codes as absl::Status: every ze* call of the backend goes through
// ZE_RETURN_IF_ERROR (or ZeStatus), so an error names the call and the code.
#ifndef MUOND_SERVER_DEVICE_LEVEL_ZERO_ZE_STATUS_H_
#define MUOND_SERVER_DEVICE_LEVEL_ZERO_ZE_STATUS_H_

#include <level_zero/ze_api.h>

#include <string>

#include "absl/status/status.h"

namespace muond::server::device::level_zero {

// "ZE_RESULT_ERROR_DEVICE_LOST", or "ze_result_t 0x..." for a code this build does not know.
std::string ZeResultName(ze_result_t result);

// OK for ZE_RESULT_SUCCESS; otherwise "<call>: <code name>" with RESOURCE_EXHAUSTED for
// out-of-memory codes, UNAVAILABLE for a lost device or missing driver, INTERNAL otherwise.
absl::Status ZeStatus(const char* call, ze_result_t result);

}  // namespace muond::server::device::level_zero

// Calls fn(args...) and returns its error as a Status naming fn.
#define ZE_RETURN_IF_ERROR(fn, ...)                                                \
  do {                                                                             \
    const ze_result_t muond_ze_result_ = fn(__VA_ARGS__);                          \
    if (muond_ze_result_ != ZE_RESULT_SUCCESS) {                                   \
      return ::muond::server::device::level_zero::ZeStatus(#fn, muond_ze_result_); \
    }                                                                              \
  } while (0)

#endif  // MUOND_SERVER_DEVICE_LEVEL_ZERO_ZE_STATUS_H_
