// A new job's state from a full-state export directory (re-sharding across nodes, DESIGN.md 4c;
// files: common/state_export.h; the export side: job_export_state.cc).
//
// The daemon reads the directory on behalf of the job's creator, so, as for init_from, only what
// the creator could read: the directory and every file in it owned by the creator's uid or open
// to everyone, no symbolic link followed in any component, each checked on the descriptor opened
// (creator_path.h). Every check runs before the job's state changes: the manifests (format,
// checksum, one step and the job's mode in all of them, no tensor in two files), each tensor the
// job needs (present, shape), each payload's size and header against its manifest, each array's
// CRC32C and finiteness. Memory: one copy of the job's state while it is read (as a checkpoint
// load), allocated from the job's own shapes after the manifests matched.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/state_export.h"
#include "common/status_macros.h"
#include "server/jobs/creator_file_error.h"
#include "server/jobs/creator_path.h"
#include "server/jobs/job.h"
#include "server/ops/status_progress.h"

namespace muond::server {
namespace {

namespace se = common::state_export;

// Whether `uid` (-1: a TCP peer, no local uid) may be assumed to have `other_bits` on `st`.
bool Allowed(const struct stat& st, int64_t uid, mode_t other_bits) {
  if (uid >= 0 && static_cast<int64_t>(st.st_uid) == uid) return true;
  return (st.st_mode & other_bits) == other_bits;
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Opens `name` in the directory (no links followed): a regular file `uid` may read.
absl::StatusOr<std::unique_ptr<Fd>> OpenFile(int dirfd, const std::string& path,
                                             const std::string& name, int64_t uid, uint64_t* size) {
  auto fd = std::make_unique<Fd>(
      ::openat(dirfd, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (fd->get() < 0) return CreatorFileError(path, "open");
  struct stat st;
  if (::fstat(fd->get(), &st) != 0) return CreatorFileError(path, "fstat");
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(path + ": not a regular file");
  if (!Allowed(st, uid, S_IROTH)) {
    return absl::PermissionDeniedError(
        path + ": the file is neither owned by the job's creator nor readable by everyone");
  }
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

absl::Status ReadAt(int fd, const std::string& path, char* dst, uint64_t n, uint64_t offset) {
  uint64_t at = 0;
  while (at < n) {
    const ssize_t r = ::pread(fd, dst + at, n - at, static_cast<off_t>(offset + at));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return CreatorFileError(path, "pread");
    if (r == 0) return absl::DataLossError(absl::StrCat(path, ": shorter than its manifest says"));
    at += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

struct ExportFile {
  std::string manifest_path;
  se::Manifest manifest;
};

// The manifests of the directory, sorted by name, each parsed and checked.
absl::StatusOr<std::vector<ExportFile>> ReadManifests(const std::string& where,
                                                      const std::string& dir, int dirfd,
                                                      int64_t uid) {
  std::vector<std::string> names;
  DIR* d = ::fdopendir(::dup(dirfd));
  if (d == nullptr) return CreatorFileError(where, "opendir");
  while (const struct dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n[0] != '.' && absl::EndsWith(n, se::kManifestSuffix)) names.push_back(n);
    if (names.size() > se::kMaxManifests) break;
  }
  ::closedir(d);
  if (names.size() > se::kMaxManifests) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": more than ", se::kMaxManifests, " manifests"));
  }
  if (names.empty()) {
    return absl::NotFoundError(absl::StrCat(where, ": holds no *", se::kManifestSuffix,
                                            " (muonctl checkpoint export writes them)"));
  }
  std::sort(names.begin(), names.end());
  std::vector<ExportFile> files;
  uint64_t total = 0;  // bytes of every manifest read, at most kMaxManifestBytes together
  for (const std::string& n : names) {
    const std::string path = absl::StrCat(dir, "/", n);
    uint64_t size = 0;
    ASSIGN_OR_RETURN(std::unique_ptr<Fd> fd, OpenFile(dirfd, path, n, uid, &size));
    total += size;
    if (size > se::kMaxManifestBytes || total > se::kMaxManifestBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", size, " bytes (", total, " with the manifests before it); ",
                       where, " may hold ", se::kMaxManifestBytes, " bytes of manifests"));
    }
    std::string text(size, '\0');
    RETURN_IF_ERROR(ReadAt(fd->get(), path, text.data(), size, 0));
    ASSIGN_OR_RETURN(se::Manifest m, se::ParseManifest(text, path));
    files.push_back({path, std::move(m)});
  }
  return files;
}

// Where each state array is: (file, array) by name. Refuses files of another step or mode than
// the first's and a name found in two files.
absl::StatusOr<std::map<std::string, std::pair<size_t, size_t>>> IndexArrays(
    const std::string& where, const std::vector<ExportFile>& files, common::JobMode mode) {
  std::map<std::string, std::pair<size_t, size_t>> index;
  for (size_t f = 0; f < files.size(); ++f) {
    const se::Manifest& m = files[f].manifest;
    if (m.mode != mode) {
      return absl::InvalidArgumentError(
          absl::StrCat(files[f].manifest_path, ": exported by a job in mode '",
                       std::string(common::JobModeName(m.mode)), "'; the new job is in mode '",
                       std::string(common::JobModeName(mode)), "'"));
    }
    if (m.step != files[0].manifest.step) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the exports are of different steps: ", files[0].manifest_path,
                       " step ", files[0].manifest.step, ", ", files[f].manifest_path, " step ",
                       m.step, " (export every node at the same step)"));
    }
    for (size_t a = 0; a < m.arrays.size(); ++a) {
      auto [it, fresh] = index.try_emplace(m.arrays[a].name, f, a);
      if (!fresh) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": tensor '", m.arrays[a].name, "' is in both ",
                         files[it->second.first].manifest_path, " and ", files[f].manifest_path));
      }
    }
  }
  return index;
}

