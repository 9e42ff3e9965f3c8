// Opening a directory a user named without following a symbolic link in any of its components,
// for the files muonctl writes (export destinations, step outputs): a link planted in a shared
// directory cannot redirect the write. openat2(RESOLVE_NO_SYMLINKS) where the kernel has it,
// else one component at a time with O_NOFOLLOW. Thread-safe.
#ifndef MUOND_COMMON_NO_FOLLOW_H_
#define MUOND_COMMON_NO_FOLLOW_H_

#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace muond::common {

// A descriptor (O_DIRECTORY, close-on-exec; the caller closes it) of directory `path` (absolute,
// or relative to the working directory). PERMISSION_DENIED naming the component for a symbolic
// link; NOT_FOUND; INVALID_ARGUMENT for a component that is not a directory; other errors
// UNAVAILABLE; each naming the path.
absl::StatusOr<int> OpenDirectoryNoFollow(const std::string& path);

// Splits `path` into its directory ("." when none, "/" for the root) and its last component.
std::pair<std::string, std::string> SplitDirName(const std::string& path);

}  // namespace muond::common

#endif  // MUOND_COMMON_NO_FOLLOW_H_
