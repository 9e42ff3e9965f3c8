#include "server/jobs/creator_path.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/jobs/creator_file_error.h"

namespace muond::server {
namespace {

// Whether `uid` (-1: no local uid) may be assumed to have `other_bits` on `st`: its owner may
// (it could chmod it), others when every one of the bits is open to everyone. Group bits are not
// trusted: the daemon cannot tell the creator's groups of a TCP peer, and a group the daemon is
// in is not one the creator is.
bool Allowed(const struct stat& st, int64_t uid, mode_t other_bits) {
  if (uid >= 0 && static_cast<int64_t>(st.st_uid) == uid) return true;
  return (st.st_mode & other_bits) == other_bits;
}

std::atomic<bool> have_openat2{true};

// Opens the single component `name` under `dirfd` without following a symbolic link.
int OpenComponent(int dirfd, const std::string& name, int flags) {
  if (have_openat2.load(std::memory_order_relaxed)) {
    struct open_how how = {};
    how.flags = static_cast<uint64_t>(flags);
    how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH;
    const long fd = ::syscall(SYS_openat2, dirfd, name.c_str(), &how, sizeof(how));
    if (fd >= 0 || (errno != ENOSYS && errno != EPERM)) return static_cast<int>(fd);
    // ENOSYS: a kernel before 5.6; EPERM: a seccomp filter that does not know the call.
    if (errno == ENOSYS) have_openat2.store(false, std::memory_order_relaxed);
  }
  return ::openat(dirfd, name.c_str(), flags | O_NOFOLLOW);
}

// The status of a failed OpenComponent of `prefix` (the path up to the component; `last`: the
// whole path, which `where` names already): a symbolic link is named as such.
absl::Status OpenError(const std::string& where, int dirfd, const std::string& name,
                       const std::string& prefix, bool last) {
  const int err = errno;
  struct stat st;
  if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
    return absl::PermissionDeniedError(absl::StrCat(
        where, ": ", prefix,
        " is a symbolic link; the daemon follows none in a path it reads for a job's creator"));
  }
  errno = err;
  return CreatorFileError(last ? where : absl::StrCat(where, ": ", prefix), "open");
}

}  // namespace

absl::StatusOr<CreatorPath> OpenForCreator(const std::string& where, const std::string& path,
                                           int64_t uid, CreatorPathKind kind) {
  if (path.empty() || path[0] != '/' || path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not an absolute path"));
  }
  std::vector<std::string> names;
  for (absl::string_view c : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    if (c == ".") continue;
    if (c == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": a '..' component; name the path the daemon should read without one"));
    }
    names.emplace_back(c);
  }
  if (names.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": names the root directory"));
  }
  CreatorPath out;
  auto dir = std::make_unique<durable::Fd>(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (dir->get() < 0) return CreatorFileError(absl::StrCat(where, ": /"), "open");
  std::string prefix;  // the path opened so far
  for (size_t i = 0; i < names.size(); ++i) {
    // The directory the next component is looked up in: its descriptor, checked here.
    if (::fstat(dir->get(), &out.st) != 0) {
      return CreatorFileError(absl::StrCat(where, ": ", prefix.empty() ? "/" : prefix), "fstat");
    }
    if (!Allowed(out.st, uid, S_IXOTH)) {
      return absl::PermissionDeniedError(absl::StrCat(
          where, ": directory ", prefix.empty() ? "/" : prefix,
          " is neither owned by the job's creator nor open to everyone; the daemon reads a path "
          "for a job's creator only where the creator could"));
    }
    const bool last = i + 1 == names.size();
    prefix += "/" + names[i];
    int flags = O_CLOEXEC;
    if (!last) {
      flags |= O_PATH | O_DIRECTORY;
    } else if (kind == CreatorPathKind::kDirectory) {
      flags |= O_RDONLY | O_DIRECTORY;
    } else {
      // O_NONBLOCK: a FIFO must not block the open; nothing but a regular file is read anyway.
      flags |= O_RDONLY | O_NONBLOCK | O_NOCTTY;
    }
    auto next = std::make_unique<durable::Fd>(OpenComponent(dir->get(), names[i], flags));
    if (next->get() < 0) return OpenError(where, dir->get(), names[i], prefix, last);
    if (::fstat(next->get(), &out.st) != 0) {
      return CreatorFileError(absl::StrCat(where, ": ", prefix), "fstat");
    }
    if (S_ISLNK(out.st.st_mode)) {  // not expected with the flags above; refused all the same
      return absl::PermissionDeniedError(absl::StrCat(
          where, ": ", prefix,
          " is a symbolic link; the daemon follows none in a path it reads for a job's creator"));
    }
    dir = std::move(next);
  }
  if (kind == CreatorPathKind::kFile) {
    if (!S_ISREG(out.st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": not a regular file"));
    }
    if (!Allowed(out.st, uid, S_IROTH)) {
      return absl::PermissionDeniedError(absl::StrCat(
          where, ": the file is neither owned by the job's creator nor readable by everyone"));
    }
  } else {
    if (!S_ISDIR(out.st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": not a directory"));
    }
    if (!Allowed(out.st, uid, S_IROTH | S_IXOTH)) {
      return absl::PermissionDeniedError(absl::StrCat(
          where, ": directory ", path,
          " is neither owned by the job's creator nor open to everyone; the daemon reads an "
          "export only where its creator could"));
    }
  }
  out.fd = std::move(dir);
  return out;
}

}  // namespace muond::server
