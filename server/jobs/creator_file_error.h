// Files a job reads on its creator's behalf (init_from, import_dir): the status of a failed
// system call, naming where. Missing -> NOT_FOUND; not allowed -> PERMISSION_DENIED; anything
// else (a bad path, a special file) -> INVALID_ARGUMENT.
#ifndef MUOND_SERVER_JOBS_CREATOR_FILE_ERROR_H_
#define MUOND_SERVER_JOBS_CREATOR_FILE_ERROR_H_

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace muond::server {

// Reads errno: call it right after the failed call.
inline absl::Status CreatorFileError(const std::string& where, const char* call) {
  const int err = errno;
  const std::string msg = absl::StrCat(where, ": ", call, ": ", std::strerror(err));
  if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM || err == ELOOP) return absl::PermissionDeniedError(msg);
  return absl::InvalidArgumentError(msg);
}

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_CREATOR_FILE_ERROR_H_
