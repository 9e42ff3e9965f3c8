// The full-state export of a job (re-sharding across nodes, DESIGN.md 4c): Client::ExportState
// receives the daemon's ExportState stream, ExportStateToDir writes it, as it arrives, as a state
// export (common/state_export.h) into a directory several node jobs share;
// Client::CreateJobFromExport creates a job that takes its state from such a directory.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/daemon_call.h"
#include "common/crc32c.h"
#include "common/grpc_status.h"
#include "common/job_spec_proto.h"
#include "common/no_follow.h"
#include "common/state_export.h"
#include "common/status_macros.h"

namespace muond::client {
namespace {

namespace se = common::state_export;
using common::FromGrpcStatus;

// The dtype array `a` of the stream holds ("" is float32).
absl::StatusOr<common::StateDType> ArrayDType(const v1::StateArray& a) {
  return a.dtype().empty() ? common::StateDType::kFloat32 : common::ParseStateDType(a.dtype());
}

// Checks the header of the stream against its spec before anything is allocated: every array
// belongs to a job tensor and has its shape, no name twice, a dtype this build reads (float32
// only, when asked); the bytes of every array's data into *bytes.
absl::Status CheckHeader(const v1::ExportStateHeader& h, const common::JobSpec& spec, bool float32,
                         std::vector<uint64_t>* bytes) {
  std::set<std::string> names;
  for (const v1::StateArray& a : h.arrays()) {
    if (a.tensor() >= spec.matrices.size() || a.name().empty() ||
        std::vector<int64_t>(a.shape().begin(), a.shape().end()) !=
            spec.matrices[a.tensor()].shape ||
        !names.insert(a.name()).second) {
      return absl::DataLossError(absl::StrCat("ExportState: array '", a.name(),
                                              "' does not match the job's tensor ", a.tensor()));
    }
    const auto dtype = ArrayDType(a);
    if (!dtype.ok() || (float32 && *dtype != common::StateDType::kFloat32)) {
      return absl::DataLossError(absl::StrCat("ExportState: array '", a.name(), "' has dtype '",
                                              a.dtype(), "'",
                                              float32 ? "; float32 was asked" : ""));
    }
    bytes->push_back(
        common::StoredStateBytes(*dtype, static_cast<uint64_t>(spec.matrices[a.tensor()].numel())));
  }
  if (spec.mode == common::JobMode::kApply &&
      static_cast<size_t>(h.tensor_steps_size()) != spec.matrices.size()) {
    return absl::DataLossError("ExportState: the step counts do not cover the job's tensors");
  }
  return absl::OkStatus();
}

absl::Status Errno(const std::string& path, const char* call) {
  const int err = errno;
  const std::string msg = absl::StrCat(path, ": ", call, ": ", std::strerror(err));
  if (err == EEXIST) {
    return absl::AlreadyExistsError(
        absl::StrCat(msg, " (an earlier export of this job? remove it or use another directory)"));
  }
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::UnavailableError(msg);
}

absl::Status WriteAt(int fd, const std::string& path, std::string_view data, uint64_t offset) {
  for (size_t at = 0; at < data.size();) {
    const ssize_t n =
        ::pwrite(fd, data.data() + at, data.size() - at, static_cast<off_t>(offset + at));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno(path, "write");
    at += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// A file of a directory (open as `dir_fd`, reached without links) being written under a temporary
// name, created new and never through a link; Publish() fsyncs it and links it to its final name
// without replacing anything there (EEXIST: ALREADY_EXISTS). Removed unless published.
class NewFile {
 public:
  NewFile(const std::string& dir, const std::string& name)
      : name_(name),
        tmp_name_(absl::StrCat(".", name, ".tmp-", ::getpid())),
        path_(absl::StrCat(dir, "/", name)),
        tmp_(absl::StrCat(dir, "/", tmp_name_)) {}
  ~NewFile() {
    if (fd_ >= 0) ::close(fd_);
    if (created_) ::unlinkat(dir_fd_, tmp_name_.c_str(), 0);
  }
  absl::Status Create(int dir_fd) {
    dir_fd_ = dir_fd;
    fd_ = ::openat(dir_fd, tmp_name_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                   0644);
    if (fd_ < 0) return Errno(tmp_, "open");
    created_ = true;
    return absl::OkStatus();
  }
  absl::Status Write(std::string_view data, uint64_t offset) {
    return WriteAt(fd_, tmp_, data, offset);
  }
  absl::Status Publish() {
    if (::fsync(fd_) != 0) return Errno(tmp_, "fsync");
    if (::linkat(dir_fd_, tmp_name_.c_str(), dir_fd_, name_.c_str(), 0) != 0) {
      return Errno(path_, "link");
    }
    return absl::OkStatus();  // the temporary name goes in the destructor
  }

 private:
  const std::string name_, tmp_name_, path_, tmp_;
  int dir_fd_ = -1;
  int fd_ = -1;
  bool created_ = false;
};

// Creates `dir` and its missing parents (mkdir -p); records in *made the ones it made.
absl::Status MakeDirs(const std::string& dir, std::vector<std::string>* made) {
  for (size_t slash = dir.find('/', 1); true; slash = dir.find('/', slash + 1)) {
    const std::string d = dir.substr(0, slash);
    if (::mkdir(d.c_str(), 0755) == 0) {
      made->push_back(d);
    } else if (errno != EEXIST) {
      return Errno(d, "mkdir");
    }
    if (slash == std::string::npos) return absl::OkStatus();
  }
}

// An export never replaces files: EEXIST when its payload or manifest is already there.
absl::Status RefuseExisting(const StateExportFiles& files) {
  for (const std::string& p : {files.payload, files.manifest}) {
    struct stat st;
    if (::lstat(p.c_str(), &st) == 0) {
      errno = EEXIST;
      return Errno(p, "export");
    }
  }
  return absl::OkStatus();
}

// The manifest of an export as its header describes it (the job's part, mode, step and
// generation; its arrays, laid out in the payload; apply mode: each tensor's step).
void DescribeExport(const common::JobSpec& spec, const v1::ExportStateHeader& h, se::Manifest* m) {
  if (spec.two_phase()) {
    m->global_job_id = spec.multinode.global_job_id;
    m->node = spec.multinode.node;
    m->nodes = spec.multinode.nodes;
  }
  m->mode = spec.mode;
  m->step = h.step();
  m->generation = h.generation();
  for (const v1::StateArray& sa : h.arrays()) {
    const common::MatrixSpec& t = spec.matrices[sa.tensor()];
    se::Array a{sa.name(), t.name, std::vector<int64_t>(sa.shape().begin(), sa.shape().end())};
    a.dtype = ArrayDType(sa).value_or(common::StateDType::kFloat32);  // checked by CheckHeader
    a.non_negative = a.dtype == common::StateDType::kInt8 && sa.non_negative();
    a.row_offset = t.row_offset;
    a.full_rows = t.full_rows;
    m->arrays.push_back(std::move(a));
  }
  if (m->mode == common::JobMode::kApply) {
    for (size_t t = 0; t < spec.matrices.size(); ++t) {
      m->tensor_steps[spec.matrices[t].name] = h.tensor_steps(static_cast<int>(t));
    }
  }
  se::LayOut(m);
}

// Writes the manifest `m` of job `job_id` durably into `dir` (open as `dir_fd`).
absl::Status WriteManifest(const std::string& dir, int dir_fd, const std::string& job_id,
                           const se::Manifest& m) {
  NewFile manifest(dir, absl::StrCat(job_id, se::kManifestSuffix));
  const std::string text = se::ManifestToJson(m);
  absl::Status s = manifest.Create(dir_fd);
  if (s.ok()) s = manifest.Write(text, 0);
  if (s.ok()) s = manifest.Publish();
  if (s.ok() && ::fsync(dir_fd) != 0) s = Errno(dir, "fsync");
  return s;
}

}  // namespace

absl::Status Client::ExportState(const std::string& job_id, const std::string& token,
                                 int64_t generation, int64_t step, const ExportStateSink& sink,
                                 const std::function<void(uint64_t done, uint64_t total)>& progress,
                                 bool float32) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::ExportStateRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  if (step >= 0) req.set_step(step);
  req.set_float32(float32);
  std::unique_ptr<grpc::ClientReader<v1::ExportStateChunk>> reader = stub_->ExportState(&ctx, req);
  std::optional<v1::ExportStateHeader> header;
  std::vector<uint64_t> bytes, received;  // per array
  absl::Status bad;
  uint64_t total = 0, done = 0;
  v1::ExportStateChunk chunk;
  while (reader->Read(&chunk)) {
    if (!bad.ok()) continue;  // drained to learn the daemon's status
    if (chunk.has_header()) {
      auto spec = common::JobSpecFromProto(chunk.header().spec());
      bad = header       ? absl::DataLossError("ExportState: a second header")
            : !spec.ok() ? spec.status()
                         : CheckHeader(chunk.header(), *spec, float32, &bytes);
      if (bad.ok()) {
        header = chunk.header();
        for (uint64_t b : bytes) total += b;
        received.assign(bytes.size(), 0);
        bad = sink.header(*spec, *header);
      }
      continue;
    }
    const v1::DataChunk& c = chunk.data();
    const uint32_t a = c.matrix_index();
    const uint64_t n = c.data().size();
    if (!header) {
      bad = absl::DataLossError("ExportState: data before the header");
    } else if (a >= bytes.size() || c.element_offset() != received[a] ||
               n > bytes[a] - received[a]) {
      bad = absl::DataLossError(absl::StrCat("ExportState: chunk of array ", a, " at byte ",
                                             c.element_offset(), " out of order or outside it"));
    } else if (common::Crc32c(c.data().data(), c.data().size()) != c.crc32c()) {
      bad =
          absl::DataLossError(absl::StrCat("ExportState: chunk of '", header->arrays(a).name(),
                                           "' at byte ", c.element_offset(), ": CRC32C mismatch"));
    } else {
      received[a] += n;
      bad = sink.data(a, c.element_offset(), c.data());
      done += c.data().size();
      if (bad.ok() && progress) progress(done, total);
    }
  }
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(reader->Finish()), "ExportState"));
  RETURN_IF_ERROR(bad);
  if (!header) return absl::DataLossError("ExportState: no header");
  for (size_t a = 0; a < bytes.size(); ++a) {
    if (received[a] != bytes[a]) {
      return absl::DataLossError(absl::StrCat("ExportState: array '", header->arrays(a).name(),
                                              "': ", received[a], " of ", bytes[a],
                                              " bytes arrived"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Client::CreateJobFromExport(const common::JobSpec& spec,
                                                        const std::string& import_dir) {
  if (import_dir.empty() || import_dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("import dir '", import_dir, "': the daemon needs an absolute path"));
  }
  grpc::ClientContext ctx;
  v1::CreateJobRequest req;
  *req.mutable_spec() = common::JobSpecToProto(spec);
  req.set_import_dir(import_dir);
  v1::CreateJobResponse resp;
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(stub_->CreateJob(&ctx, req, &resp)), "CreateJob"));
  return resp.token();
}

absl::StatusOr<bool> ParseExportStateDType(std::string_view dtype) {
  if (dtype == "held") return false;
  if (dtype == "float32") return true;
  return absl::InvalidArgumentError(
      absl::StrCat("state export dtype '", std::string(dtype),
                   "': \"held\" (as the job holds it) or \"float32\""));
}

absl::StatusOr<StateExportFiles> ExportStateToDir(
    Client& client, const std::string& job_id, const std::string& token, int64_t generation,
    int64_t step, const std::string& dir,
    const std::function<void(uint64_t done, uint64_t total)>& progress, bool float32) {
  if (dir.empty()) return absl::InvalidArgumentError("export: no directory given");
  StateExportFiles files;
  files.payload = absl::StrCat(dir, "/", job_id, se::kPayloadSuffix);
  files.manifest = absl::StrCat(dir, "/", job_id, se::kManifestSuffix);
  RETURN_IF_ERROR(RefuseExisting(files));  // before the daemon streams anything
  se::Manifest m;
  m.job_id = job_id;
  m.payload = absl::StrCat(job_id, se::kPayloadSuffix);
  std::vector<std::string> made;  // directories created here: removed again if they stay empty
  int dir_fd = -1;                 // `dir`, opened without following a link once it exists
  absl::Cleanup close_dir = [&dir_fd] {
    if (dir_fd >= 0) ::close(dir_fd);
  };
  NewFile payload(dir, m.payload);
  uint64_t header_bytes = 0;
  size_t tensors = 0;
  ExportStateSink sink;
  sink.header = [&](const common::JobSpec& spec, const v1::ExportStateHeader& h) -> absl::Status {
    tensors = spec.matrices.size();
    DescribeExport(spec, h, &m);
    const std::string header = se::PayloadHeader(m);
    header_bytes = header.size();
    RETURN_IF_ERROR(MakeDirs(dir, &made));
    ASSIGN_OR_RETURN(dir_fd, common::OpenDirectoryNoFollow(dir));
    RETURN_IF_ERROR(payload.Create(dir_fd));
    return payload.Write(header, 0);
  };
  sink.data = [&](uint32_t a, uint64_t offset, std::string_view data) -> absl::Status {
    se::Array& arr = m.arrays[a];
    arr.crc32c = common::Crc32cExtend(arr.crc32c, data.data(), data.size());
    return payload.Write(data, header_bytes + arr.begin + offset);
  };
  absl::Status s = client.ExportState(job_id, token, generation, step, sink, progress, float32);
  if (s.ok()) s = payload.Publish();
  if (s.ok()) {
    // The manifest last: its presence says the export is complete.
    s = WriteManifest(dir, dir_fd, job_id, m);
    if (!s.ok()) ::unlinkat(dir_fd, m.payload.c_str(), 0);
  }
  if (!s.ok()) {
    for (auto d = made.rbegin(); d != made.rend(); ++d) ::rmdir(d->c_str());
    return s;
  }
  files.step = m.step;
  files.generation = m.generation;
  files.bytes = m.payload_bytes;
  files.tensors = tensors;
  return files;
}

}  // namespace muond::client
