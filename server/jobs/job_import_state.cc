// A new job's state from a full-state export directory (re-sharding across nodes, DESIGN.md 4c;
// files: common/state_export.h; the export side: job_export_state.cc).
//
// The daemon reads the directory on behalf of the job's creator, so, as for init_from, only what
// the creator could read: the directory and every file in it owned by the creator's uid or open
// to everyone, no symbolic link followed in any component, each checked on the descriptor opened
// (creator_path.h). Every check runs before the job's state changes: the manifests (format,
// checksum, one step and the job's mode in all of them, no rows of a tensor in two files), each
// tensor the job needs (present, shape, every row of it), each payload's size and header against
// its manifest, each array's CRC32C and finiteness. Rows of a tensor split across nodes (the
// ownership plan) are taken from whichever arrays hold them: an export of N nodes imports into M.
// Arrays stored compressed (bfloat16, int8: exported by a job that holds them so) are decoded to
// float32 here, and the job encodes them as it holds its own state (InstallLoaded): an export of
// an int8 job imports into an fp32 one and the reverse. Memory: one copy of the job's state while
// it is read (as a checkpoint load), allocated from the job's own shapes after the manifests
// matched, plus one 16 MiB read buffer for a float32 array of which only some rows are taken (its
// CRC32C still covers all of it); a compressed array is read whole (its stored bytes) and, when
// only some of its rows are taken, decoded whole into a temporary.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
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
#include "server/jobs/job_impl.h"
#include "server/optim/state_codec.h"
#include "server/record/status_progress.h"

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

// An array's rows within its trainer tensor: [begin, end) of `of` (a whole array: all of them;
// a 0-d array has one row).
struct RowRange {
  int64_t begin = 0, end = 0, of = 0;
};

RowRange RowsOf(const std::vector<int64_t>& shape, int64_t row_offset, int64_t full_rows) {
  const int64_t rows = common::TensorRows(shape);
  if (full_rows > 0) return {row_offset, row_offset + rows, full_rows};
  return {0, rows, rows};
}

std::vector<int64_t> RowShape(const std::vector<int64_t>& shape) {
  return shape.empty() ? shape : std::vector<int64_t>(shape.begin() + 1, shape.end());
}

using ArrayRef = std::pair<size_t, size_t>;  // (file, array)

// Where each state array is: by name, the arrays holding it (one, or rows of a tensor split
// across nodes, by first row). Refuses files of another step or mode than the first's and rows
// of a name found in two files.
absl::StatusOr<std::map<std::string, std::vector<ArrayRef>>> IndexArrays(
    const std::string& where, const std::vector<ExportFile>& files, common::JobMode mode) {
  std::map<std::string, std::vector<ArrayRef>> index;
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
    for (size_t a = 0; a < m.arrays.size(); ++a) index[m.arrays[a].name].push_back({f, a});
  }
  const auto array = [&](const ArrayRef& r) -> const se::Array& {
    return files[r.first].manifest.arrays[r.second];
  };
  const auto rows = [&](const ArrayRef& r) {
    return RowsOf(array(r).shape, array(r).row_offset, array(r).full_rows);
  };
  for (auto& [name, refs] : index) {
    std::stable_sort(refs.begin(), refs.end(), [&](const ArrayRef& x, const ArrayRef& y) {
      return rows(x).begin < rows(y).begin;
    });
    for (size_t k = 1; k < refs.size(); ++k) {
      const RowRange a = rows(refs[k - 1]), b = rows(refs[k]);
      if (a.end > b.begin || a.of != b.of || array(refs[k - 1]).full_rows == 0 ||
          array(refs[k]).full_rows == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": tensor '", name, "' is in both ", files[refs[k - 1].first].manifest_path,
            " and ", files[refs[k].first].manifest_path, " (rows [", a.begin, ", ", a.end, ") of ",
            a.of, " and [", b.begin, ", ", b.end, ") of ", b.of, ")"));
      }
    }
  }
  return index;
}

// What a job array takes from one export array: rows [begin, end) of the trainer's tensor.
struct Source {
  ArrayRef ref;
  int64_t begin = 0, end = 0;
};

