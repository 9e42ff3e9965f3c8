// Apply mode (DESIGN.md 4b): the export of a job's master weights (Client::ExportParams) and
// the safetensors model file muonctl export and muond_export write (ExportParamsToFile).
#include <grpcpp/grpcpp.h>

#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/daemon_call.h"
#include "common/crc32c.h"
#include "common/grpc_status.h"
#include "common/job_spec_proto.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace muond::client {

namespace {

using common::FromGrpcStatus;

std::string Quoted(const std::string& name) { return absl::StrCat("'", name, "'"); }

// Collects the chunks of an ExportParams stream into whole tensors; after the first bad chunk
// the others are read and dropped (the stream is drained to learn the daemon's status).
class ExportAssembler {
 public:
  ExportAssembler(const common::JobSpec& spec, common::DType dtype)
      : spec_(spec), esize_(common::DTypeSize(dtype)), received_(spec.matrices.size(), 0) {
    for (const common::MatrixSpec& ms : spec.matrices) {
      tensors_.push_back({ms.name, dtype, ms.shape,
                          std::string(static_cast<uint64_t>(ms.numel()) * esize_, '\0')});
    }
  }

  void Add(const v1::ExportChunk& chunk) {
    if (bad_.ok()) bad_ = Place(chunk);
  }

  // The tensors once the stream finished OK: the first bad chunk's error, INTERNAL when a tensor
  // was not covered.
  absl::StatusOr<std::vector<NamedTensor>> Take(int64_t* step) {
    RETURN_IF_ERROR(bad_);
    for (size_t m = 0; m < tensors_.size(); ++m) {
      const uint64_t numel = static_cast<uint64_t>(spec_.matrices[m].numel());
      if (received_[m] != numel) {
        return absl::InternalError(absl::StrCat("ExportParams: tensor ",
                                                Quoted(spec_.matrices[m].name), ": ", received_[m],
                                                " of ", numel, " elements arrived"));
      }
    }
    if (step != nullptr && step_) *step = *step_;
    return std::move(tensors_);
  }

 private:
  absl::Status Place(const v1::ExportChunk& chunk) {
    const v1::DataChunk& c = chunk.data();
    if (c.matrix_index() >= spec_.matrices.size()) {
      return absl::DataLossError(
          absl::StrCat("ExportParams: chunk for unknown tensor ", c.matrix_index()));
    }
    const common::MatrixSpec& ms = spec_.matrices[c.matrix_index()];
    if (common::Crc32c(c.data().data(), c.data().size()) != c.crc32c()) {
      return absl::DataLossError(absl::StrCat("ExportParams: chunk of tensor ", Quoted(ms.name),
                                              " at element ", c.element_offset(),
                                              ": CRC32C mismatch"));
    }
    const uint64_t n = c.data().size() / esize_;
    const uint64_t numel = static_cast<uint64_t>(ms.numel());
    if (c.data().size() % esize_ != 0 || c.element_offset() > numel ||
        n > numel - c.element_offset()) {
      return absl::InternalError(absl::StrCat(
          "ExportParams: chunk of tensor ", Quoted(ms.name), " elements [", c.element_offset(),
          ", +", c.data().size(), " bytes) outside its ", numel, " elements"));
    }
    if (step_ && *step_ != chunk.step()) {
      return absl::InternalError(absl::StrCat("ExportParams: chunks of steps ", *step_, " and ",
                                              chunk.step(), " in one export"));
    }
    step_ = chunk.step();
    std::memcpy(tensors_[c.matrix_index()].data.data() + c.element_offset() * esize_,
                c.data().data(), c.data().size());
    received_[c.matrix_index()] += n;
    return absl::OkStatus();
  }

  const common::JobSpec& spec_;
  const size_t esize_;
  std::vector<NamedTensor> tensors_;
  std::vector<uint64_t> received_;  // elements, per tensor
  std::optional<int64_t> step_;
  absl::Status bad_;
};

}  // namespace

absl::StatusOr<std::vector<NamedTensor>> Client::ExportParams(
    const std::string& job_id, const std::string& token, common::DType dtype, int64_t* step,
    const std::function<void(uint64_t done, uint64_t total)>& progress) {
  ASSIGN_OR_RETURN(const v1::JobStatus status, GetJob(job_id, token));
  ASSIGN_OR_RETURN(const common::JobSpec spec, common::JobSpecFromProto(status.spec()));
  if (spec.mode != common::JobMode::kApply) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ExportParams: job '", job_id,
        "' is in mode 'update': the trainer keeps its weights, the daemon has none to export"));
  }
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::ExportRequest req;
  req.set_job_id(job_id);
  req.set_dtype(common::DTypeToProto(dtype));
  std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader = stub_->ExportParams(&ctx, req);
  ExportAssembler assembler(spec, dtype);
  uint64_t total = 0, done = 0;
  for (const common::MatrixSpec& ms : spec.matrices) {
    total += static_cast<uint64_t>(ms.numel()) * common::DTypeSize(dtype);
  }
  v1::ExportChunk chunk;
  while (reader->Read(&chunk)) {
    assembler.Add(chunk);
    done += chunk.data().data().size();
    if (progress) progress(done, total);
  }
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(reader->Finish()), "ExportParams"));
  return assembler.Take(step);
}

absl::StatusOr<int64_t> ExportParamsToFile(
    Client& client, const std::string& job_id, const std::string& token, common::DType dtype,
    const std::string& path, const std::function<void(uint64_t done, uint64_t total)>& progress) {
  int64_t step = -1;
  ASSIGN_OR_RETURN(const std::vector<NamedTensor> tensors,
                   client.ExportParams(job_id, token, dtype, &step, progress));
  std::vector<common::TensorRef> refs;
  for (const NamedTensor& t : tensors) refs.push_back({t.name, t.dtype, t.shape, t.data});
  RETURN_IF_ERROR(common::WriteSafetensorsFile(
      path, refs, {{"format", "pt"}, {"job", job_id}, {"step", std::to_string(step)}}));
  return step;
}

}  // namespace muond::client
