#include "server/storage/durable_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace muond::server::durable {
namespace {

// ---- Fault injection (tests) ----

std::mutex fault_mu;
std::optional<Fault> armed_fault;
int fault_calls = 0;

// 0, or the errno the call at `point` must fail with.
int InjectedError(IoPoint point) {
  std::unique_lock<std::mutex> lock(fault_mu);
  if (!armed_fault || armed_fault->point != point) return 0;
  if (armed_fault->delay_ms > 0) {
    const int ms = armed_fault->delay_ms;
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return 0;
  }
  if (++fault_calls != armed_fault->nth) return 0;
  const Fault f = *armed_fault;
  armed_fault.reset();
  if (f.kill) ::kill(::getpid(), SIGKILL);
  return f.error;
}

}  // namespace

absl::Status ErrnoStatus(int err, const char* call, const std::string& path) {
  const std::string what = absl::StrCat(call, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return absl::ResourceExhaustedError(what);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(what);
    default:
      return absl::InternalError(what);
  }
}

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::Status Mkdir(const std::string& path, mode_t mode) {
  if (int e = InjectedError(IoPoint::kMkdir)) return ErrnoStatus(e, "mkdir", path);
  if (::mkdir(path.c_str(), mode) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, "mkdir", path);
  }
  return absl::OkStatus();
}

absl::Status MakeDirs(const std::string& path, mode_t mode) {
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at == path.size() || path[at] == '/') {
      const std::string prefix = path.substr(0, at);
      struct stat st;
      if (::stat(prefix.c_str(), &st) == 0) continue;
      RETURN_IF_ERROR(Mkdir(prefix, mode));
    }
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a directory"));
  }
  return absl::OkStatus();
}

absl::Status OpenForWrite(const std::string& path, Fd* fd) {
  if (int e = InjectedError(IoPoint::kOpen)) return ErrnoStatus(e, "open", path);
  const int f = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, kPrivateFileMode);
  if (f < 0) return ErrnoStatus(errno, "open", path);
  fd->reset(f);
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (int e = InjectedError(IoPoint::kWrite)) return ErrnoStatus(e, "write", path);
    const size_t chunk = std::min<size_t>(n, size_t{64} << 20);
    const ssize_t w = ::write(fd, p, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "write", path);
    }
    if (w == 0) return ErrnoStatus(EIO, "write", path);
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status Fsync(int fd, IoPoint point, const std::string& path) {
  if (int e = InjectedError(point)) return ErrnoStatus(e, "fsync", path);
  if (::fsync(fd) != 0) return ErrnoStatus(errno, "fsync", path);
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& path) {
  const int f = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (f < 0) return ErrnoStatus(errno, "open", path);
  Fd fd(f);
  return Fsync(fd.get(), IoPoint::kFsyncDir, path);
}

absl::Status Rename(const std::string& from, const std::string& to) {
  if (int e = InjectedError(IoPoint::kRename)) {
    return ErrnoStatus(e, "rename", absl::StrCat(from, " -> ", to));
  }
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return ErrnoStatus(errno, "rename", absl::StrCat(from, " -> ", to));
  }
  return absl::OkStatus();
}

const char* IoPointName(IoPoint point) {
  switch (point) {
    case IoPoint::kMkdir:
      return "mkdir";
    case IoPoint::kOpen:
      return "open";
    case IoPoint::kWrite:
      return "write";
    case IoPoint::kFsyncFile:
      return "fsync (file)";
    case IoPoint::kFsyncDir:
      return "fsync (directory)";
    case IoPoint::kRename:
      return "rename";
  }
  return "?";
}

void SetFaultForTesting(std::optional<Fault> fault) {
  std::lock_guard<std::mutex> lock(fault_mu);
  armed_fault = fault;
  fault_calls = 0;
}

