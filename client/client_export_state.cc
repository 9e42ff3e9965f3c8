// The full-state export of a job (re-sharding across nodes, DESIGN.md 4c): Client::ExportState
// receives the daemon's ExportState stream, ExportStateToDir writes it as a state export
// (common/state_export.h) into a directory several node jobs share; Client::CreateJobFromExport
// creates a job that takes its state from such a directory.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/daemon_call.h"
#include "common/crc32c.h"
#include "common/grpc_status.h"
#include "common/job_spec_proto.h"
#include "common/state_export.h"
#include "common/status_macros.h"

namespace muond::client {
namespace {

namespace se = common::state_export;
using common::FromGrpcStatus;

// Checks the header of the stream against its spec before anything is allocated: every array
// belongs to a job tensor and has its shape, no name twice.
absl::Status CheckHeader(const v1::ExportStateHeader& h, const common::JobSpec& spec) {
  std::set<std::string> names;
  for (const v1::StateArray& a : h.arrays()) {
    if (a.tensor() >= spec.matrices.size() || a.name().empty() ||
        std::vector<int64_t>(a.shape().begin(), a.shape().end()) !=
            spec.matrices[a.tensor()].shape ||
        !names.insert(a.name()).second) {
      return absl::DataLossError(absl::StrCat("ExportState: array '", a.name(),
                                              "' does not match the job's tensor ", a.tensor()));
    }
  }
  if (spec.mode == common::JobMode::kApply &&
      static_cast<size_t>(h.tensor_steps_size()) != spec.matrices.size()) {
    return absl::DataLossError("ExportState: the step counts do not cover the job's tensors");
  }
  return absl::OkStatus();
}

// Places one chunk into its array; DATA_LOSS for a bad chunk.
absl::Status Place(const v1::DataChunk& c, ExportedState* out, std::vector<uint64_t>* received) {
  if (c.matrix_index() >= out->arrays.size()) {
    return absl::DataLossError(
        absl::StrCat("ExportState: chunk for unknown array ", c.matrix_index()));
  }
  const std::string& name = out->header.arrays(c.matrix_index()).name();
  std::string& dst = out->arrays[c.matrix_index()];
  if (common::Crc32c(c.data().data(), c.data().size()) != c.crc32c()) {
    return absl::DataLossError(absl::StrCat("ExportState: chunk of '", name, "' at element ",
                                            c.element_offset(), ": CRC32C mismatch"));
  }
  const uint64_t numel = dst.size() / sizeof(float);
  const uint64_t n = c.data().size() / sizeof(float);
  if (c.data().size() % sizeof(float) != 0 || c.element_offset() > numel ||
      n > numel - c.element_offset()) {
    return absl::DataLossError(
        absl::StrCat("ExportState: chunk of '", name, "' outside its ", numel, " elements"));
  }
  std::memcpy(dst.data() + c.element_offset() * sizeof(float), c.data().data(), c.data().size());
  (*received)[c.matrix_index()] += n;
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

// Writes `parts` into `dir`/`name` without replacing anything there: a temporary file, fsync,
// then link() to the final name (EEXIST: ALREADY_EXISTS), and the temporary name removed.
absl::Status WriteNew(const std::string& dir, const std::string& name,
                      const std::vector<std::string_view>& parts) {
  const std::string path = absl::StrCat(dir, "/", name);
  const std::string tmp = absl::StrCat(dir, "/.", name, ".tmp-", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Errno(tmp, "open");
  absl::Status s;
  for (std::string_view p : parts) {
    for (size_t at = 0; at < p.size() && s.ok();) {
      const ssize_t n = ::write(fd, p.data() + at, p.size() - at);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) s = Errno(tmp, "write");
      if (n > 0) at += static_cast<size_t>(n);
    }
  }
  if (s.ok() && ::fsync(fd) != 0) s = Errno(tmp, "fsync");
  ::close(fd);
  if (s.ok() && ::link(tmp.c_str(), path.c_str()) != 0) s = Errno(path, "link");
  ::unlink(tmp.c_str());
  return s;
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno(dir, "open");
  const int rc = ::fsync(fd);
  ::close(fd);
  return rc == 0 ? absl::OkStatus() : Errno(dir, "fsync");
}

}  // namespace

absl::StatusOr<ExportedState> Client::ExportState(
    const std::string& job_id, const std::string& token, int64_t generation, int64_t step,
    const std::function<void(uint64_t done, uint64_t total)>& progress) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::ExportStateRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  if (step >= 0) req.set_step(step);
  std::unique_ptr<grpc::ClientReader<v1::ExportStateChunk>> reader = stub_->ExportState(&ctx, req);
  ExportedState out;
  std::vector<uint64_t> received;
  absl::Status bad;
  bool have_header = false;
  uint64_t total = 0, done = 0;
  v1::ExportStateChunk chunk;
  while (reader->Read(&chunk)) {
    if (!bad.ok()) continue;  // drained to learn the daemon's status
    if (chunk.has_header()) {
      out.header = chunk.header();
      auto spec = common::JobSpecFromProto(out.header.spec());
      bad = have_header  ? absl::DataLossError("ExportState: a second header")
            : !spec.ok() ? spec.status()
                         : CheckHeader(out.header, *spec);
      if (!bad.ok()) continue;
      out.spec = *std::move(spec);
      have_header = true;
      for (const v1::StateArray& a : out.header.arrays()) {
        const uint64_t bytes =
            static_cast<uint64_t>(out.spec.matrices[a.tensor()].numel()) * sizeof(float);
        out.arrays.emplace_back(bytes, '\0');
        total += bytes;
      }
      received.assign(out.arrays.size(), 0);
      continue;
    }
    bad = have_header ? Place(chunk.data(), &out, &received)
                      : absl::DataLossError("ExportState: data before the header");
    done += chunk.data().data().size();
    if (bad.ok() && progress) progress(done, total);
  }
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(reader->Finish()), "ExportState"));
  RETURN_IF_ERROR(bad);
  if (!have_header) return absl::DataLossError("ExportState: no header");
  for (size_t a = 0; a < out.arrays.size(); ++a) {
    if (received[a] * sizeof(float) != out.arrays[a].size()) {
      return absl::DataLossError(
          absl::StrCat("ExportState: array '", out.header.arrays(a).name(), "': ", received[a],
                       " of ", out.arrays[a].size() / sizeof(float), " elements arrived"));
    }
  }
  return out;
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

