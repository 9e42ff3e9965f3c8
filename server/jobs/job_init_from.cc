// Apply mode: a job's initial weights from its init_from safetensors file (DESIGN.md 4b), read by
// the daemon on behalf of the job's creator. The daemon may be able to read files its client
// cannot, so the file must be one the creator could read itself: a regular file owned by the
// creator's uid or readable by everyone, in directories the creator owns or everyone may enter,
// reached without following a symbolic link and checked on what was opened (creator_path.h).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "server/jobs/creator_file_error.h"
#include "server/jobs/creator_path.h"
#include "server/jobs/job_impl.h"
#include "server/record/status_progress.h"

namespace muond::server {
namespace {

// Bytes of a safetensors header an init_from file may carry besides the tensors' data.
constexpr uint64_t kMaxHeaderBytes = uint64_t{64} << 20;

// The file's bytes, after the ownership checks, with at most `limit` bytes.
absl::StatusOr<std::string> ReadInitFile(const std::string& where, const std::string& path,
                                         int64_t uid, uint64_t limit, const std::string& job_id) {
  ASSIGN_OR_RETURN(const CreatorPath file,
                   OpenForCreator(where, path, uid, CreatorPathKind::kFile));
  const uint64_t size = static_cast<uint64_t>(file.st.st_size);
  if (size > limit) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", size,
                                                   " bytes is more than the job's tensors need (",
                                                   limit, " bytes at most)"));
  }
  // Shown like saves and loads (GetProgress, the status page): the file's bytes read.
  const auto progress = OperationProgress::Default().Begin(job_id, "init_from", job_id, size);
  std::string bytes(static_cast<size_t>(size), '\0');
  size_t at = 0;
  constexpr size_t kRead = size_t{16} << 20;  // progress in steps of this
  while (at < bytes.size()) {
    const ssize_t n =
        ::read(file.fd->get(), bytes.data() + at, std::min(kRead, bytes.size() - at));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status s = CreatorFileError(where, "read");
      progress->End(s);
      return s;
    }
    if (n == 0) {
      absl::Status s = absl::InvalidArgumentError(absl::StrCat(where, ": shorter than its size"));
      progress->End(s);
      return s;
    }
    at += static_cast<size_t>(n);
    progress->Advance(static_cast<uint64_t>(n));
  }
  progress->End(absl::OkStatus());
  return bytes;
}

}  // namespace

absl::Status JobImpl::InitFromFile(int64_t peer_uid) {
  const std::string where = absl::StrCat("job '", id(), "': init_from '", spec_.init_from, "'");
  if (!apply() || spec_.init_from.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": the job reads no init_from file"));
  }
  uint64_t limit = kMaxHeaderBytes;
  for (const common::MatrixSpec& ms : spec_.matrices) limit += ms.numel() * sizeof(float);
  ASSIGN_OR_RETURN(std::string bytes,
                   ReadInitFile(where, spec_.init_from, peer_uid, limit, id()));
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
