// Reading PEM files (TLS certificates, keys, CA bundles) named by a flag or option. Thread-safe.
#ifndef MUOND_COMMON_PEM_H_
#define MUOND_COMMON_PEM_H_

#include <string>

#include "absl/status/statusor.h"

namespace muond::common {

// The file's text. INVALID_ARGUMENT "<what> <path>: cannot open: <errno text>" or
// "<what> <path>: not a PEM file" (no "-----BEGIN " line). `what` names where the path came from
// (e.g. "--tls-cert" or "TLS CA").
absl::StatusOr<std::string> ReadPemFile(const std::string& what, const std::string& path);

}  // namespace muond::common

#endif  // MUOND_COMMON_PEM_H_
