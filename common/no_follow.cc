#include "common/no_follow.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace muond::common {
namespace {

absl::Status Refused(const std::string& path, const std::string& component, int err) {
  const std::string msg = absl::StrCat(path, ": ", component.empty() ? "" : "'", component,
                                       component.empty() ? "" : "': ", std::strerror(err));
  if (err == ELOOP) {
    return absl::PermissionDeniedError(absl::StrCat(
        path, ": '", component,
        "' is a symbolic link; the files muonctl writes are not reached through links"));
  }
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == ENOTDIR) return absl::InvalidArgumentError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::UnavailableError(msg);
}

// The fallback: from / or the working directory, one component at a time.
absl::StatusOr<int> WalkNoFollow(const std::string& path) {
  int fd = ::open(path.size() > 0 && path[0] == '/' ? "/" : ".",
                  O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Refused(path, "", errno);
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    const std::string name(part);
    const int next = ::openat(fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int err = errno;
    if (next < 0 && (err == ENOTDIR || err == ELOOP)) {
      struct stat st {};
      err = ::fstatat(fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)
                ? ELOOP
                : ENOTDIR;
    }
    ::close(fd);
    if (next < 0) return Refused(path, name, err);
    fd = next;
  }
  return fd;
}

}  // namespace

absl::StatusOr<int> OpenDirectoryNoFollow(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("an empty directory path");
  open_how how{};
  how.flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
  how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  const long fd = ::syscall(SYS_openat2, AT_FDCWD, path.c_str(), &how, sizeof(how));
  if (fd >= 0) return static_cast<int>(fd);
  if (errno == ENOSYS || errno == EPERM) return WalkNoFollow(path);  // old kernel, seccomp
  if (errno == ELOOP) {
    // Name the link: walk the components (each is a directory or a link here).
    auto walked = WalkNoFollow(path);
    if (walked.ok()) ::close(*walked);  // replaced by a directory meanwhile
    return walked.ok() ? Refused(path, path, ELOOP) : walked.status();
  }
  return Refused(path, "", errno);
}

std::pair<std::string, std::string> SplitDirName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return {".", path};
  return {slash == 0 ? "/" : path.substr(0, slash), path.substr(slash + 1)};
}

}  // namespace muond::common