absl::StatusOr<StateExportFiles> ExportStateToDir(
    Client& client, const std::string& job_id, const std::string& token, int64_t generation,
    int64_t step, const std::string& dir,
    const std::function<void(uint64_t done, uint64_t total)>& progress) {
  if (dir.empty()) return absl::InvalidArgumentError("export: no directory given");
  StateExportFiles files;
  files.payload = absl::StrCat(dir, "/", job_id, se::kPayloadSuffix);
  files.manifest = absl::StrCat(dir, "/", job_id, se::kManifestSuffix);
  for (const std::string& p : {files.payload, files.manifest}) {
    struct stat st;
    if (::lstat(p.c_str(), &st) == 0) {
      errno = EEXIST;
      return Errno(p, "export");  // before the daemon streams anything
    }
  }
  ASSIGN_OR_RETURN(const ExportedState state,
                   client.ExportState(job_id, token, generation, step, progress));
  // The directory and its missing parents (mkdir -p), once there is something to write.
  for (size_t slash = dir.find('/', 1); true; slash = dir.find('/', slash + 1)) {
    const std::string d = dir.substr(0, slash);
    if (::mkdir(d.c_str(), 0755) != 0 && errno != EEXIST) return Errno(d, "mkdir");
    if (slash == std::string::npos) break;
  }
  se::Manifest m;
  m.job_id = job_id;
  if (state.spec.two_phase()) {
    m.global_job_id = state.spec.multinode.global_job_id;
    m.node = state.spec.multinode.node;
    m.nodes = state.spec.multinode.nodes;
  }
  m.mode = state.spec.mode;
  m.step = state.header.step();
  m.generation = state.header.generation();
  m.payload = absl::StrCat(job_id, se::kPayloadSuffix);
  std::vector<std::string_view> parts(1);
  for (int a = 0; a < state.header.arrays_size(); ++a) {
    const v1::StateArray& sa = state.header.arrays(a);
    se::Array arr{sa.name(), state.spec.matrices[sa.tensor()].name,
                  std::vector<int64_t>(sa.shape().begin(), sa.shape().end())};
    arr.crc32c = common::Crc32c(state.arrays[a].data(), state.arrays[a].size());
    m.arrays.push_back(std::move(arr));
    parts.push_back(state.arrays[a]);
  }
  if (m.mode == common::JobMode::kApply) {
    for (size_t t = 0; t < state.spec.matrices.size(); ++t) {
      m.tensor_steps[state.spec.matrices[t].name] = state.header.tensor_steps(static_cast<int>(t));
    }
  }
  se::LayOut(&m);
  const std::string header = se::PayloadHeader(m);
  parts[0] = header;
  RETURN_IF_ERROR(WriteNew(dir, m.payload, parts));
  // The manifest last: its presence says the export is complete.
  const std::string manifest = se::ManifestToJson(m);
  absl::Status s = WriteNew(dir, absl::StrCat(job_id, se::kManifestSuffix), {manifest});
  if (s.ok()) s = FsyncDir(dir);
  if (!s.ok()) {
    ::unlink(files.payload.c_str());
    return s;
  }
  files.step = m.step;
  files.generation = m.generation;
  files.bytes = m.payload_bytes;
  files.tensors = state.spec.matrices.size();
  return files;
}

}  // namespace muond::client