namespace {

// The entries of `d` but "." and ".."; closes it.
std::vector<std::string> TakeNames(DIR* d) {
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

}  // namespace

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, "lstat", path);
  }
  if (S_ISDIR(st.st_mode)) {
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) return ErrnoStatus(errno, "opendir", path);
    const std::vector<std::string> names = TakeNames(d);
    for (const std::string& name : names) {
      RETURN_IF_ERROR(RemoveTree(absl::StrCat(path, "/", name)));
    }
    if (::rmdir(path.c_str()) != 0) return ErrnoStatus(errno, "rmdir", path);
    return absl::OkStatus();
  }
  if (::unlink(path.c_str()) != 0) return ErrnoStatus(errno, "unlink", path);
  return absl::OkStatus();
}

absl::Status WriteFileDurably(const std::string& path, const std::string& data) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  const std::string tmp = absl::StrCat(path, ".tmp");
  ::unlink(tmp.c_str());
  Fd fd;
  RETURN_IF_ERROR(OpenForWrite(tmp, &fd));
  absl::Status s = WriteAll(fd.get(), data.data(), data.size(), tmp);
  if (s.ok()) s = Fsync(fd.get(), IoPoint::kFsyncFile, tmp);
  if (s.ok()) s = Rename(tmp, path);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return FsyncDir(dir);
}

namespace {

// Directories nested deeper than this under the state directory are left as they are (the
// daemon makes four levels: jobs/<id>/checkpoints/<generation>).
constexpr int kMaxRestrictDepth = 32;

using RepairFn = std::function<void(const std::string&, mode_t, mode_t)>;

// Takes the group and other bits off the entries of the open directory `fd` (at `path`), and
// off everything under its subdirectories. An entry is changed by name (fchmodat) after lstat
// showed it is a directory or a regular file: no file is opened (a FIFO would block, a file of
// mode 0 could not be), and a symbolic link is neither changed nor followed. Only the daemon's
// user can swap an entry meanwhile: its directory lost its group and other bits first.
absl::Status RestrictEntries(int fd, const std::string& path, int depth,
                             const RepairFn& on_repaired) {
  DIR* d = ::fdopendir(::dup(fd));
  if (d == nullptr) return ErrnoStatus(errno, "opendir", path);
  const std::vector<std::string> names = TakeNames(d);
  for (const std::string& name : names) {
    const std::string child = absl::StrCat(path, "/", name);
    struct stat st;
    if (::fstatat(fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) continue;  // removed meanwhile
      return ErrnoStatus(errno, "lstat", child);
    }
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) continue;
    const mode_t before = st.st_mode & 07777;
    if ((before & 077) != 0) {
      const mode_t after = before & ~static_cast<mode_t>(077);
      if (::fchmodat(fd, name.c_str(), after, 0) != 0) {
        if (errno == ENOENT) continue;
        return ErrnoStatus(errno, "chmod", child);
      }
      on_repaired(child, before, after);
    }
    if (!S_ISDIR(st.st_mode) || depth + 1 >= kMaxRestrictDepth) continue;
    Fd sub(::openat(fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (sub.get() < 0) {
      // A directory its owner cannot list (mode 0300, say): no one else reaches what is in it.
      if (errno == ENOENT || errno == EACCES) continue;
      return ErrnoStatus(errno, "open", child);
    }
    RETURN_IF_ERROR(RestrictEntries(sub.get(), child, depth + 1, on_repaired));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RestrictToOwner(const std::string& root, const RepairFn& on_repaired) {
  Fd fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoStatus(errno, "open", root);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat", root);
  const mode_t before = st.st_mode & 07777;
  if ((before & 077) != 0) {
    const mode_t after = before & ~static_cast<mode_t>(077);
    if (::fchmod(fd.get(), after) != 0) return ErrnoStatus(errno, "chmod", root);
    on_repaired(root, before, after);
  }
  return RestrictEntries(fd.get(), root, 0, on_repaired);
}

}  // namespace muond::server::durable