// The export arrays that hold `want` (job tensor `t`'s state array), each with the rows taken
// from it: every row of the job's range covered, each by one array of the same row shape and
// tensor rows. INVALID_ARGUMENT naming what is missing or different.
absl::StatusOr<std::vector<Source>> FindSources(
    const std::string& where, const std::string& job_id, const std::vector<ExportFile>& files,
    const std::map<std::string, std::vector<ArrayRef>>& index,
    const checkpoint::StateTensor& want, const common::MatrixSpec& t) {
  const auto it = index.find(want.name);
  if (it == index.end()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no file there holds tensor '",
                                                   want.name, "' of the job (", files.size(),
                                                   " manifests, ", index.size(), " tensors)"));
  }
  const RowRange need = RowsOf(want.shape, t.row_offset, t.full_rows);
  std::vector<Source> sources;
  int64_t next = need.begin;
  for (const ArrayRef& ref : it->second) {
    const se::Array& a = files[ref.first].manifest.arrays[ref.second];
    const RowRange has = RowsOf(a.shape, a.row_offset, a.full_rows);
    if (has.of != need.of || RowShape(a.shape) != RowShape(want.shape)) {
      std::vector<int64_t> whole = RowShape(want.shape), theirs = RowShape(a.shape);
      whole.insert(whole.begin(), need.of);
      theirs.insert(theirs.begin(), has.of);
      return absl::InvalidArgumentError(
          absl::StrCat(files[ref.first].manifest_path, ": tensor '", want.name, "' has shape [",
                       absl::StrJoin(theirs, ", "), "], job '", job_id, "' has [",
                       absl::StrJoin(whole, ", "), "]",
                       t.full_rows > 0 || a.full_rows > 0 ? " (whole tensors)" : ""));
    }
    if (has.end <= next || has.begin >= need.end) continue;
    if (has.begin > next) break;  // a gap: reported below
    sources.push_back({ref, next, std::min(has.end, need.end)});
    next = sources.back().end;
    if (next == need.end) break;
  }
  if (next != need.end) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": no file there holds rows [", next, ", ", need.end, ") of tensor '", want.name,
        "' (", need.of, " rows; the job holds [", need.begin, ", ", need.end, "))"));
  }
  return sources;
}

struct Payload {
  std::unique_ptr<Fd> fd;
  uint64_t header_bytes = 0;
};

// Opens file f's payload once, checking its size and header against its manifest.
absl::StatusOr<const Payload*> OpenPayload(const std::string& dir, int dirfd, int64_t uid,
                                           const ExportFile& file, size_t f,
                                           std::map<size_t, Payload>* open) {
  auto it = open->find(f);
  if (it != open->end()) return &it->second;
  const se::Manifest& m = file.manifest;
  const std::string path = absl::StrCat(dir, "/", m.payload);
  Payload p;
  uint64_t size = 0;
  ASSIGN_OR_RETURN(p.fd, OpenFile(dirfd, path, m.payload, uid, &size));
  if (size != m.payload_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", size, " bytes, its manifest ",
                                            file.manifest_path, " says ", m.payload_bytes));
  }
  const std::string want = se::PayloadHeader(m);
  std::string got(want.size(), '\0');
  RETURN_IF_ERROR(ReadAt(p.fd->get(), path, got.data(), got.size(), 0));
  if (got != want) {
    return absl::DataLossError(absl::StrCat(path, ": its header does not match its manifest ",
                                            file.manifest_path,
                                            " (damaged, or not of that export)"));
  }
  p.header_bytes = want.size();
  return &open->emplace(f, std::move(p)).first->second;
}

// The bytes read at once from an array of which only some rows are taken.
constexpr uint64_t kPieceReadBytes = uint64_t{16} << 20;

// DATA_LOSS naming the element of `data` (element `at` of the array) that is not finite.
absl::Status CheckFinite(const std::string& path, const se::Array& a, const float* data,
                         uint64_t count, uint64_t at) {
  const int64_t bad = common::FindNonFiniteRaw(
      common::DType::kFloat32, reinterpret_cast<const char*>(data), static_cast<int64_t>(count));
  if (bad >= 0) {
    return absl::DataLossError(absl::StrCat(path, ": tensor '", a.name, "' element ",
                                            at + static_cast<uint64_t>(bad), " is not finite"));
  }
  return absl::OkStatus();
}

