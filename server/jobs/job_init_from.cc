// Apply mode: a job's initial weights from its init_from safetensors file (DESIGN.md 4b), read by
// the daemon on behalf of the job's creator. The daemon may be able to read files its client
// cannot, so the file must be one the creator could read itself: a regular file owned by the
// creator's uid or readable by everyone, in directories the creator owns or everyone may enter.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "server/jobs/creator_file_error.h"
#include "server/jobs/job.h"

namespace muond::server {
namespace {

// Bytes of a safetensors header an init_from file may carry besides the tensors' data.
constexpr uint64_t kMaxHeaderBytes = uint64_t{64} << 20;

// Whether `uid` (-1: a TCP peer, no local uid) may be assumed to read what `st` describes.
bool Readable(const struct stat& st, int64_t uid, mode_t other_bit) {
  if (uid >= 0 && static_cast<int64_t>(st.st_uid) == uid) return true;
  return (st.st_mode & other_bit) != 0;
}

// The directories above `path` must be enterable by `uid`.
absl::Status CheckParents(const std::string& where, const std::string& path, int64_t uid) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos;
       slash = path.find('/', slash + 1)) {
    const std::string dir = path.substr(0, slash);
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0) return CreatorFileError(where, "stat");
    if (!Readable(st, uid, S_IXOTH)) {
      return absl::PermissionDeniedError(
          absl::StrCat(where, ": directory ", dir,
                       " is neither owned by the job's creator nor open to "
                       "everyone; the daemon reads init_from only where its creator could"));
    }
  }
  return absl::OkStatus();
}

// The file's bytes, after the ownership checks, with at most `limit` bytes.
absl::StatusOr<std::string> ReadInitFile(const std::string& where, const std::string& path,
                                         int64_t uid, uint64_t limit) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not an absolute path"));
  }
  RETURN_IF_ERROR(CheckParents(where, path, uid));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return CreatorFileError(where, "open");
  struct stat st;
  std::string bytes;
  absl::Status s;
  if (::fstat(fd, &st) != 0) {
    s = CreatorFileError(where, "fstat");
  } else if (!S_ISREG(st.st_mode)) {
    s = absl::InvalidArgumentError(absl::StrCat(where, ": not a regular file"));
  } else if (!Readable(st, uid, S_IROTH)) {
    s = absl::PermissionDeniedError(absl::StrCat(
        where, ": the file is neither owned by the job's creator nor readable by everyone"));
  } else if (static_cast<uint64_t>(st.st_size) > limit) {
    s = absl::InvalidArgumentError(absl::StrCat(where, ": ", st.st_size,
                                                " bytes is more than the job's tensors need (",
                                                limit, " bytes at most)"));
  } else {
    bytes.resize(static_cast<size_t>(st.st_size));
    size_t at = 0;
    while (at < bytes.size()) {
      const ssize_t n = ::read(fd, bytes.data() + at, bytes.size() - at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        s = n < 0 ? CreatorFileError(where, "read")
                  : absl::InvalidArgumentError(absl::StrCat(where, ": shorter than its size"));
        break;
      }
      at += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  if (!s.ok()) return s;
  return bytes;
}

}  // namespace

absl::Status Job::InitFromFile(int64_t peer_uid) {
  const std::string where = absl::StrCat("job '", id(), "': init_from '", spec_.init_from, "'");
  if (!apply() || spec_.init_from.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": the job reads no init_from file"));
  }
  uint64_t limit = kMaxHeaderBytes;
  for (const common::MatrixSpec& ms : spec_.matrices) limit += ms.numel() * sizeof(float);
  ASSIGN_OR_RETURN(std::string bytes, ReadInitFile(where, spec_.init_from, peer_uid, limit));
  auto file = common::SafetensorsFile::Parse(std::move(bytes));
  if (!file.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", file.status().message()));
  }
  // Every tensor checked before the masters change.
  std::vector<const common::TensorInfo*> found;
  for (const common::MatrixSpec& ms : spec_.matrices) {
    const common::TensorInfo* t = file->Find(ms.name);
    if (t == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has no tensor '", ms.name, "'"));
    }
    if (t->shape != ms.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tensor '", ms.name, "' has another shape than the job's"));
    }
    const int64_t bad = common::FindNonFiniteRaw(t->dtype, file->Data(*t).data(), ms.numel());
    if (bad >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tensor '", ms.name, "' element ", bad, " is not finite"));
    }
    found.push_back(t);
  }
  ParamStore::Lock store(*params_);
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckNoStepInFlight("read init_from"));
  for (uint32_t t = 0; t < spec_.matrices.size(); ++t) {
    common::ToFloat32(found[t]->dtype, file->Data(*found[t]).data(),
                      static_cast<size_t>(spec_.matrices[t].numel()),
                      store.mutable_front(t, ParamStore::kMaster));
  }
  weights_in_.assign(spec_.world_size, true);
  MUOND_LOG(INFO) << where << ": initial weights of " << spec_.matrices.size() << " tensors read";
  return absl::OkStatus();
}

}  // namespace muond::server
