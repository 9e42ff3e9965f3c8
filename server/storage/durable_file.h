// Durable file operations for the daemon's state directory (job records, checkpoints): each call
// returns a Status naming the call and the path (disk full and quota: RESOURCE_EXHAUSTED;
// permissions and read-only filesystems: PERMISSION_DENIED; other errors: INTERNAL), and the write
// path passes through test hooks that inject a failure, a SIGKILL or a delay at a chosen call.
// Thread-safe (the hooks are process-wide).
#ifndef MUOND_SERVER_STORAGE_DURABLE_FILE_H_
#define MUOND_SERVER_STORAGE_DURABLE_FILE_H_

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace muond::server::durable {

// The Status of a failed `call` on `path` with errno `err`.
absl::Status ErrnoStatus(int err, const char* call, const std::string& path);

// An owned file descriptor, closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(-1); }
  int get() const { return fd_; }
  void reset(int fd);

 private:
  int fd_ = -1;
};

// Everything under the state directory is the daemon user's alone: directories 0700, files 0600
// (reaching the socket, through its group, never grants reading a job's state).
inline constexpr mode_t kPrivateDirMode = 0700;
inline constexpr mode_t kPrivateFileMode = 0600;

// mkdir of one directory (an existing one is fine).
absl::Status Mkdir(const std::string& path, mode_t mode = kPrivateDirMode);
// mkdir -p: creates the missing directories of `path` with `mode`; FAILED_PRECONDITION when
// `path` exists and is not a directory.
absl::Status MakeDirs(const std::string& path, mode_t mode = kPrivateDirMode);
// Creates `path` (which must not exist, mode 0600) for writing.
absl::Status OpenForWrite(const std::string& path, Fd* fd);
absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path);
enum class IoPoint;
// fsync of a file (kFsyncFile) or a directory (kFsyncDir) for the test hooks.
absl::Status Fsync(int fd, IoPoint point, const std::string& path);
absl::Status FsyncDir(const std::string& path);
absl::Status Rename(const std::string& from, const std::string& to);
// Removes a file or a directory tree; a missing one is fine.
absl::Status RemoveTree(const std::string& path);
// Writes `data` to `path` durably: a temporary file, fsync, rename, directory fsync.
absl::Status WriteFileDurably(const std::string& path, const std::string& data);

// Takes every group and other permission bit off `root` (followed when it is a symbolic link)
// and off every directory and regular file under it, top down (symbolic links and special files
// there are neither followed nor changed; directories are walked through descriptors opened with
// O_NOFOLLOW). `on_repaired` is told each path changed, with its mode before and after. An error
// names the path and call (a file of another user: PERMISSION_DENIED); what was repaired before
// it stays repaired.
absl::Status RestrictToOwner(
    const std::string& root,
    const std::function<void(const std::string& path, mode_t before, mode_t after)>& on_repaired);

// Test hooks: the `nth` (1-based) call at `point` fails with errno `error`, or, with `kill`, the
// process sends itself SIGKILL there; with `delay_ms`, every call at `point` sleeps that long
// instead (a slow disk). One fault is armed at a time; a failure or kill fires once.
enum class IoPoint { kMkdir, kOpen, kWrite, kFsyncFile, kFsyncDir, kRename };
struct Fault {
  IoPoint point = IoPoint::kWrite;
  int nth = 1;
  int error = 5;  // EIO
  bool kill = false;
  int delay_ms = 0;
};
void SetFaultForTesting(std::optional<Fault> fault);
const char* IoPointName(IoPoint point);

}  // namespace muond::server::durable

#endif  // MUOND_SERVER_STORAGE_DURABLE_FILE_H_