// ReadSource of an array stored compressed (bfloat16 or int8): read whole, its CRC32C checked,
// the int8 block scales finite and not negative, decoded into float32 (in place when taken whole,
// else into a temporary whose rows are copied), the taken values finite.
absl::Status ReadHeldSource(const std::string& path, const Payload& p, const se::Array& a,
                            uint64_t take_from, uint64_t take_to, float* into) {
  const uint64_t bytes = se::ArrayBytes(a), n = a.numel();
  std::vector<float> held(StoredWords(a.dtype, n));
  RETURN_IF_ERROR(ReadAt(p.fd->get(), path, reinterpret_cast<char*>(held.data()), bytes,
                         p.header_bytes + a.begin));
  if (common::Crc32c(held.data(), bytes) != a.crc32c) {
    return absl::DataLossError(
        absl::StrCat(path, ": tensor '", a.name, "': CRC32C mismatch (damaged)"));
  }
  if (a.dtype == common::StateDType::kInt8) {
    for (uint64_t b = 0; b < common::StateBlocks(n); ++b) {
      if (!std::isfinite(held[b]) || held[b] < 0) {
        return absl::DataLossError(absl::StrCat(path, ": tensor '", a.name, "' block ", b,
                                                ": scale ", held[b],
                                                " (int8 scales are finite and not negative)"));
      }
    }
  }
  const bool whole = take_from == 0 && take_to == n;
  std::vector<float> decoded(whole ? 0 : n);
  float* out = whole ? into : decoded.data();
  DecodeStoredAll(a.dtype, a.non_negative ? StateRole::kNonNegative : StateRole::kSigned,
                  held.data(), n, out);
  RETURN_IF_ERROR(CheckFinite(path, a, out + take_from, take_to - take_from, take_from));
  if (!whole) std::copy(out + take_from, out + take_to, into);
  return absl::OkStatus();
}

// Reads one export array, checks its CRC32C and that its values are finite, and copies its rows
// [src.begin, src.end) to `dst` (the job array's first row is `first_row`), decoded to float32. A
// float32 array taken whole is read straight into place; otherwise in kPieceReadBytes reads.
absl::Status ReadSource(const std::string& path, const Payload& p, const se::Array& a,
                        const Source& src, int64_t first_row, float* dst) {
  const RowRange has = RowsOf(a.shape, a.row_offset, a.full_rows);
  const uint64_t row = a.numel() / static_cast<uint64_t>(has.end - has.begin);
  const uint64_t base = p.header_bytes + a.begin;
  float* into = dst + static_cast<uint64_t>(src.begin - first_row) * row;
  if (a.dtype != common::StateDType::kFloat32) {
    return ReadHeldSource(path, p, a, static_cast<uint64_t>(src.begin - has.begin) * row,
                          static_cast<uint64_t>(src.end - has.begin) * row, into);
  }
  const auto check = [&](const float* data, uint64_t count, uint64_t at) {
    return CheckFinite(path, a, data, count, at);
  };
  uint32_t crc = 0;
  if (src.begin == has.begin && src.end == has.end) {
    RETURN_IF_ERROR(ReadAt(p.fd->get(), path, reinterpret_cast<char*>(into), se::ArrayBytes(a),
                           base));
    crc = common::Crc32c(into, se::ArrayBytes(a));
    if (crc == a.crc32c) RETURN_IF_ERROR(check(into, a.numel(), 0));
  } else {
    const uint64_t take_from = static_cast<uint64_t>(src.begin - has.begin) * row;
    const uint64_t take_to = static_cast<uint64_t>(src.end - has.begin) * row;
    std::vector<float> chunk(std::min<uint64_t>(a.numel(), kPieceReadBytes / sizeof(float)));
    for (uint64_t at = 0; at < a.numel(); at += chunk.size()) {
      const uint64_t n = std::min<uint64_t>(chunk.size(), a.numel() - at);
      RETURN_IF_ERROR(ReadAt(p.fd->get(), path, reinterpret_cast<char*>(chunk.data()),
                             n * sizeof(float), base + at * sizeof(float)));
      crc = common::Crc32cExtend(crc, chunk.data(), n * sizeof(float));
      const uint64_t lo = std::max(at, take_from), hi = std::min(at + n, take_to);
      if (lo < hi) {
        RETURN_IF_ERROR(check(chunk.data() + (lo - at), hi - lo, lo));
        std::copy(chunk.data() + (lo - at), chunk.data() + (hi - at), into + (lo - take_from));
      }
    }
  }
  if (crc != a.crc32c) {
    return absl::DataLossError(
        absl::StrCat(path, ": tensor '", a.name, "': CRC32C mismatch (damaged)"));
  }
  return absl::OkStatus();
}