// Reads the arrays at `where_is` (per array of the job: file, array) into loaded->data, after
// checking each payload's size and header against its manifest; then each array's CRC32C and
// values.
absl::Status ReadArrays(const std::string& dir, int dirfd, int64_t uid,
                        const std::vector<ExportFile>& files,
                        const std::vector<std::pair<size_t, size_t>>& where_is,
                        checkpoint::Loaded* loaded, OperationProgress::Handle* progress) {
  struct Payload {
    std::unique_ptr<Fd> fd;
    uint64_t header_bytes = 0;
  };
  std::map<size_t, Payload> open;  // per file used
  loaded->data.resize(where_is.size());
  for (size_t i = 0; i < where_is.size(); ++i) {
    const auto [f, a] = where_is[i];
    const se::Manifest& m = files[f].manifest;
    const std::string path = absl::StrCat(dir, "/", m.payload);
    auto it = open.find(f);
    if (it == open.end()) {
      Payload p;
      uint64_t size = 0;
      ASSIGN_OR_RETURN(p.fd, OpenFile(dirfd, path, m.payload, uid, &size));
      if (size != m.payload_bytes) {
        return absl::DataLossError(absl::StrCat(path, ": ", size, " bytes, its manifest ",
                                                files[f].manifest_path, " says ", m.payload_bytes));
      }
      const std::string want = se::PayloadHeader(m);
      std::string got(want.size(), '\0');
      RETURN_IF_ERROR(ReadAt(p.fd->get(), path, got.data(), got.size(), 0));
      if (got != want) {
        return absl::DataLossError(absl::StrCat(path, ": its header does not match its manifest ",
                                                files[f].manifest_path,
                                                " (damaged, or not of that export)"));
      }
      p.header_bytes = want.size();
      it = open.emplace(f, std::move(p)).first;
    }
    const se::Array& arr = m.arrays[a];
    std::vector<float>& data = loaded->data[i];
    data.resize(arr.numel());
    RETURN_IF_ERROR(ReadAt(it->second.fd->get(), path, reinterpret_cast<char*>(data.data()),
                           se::ArrayBytes(arr), it->second.header_bytes + arr.begin));
    progress->Advance(se::ArrayBytes(arr));
    if (common::Crc32c(data.data(), se::ArrayBytes(arr)) != arr.crc32c) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor '", arr.name, "': CRC32C mismatch (damaged)"));
    }
    const int64_t bad = common::FindNonFiniteRaw(common::DType::kFloat32,
                                                 reinterpret_cast<const char*>(data.data()),
                                                 static_cast<int64_t>(arr.numel()));
    if (bad >= 0) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor '", arr.name, "' element ", bad, " is not finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Job::ImportState(const std::string& dir, int64_t peer_uid) {
  const std::string where = absl::StrCat("job '", id(), "': import_dir '", dir, "'");
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not an absolute path"));
  }
  if (spec_.transport_probe) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": a transport probe has no state"));
  }
  ASSIGN_OR_RETURN(const CreatorPath opened,
                   OpenForCreator(where, dir, peer_uid, CreatorPathKind::kDirectory));
  const durable::Fd& dirfd = *opened.fd;
  ASSIGN_OR_RETURN(const std::vector<ExportFile> files,
                   ReadManifests(where, dir, dirfd.get(), peer_uid));
  ASSIGN_OR_RETURN(const auto index, IndexArrays(where, files, spec_.mode));
  // What this job needs, found and shaped as the job's, before anything is read or allocated.
  checkpoint::Loaded loaded;
  loaded.spec = spec_;
  loaded.info.step = files[0].manifest.step;
  loaded.info.generation = 0;
  loaded.info.path = dir;
  std::vector<std::pair<size_t, size_t>> where_is;
  for (const checkpoint::StateTensor& want : checkpoint::StateTensors(spec_)) {
    auto it = index.find(want.name);
    if (it == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": no file there holds tensor '",
                                                     want.name, "' of the job (", files.size(),
                                                     " manifests, ", index.size(), " tensors)"));
    }
    const se::Array& a = files[it->second.first].manifest.arrays[it->second.second];
    if (a.shape != want.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(files[it->second.first].manifest_path, ": tensor '", want.name,
                       "' has shape [", absl::StrJoin(a.shape, ", "), "], job '", id(), "' has [",
                       absl::StrJoin(want.shape, ", "), "]"));
    }
    loaded.names.push_back(want.name);
    where_is.push_back(it->second);
  }
  if (apply()) {
    for (const common::MatrixSpec& t : spec_.matrices) {
      // The tensor's master array says which file holds it.
      const auto [f, a] = index.at(checkpoint::StateArrayName(t, 0));
      loaded.tensor_steps.push_back(
          files[f].manifest.tensor_steps.at(files[f].manifest.arrays[a].tensor));
    }
  }
  // Shown like saves and loads (GetProgress, the status page): the bytes of the arrays read.
  uint64_t total = 0;
  for (const auto& [f, a] : where_is) total += se::ArrayBytes(files[f].manifest.arrays[a]);
  const auto progress = OperationProgress::Default().Begin(id(), "import", id(), total);
  absl::Status read = ReadArrays(dir, dirfd.get(), peer_uid, files, where_is, &loaded,
                                 progress.get());
  progress->End(read);
  RETURN_IF_ERROR(read);
  CheckpointWriter::Exclusive exclusive(writer_);
  RETURN_IF_ERROR(InstallLoaded(loaded, *this).status());
  MUOND_LOG(INFO) << where << ": state of " << spec_.matrices.size() << " tensors at step "
                  << loaded.info.step << " imported from " << files.size() << " export files";
  return absl::OkStatus();
}

}  // namespace muond::server
