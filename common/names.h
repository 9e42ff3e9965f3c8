// Client strings that become paths, labels or log text: one validator per kind, and one way to
// quote any client string in a message.
//
// Job ids become directory names under the state directory and metric label values, so they are
// confined to [A-Za-z0-9][A-Za-z0-9._-]{0,127}: never empty, never starting with a dot (".", "..",
// hidden and ".deleted-*" names cannot be formed), never containing '/'. Tensor names end up in
// safetensors headers, job.json and messages: 1..kMaxTensorNameBytes bytes of UTF-8 with no control
// characters. Thread-safe (pure functions).
#ifndef MUOND_COMMON_NAMES_H_
#define MUOND_COMMON_NAMES_H_

#include <cstddef>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"

namespace muond::common {

inline constexpr size_t kMaxJobIdBytes = 128;
inline constexpr size_t kMaxTensorNameBytes = 256;
// Longest piece of a client string repeated in a message (longer ones are cut, with the length).
inline constexpr size_t kMaxQuotedBytes = 64;

// OK, or INVALID_ARGUMENT naming `field` and what is wrong (the value itself quoted, cut).
absl::Status ValidateJobId(absl::string_view id, absl::string_view field = "job_id");
absl::Status ValidateTensorName(absl::string_view name, absl::string_view field);

// 'value' for a message: non-printable bytes as \xNN, cut to kMaxQuotedBytes with
// "... (N bytes)" after it. Safe for any bytes.
std::string Quoted(absl::string_view value);

}  // namespace muond::common

#endif  // MUOND_COMMON_NAMES_H_
