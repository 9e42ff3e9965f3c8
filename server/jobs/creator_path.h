// Paths a job's creator names (init_from, import_dir), opened by the daemon on the creator's
// behalf. The daemon may be able to read what its client cannot, so a path is resolved one
// component at a time from "/", each directory opened relative to the descriptor of the one
// before it and checked on that descriptor (fstat): no symbolic link is followed in any component,
// nothing is looked up twice, and a link or directory swapped in after a check changes nothing.
// A directory must be owned by the creator's uid or enterable by everyone; the object opened
// owned by the creator or readable (a directory: listable) by everyone. Thread-safe.
#ifndef MUOND_SERVER_JOBS_CREATOR_PATH_H_
#define MUOND_SERVER_JOBS_CREATOR_PATH_H_

#include <sys/stat.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/storage/durable_file.h"

namespace muond::server {

enum class CreatorPathKind { kFile, kDirectory };

struct CreatorPath {
  std::unique_ptr<durable::Fd> fd;  // O_RDONLY (a file: O_NONBLOCK too), close-on-exec
  struct stat st;                   // of fd
};

// Opens the absolute `path` for the creator `uid` (-1: a TCP peer, no local uid: only what
// everyone may read). `where` starts every message. INVALID_ARGUMENT: not absolute, a ".."
// component, not a regular file (kFile) or directory (kDirectory); PERMISSION_DENIED, naming the
// component: a symbolic link, or something the creator could not reach or read; NOT_FOUND:
// missing. Uses openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH) per component where the kernel has
// it, openat(O_NOFOLLOW) otherwise.
absl::StatusOr<CreatorPath> OpenForCreator(const std::string& where, const std::string& path,
                                           int64_t uid, CreatorPathKind kind);

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_CREATOR_PATH_H_