// Reads the job's arrays (per array: its sources) into loaded->data, after checking each
// payload's size and header against its manifest; then each array's CRC32C and values.
absl::Status ReadArrays(const std::string& dir, int dirfd, int64_t uid,
                        const std::vector<ExportFile>& files,
                        const std::vector<checkpoint::StateTensor>& wants,
                        const std::vector<int64_t>& first_rows,
                        const std::vector<std::vector<Source>>& sources,
                        checkpoint::Loaded* loaded, OperationProgress::Handle* progress) {
  std::map<size_t, Payload> open;  // per file used
  loaded->data.resize(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    uint64_t numel = 1;
    for (int64_t d : wants[i].shape) numel *= static_cast<uint64_t>(d);
    std::vector<float>& data = loaded->data[i];
    data.resize(numel);
    for (const Source& src : sources[i]) {
      const auto [f, a] = src.ref;
      const se::Manifest& m = files[f].manifest;
      ASSIGN_OR_RETURN(const Payload* p, OpenPayload(dir, dirfd, uid, files[f], f, &open));
      RETURN_IF_ERROR(ReadSource(absl::StrCat(dir, "/", m.payload), *p, m.arrays[a], src,
                                 first_rows[i], data.data()));
      progress->Advance(se::ArrayBytes(m.arrays[a]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status JobImpl::ImportState(const std::string& dir, int64_t peer_uid) {
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
  const std::vector<checkpoint::StateTensor> wants = checkpoint::StateTensors(spec_);
  std::vector<std::vector<Source>> sources;
  std::vector<int64_t> first_rows;
  for (const checkpoint::StateTensor& want : wants) {
    const common::MatrixSpec& t = spec_.matrices[want.tensor];
    ASSIGN_OR_RETURN(std::vector<Source> from, FindSources(where, id(), files, index, want, t));
    sources.push_back(std::move(from));
    first_rows.push_back(t.full_rows > 0 ? t.row_offset : 0);
    loaded.names.push_back(want.name);
  }
  if (apply()) {
    size_t at = 0;  // the tensor's master array (its first) says which files hold it
    for (const common::MatrixSpec& t : spec_.matrices) {
      while (wants[at].name != checkpoint::StateArrayName(t, 0)) ++at;
      std::optional<int64_t> steps;
      for (const Source& src : sources[at]) {
        const se::Manifest& m = files[src.ref.first].manifest;
        const int64_t s = m.tensor_steps.at(m.arrays[src.ref.second].tensor);
        if (steps.has_value() && *steps != s) {
          return absl::InvalidArgumentError(absl::StrCat(
              files[src.ref.first].manifest_path, ": tensor '", t.name, "' has taken ", s,
              " AdamW steps there and ", *steps, " in another file of the export"));
        }
        steps = s;
      }
      loaded.tensor_steps.push_back(*steps);
    }
  }
  // Shown like saves and loads (GetProgress, the status page): the bytes of the arrays read.
  uint64_t total = 0;
  for (const auto& from : sources) {
    for (const Source& src : from) {
      total += se::ArrayBytes(files[src.ref.first].manifest.arrays[src.ref.second]);
    }
  }
  const auto progress = OperationProgress::Default().Begin(id(), "import", id(), total);
  absl::Status read = ReadArrays(dir, dirfd.get(), peer_uid, files, wants, first_rows, sources,
                                 &loaded, progress.get());
  progress->End(read);
  RETURN_IF_ERROR(read);
  CheckpointWriter::Exclusive exclusive(writer_);
  RETURN_IF_ERROR(InstallLoaded(loaded, *this).status());
  MUOND_LOG(INFO) << where << ": state of " << spec_.matrices.size() << " tensors at step "
                  << loaded.info.step << " imported from " << files.size() << " export files";
  return absl::OkStatus();
}

}  // namespace muond::server
