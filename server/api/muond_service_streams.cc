// The data streams of MuondService: Step (a rank's gradients in, its update out), InitParams
// (initial parameters in) and ExportParams (parameters out), and the count of steps in flight
// that shutdown drains. The other RPCs are in muond_service.cc.
#include "server/api/muond_service.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/status_macros.h"
#include "server/api/logged_rpc_status.h"
#include "server/engine/heap_trimmer.h"
#include "server/record/daemon_metrics.h"

namespace muond::server {
namespace {

// Update and export chunks carry at most this many bytes.
constexpr size_t kChunkBytes = size_t{4} << 20;

}  // namespace

grpc::Status MuondService::Step(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) {
  // What the stream's messages took on the heap is trimmed back when it ends (also after its
  // job was deleted), as a step's buffers are.
  HeapTrimmer::Activity activity;
  return LoggedRpcStatus("Step", RunStep(ctx, stream));
}

// A Step stream that joined a step: counted until it ends (WaitForStepsToDrain).
class MuondService::StepInFlight {
 public:
  explicit StepInFlight(MuondService* service) : service_(service) {
    absl::MutexLock lock(&service_->steps_mu_);
    ++service_->steps_in_flight_;
  }
  ~StepInFlight() {
    absl::MutexLock lock(&service_->steps_mu_);
    --service_->steps_in_flight_;
  }
  StepInFlight(const StepInFlight&) = delete;
  StepInFlight& operator=(const StepInFlight&) = delete;

 private:
  MuondService* const service_;
};

bool MuondService::WaitForStepsToDrain(absl::Time deadline) {
  absl::MutexLock lock(&steps_mu_);
  auto drained = [this]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(steps_mu_) { return steps_in_flight_ == 0; };
  return steps_mu_.AwaitWithDeadline(absl::Condition(&drained), deadline);
}

namespace {

// Apply mode: the hyperparameters a StepBegin carries, resolved against the job's groups
// (INVALID_ARGUMENT naming `where`); nullopt for an update-mode job, which must carry none.
absl::StatusOr<std::optional<StepHyper>> HyperOf(const Job& job, const v1::StepBegin& begin,
                                                 const std::string& where) {
  if (!job.apply()) {
    if (begin.hyper_size() > 0 || begin.grad_divisor() != 0 || begin.absent_tensors_size() > 0 ||
        begin.has_global_clip() || begin.max_logits_size() > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where,
                       ": the job is in mode 'update'; a step takes no lr, weight decay, gradient "
                       "divisor, presence mask or max attention logits there"));
    }
    return std::optional<StepHyper>();
  }
  std::vector<GroupValue> values;
  for (const v1::GroupHyper& g : begin.hyper()) {
    GroupValue& v = values.emplace_back();
    v.group = g.group();
    v.lr = g.lr();
    if (g.has_weight_decay()) v.weight_decay = g.weight_decay();
  }
  auto resolved = ResolveStepHyper(job.spec(), values, begin.grad_divisor());
  if (!resolved.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", resolved.status().message()));
  }
  // Bounded by the message size gRPC accepted; the mask itself is the job's size.
  auto mask = common::PresenceMask(job.spec(), std::vector<uint32_t>(begin.absent_tensors().begin(),
                                                                     begin.absent_tensors().end()));
  if (!mask.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", mask.status().message()));
  }
  resolved->absent = *std::move(mask);
  // QK-Clip's per-head maxima: counted against the job's heads (CheckStepHyper), bounded first.
  if (static_cast<size_t>(begin.max_logits_size()) > common::kMaxQkClipLogits) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", begin.max_logits_size(),
                                                   " max attention logits; at most ",
                                                   common::kMaxQkClipLogits));
  }
  resolved->max_logits.assign(begin.max_logits().begin(), begin.max_logits().end());
  if (begin.has_global_clip()) {
    resolved->clip_source =
        begin.global_clip().speculate() ? ClipSource::kSpeculate : ClipSource::kGlobal;
    resolved->global_sum_sq = begin.global_clip().sum_sq();
  }
  return std::optional<StepHyper>(*std::move(resolved));
}

}  // namespace

namespace {

using StepStream = grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>;

// Reads a step's gradient chunks into `rank_step` until StepEnd, whose outside share (update mode
// with max_grad_norm) it returns in `outside_sum_sq`. A stream that closes first abandons the
// step.
absl::Status ReadGradients(StreamGuard::Lease& lease, StepStream* stream, RankStep& rank_step,
                           const std::string& where, double* outside_sum_sq) {
  v1::StepRequest req;
  while (true) {
    if (!lease.Await([&] { return stream->Read(&req); })) {
      return rank_step.Abandon(absl::StrCat("closed its stream before StepEnd", lease.HowEnded()));
    }
    switch (req.kind_case()) {
      case v1::StepRequest::kGradient: {
        const v1::DataChunk& c = req.gradient();
        RETURN_IF_ERROR(
            rank_step.AddGradient(c.matrix_index(), c.element_offset(), c.data(), c.crc32c()));
        RecordBytes(Transport::kGrpc, Direction::kIn, c.data().size());
        break;
      }
      case v1::StepRequest::kEnd:
        *outside_sum_sq = req.end().outside_sum_sq();
        return absl::OkStatus();
      default:
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": expected a gradient chunk or StepEnd"));
    }
  }
}

// Writes the rank's update (apply mode: its new parameters, in each tensor's param dtype) in
// chunks of at most kChunkBytes through `resp`; returns the bytes sent.
absl::StatusOr<uint64_t> SendUpdate(StreamGuard::Lease& lease, StepStream* stream, Job& job,
                                    const RankUpdate& update, const std::string& where,
                                    v1::StepResponse* resp) {
  const common::JobSpec& spec = job.spec();
  uint64_t bytes_out = 0;
  for (const UpdateSpan& span : update.spans) {
    const common::MatrixSpec& ms = spec.matrices[span.matrix];
    const size_t esize = common::DTypeSize(job.apply() ? ms.param_dtype : ms.dtype);
    const size_t per_chunk = kChunkBytes / esize * esize;
    for (size_t at = 0; at < span.size; at += per_chunk) {
      const size_t n = std::min(per_chunk, span.size - at);
      v1::DataChunk* c = resp->mutable_update();
      c->set_matrix_index(span.matrix);
      c->set_element_offset(span.offset + at / esize);
      c->set_data(span.data + at, n);
      job.CountTransportCopy(n);
      c->set_crc32c(common::Crc32c(span.data + at, n));
      if (!lease.Await([&] { return stream->Write(*resp); })) {
        // The step is committed; the rank may ask again for the same bytes (a replay).
        return absl::UnavailableError(absl::StrCat(
            where,
            ": the client went away while receiving the update; the step is committed, "
            "retry it to receive the same update"));
      }
      bytes_out += n;
      RecordBytes(Transport::kGrpc, Direction::kOut, n);
    }
  }
  return bytes_out;
}

}  // namespace

absl::Status MuondService::RunStep(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) {
  // The token before anything is read: a stream without a valid one holds nothing.
  bool named = false;
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, AuthorizeStream(ctx, &named));
  ASSIGN_OR_RETURN(std::unique_ptr<StreamGuard::Lease> lease,
                   streams_.Admit(ctx, job->id(), job->spec().world_size, "Step"));
  v1::StepRequest req;
  if (!lease->Await([&] { return stream->Read(&req); })) {
    return absl::InvalidArgumentError(
        absl::StrCat("step stream closed before StepBegin", lease->HowEnded()));
  }
  if (req.kind_case() != v1::StepRequest::kBegin) {
    return absl::InvalidArgumentError("the first message of a step must be StepBegin");
  }
  const v1::StepBegin begin = req.begin();
  ASSIGN_OR_RETURN(job, AuthorizeNamed(ctx, std::move(job), named, begin.job_id()));
  // Deleting the job cancels the stream, blocked in Read or not (issue 32, item 6).
  const auto cancel_on_delete = job->OnDelete([ctx] { ctx->TryCancel(); });
  // While draining, ranks may still join a step that other ranks already began (so it can
  // complete), but no new step starts.
  if (shutting_down_.load() && !job->StepInFlight(begin.step())) {
    return absl::UnavailableError("muond is shutting down; retry the step");
  }
  const StepInFlight counted(this);
  lease->InStep();
  const std::string where =
      absl::StrCat("job '", begin.job_id(), "' step ", begin.step(), " rank ", begin.rank());
  ASSIGN_OR_RETURN(const std::optional<StepHyper> hyper, HyperOf(*job, begin, where));
  ASSIGN_OR_RETURN(
      std::unique_ptr<RankStep> rank_step,
      job->BeginStep(begin.rank(), begin.session_id(), begin.step(), hyper ? &*hyper : nullptr));
  // Gradients until StepEnd. Returning early destroys rank_step: a step that was not finished is
  // aborted for every rank, unless it was already refused.
  double outside_sum_sq = 0;  // update mode with max_grad_norm: StepEnd's
  RETURN_IF_ERROR(ReadGradients(*lease, stream, *rank_step, where, &outside_sum_sq));
  ASSIGN_OR_RETURN(std::shared_ptr<const RankUpdate> update,
                   rank_step->Finish([ctx] { return ctx->IsCancelled(); }, outside_sum_sq));
  v1::StepResponse resp;
  ASSIGN_OR_RETURN(const uint64_t bytes_out,
                   SendUpdate(*lease, stream, *job, *update, where, &resp));
  v1::StepDone* done = resp.mutable_done();
  done->set_step(update->step);
  done->set_replayed(rank_step->replay() && !update->skipped);
  done->set_skipped(update->skipped);
  done->set_compute_seconds(update->compute_seconds);
  done->set_grad_sum_sq(update->grad_sum_sq);
  done->set_bytes_in(rank_step->bytes_in());
  done->set_bytes_out(bytes_out);
  if (lease->Await([&] { return stream->Write(resp); })) job->UpdateSent(update->step);
  return absl::OkStatus();
}

grpc::Status MuondService::InitParams(grpc::ServerContext* ctx,
                                      grpc::ServerReader<v1::InitRequest>* reader,
                                      v1::InitResponse* resp) {
  HeapTrimmer::Activity activity;  // as Step
  return LoggedRpcStatus("InitParams", RunInitParams(ctx, reader, resp));
}

absl::Status MuondService::RunInitParams(grpc::ServerContext* ctx,
                                         grpc::ServerReader<v1::InitRequest>* reader,
                                         v1::InitResponse* resp) {
  bool named = false;
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, AuthorizeStream(ctx, &named));
  ASSIGN_OR_RETURN(std::unique_ptr<StreamGuard::Lease> lease,
                   streams_.Admit(ctx, job->id(), job->spec().world_size, "InitParams"));
  v1::InitRequest req;
  if (!lease->Await([&] { return reader->Read(&req); }) ||
      req.kind_case() != v1::InitRequest::kBegin) {
    return absl::InvalidArgumentError(
        absl::StrCat("the first message of InitParams must be InitBegin", lease->HowEnded()));
  }
  const v1::InitBegin begin = req.begin();
  ASSIGN_OR_RETURN(job, AuthorizeNamed(ctx, std::move(job), named, begin.job_id()));
  const auto cancel_on_delete = job->OnDelete([ctx] { ctx->TryCancel(); });
  ASSIGN_OR_RETURN(std::unique_ptr<ParamUpload> upload,
                   job->BeginParamUpload(begin.rank(), begin.session_id(), begin.float32()));
  while (true) {
    if (!lease->Await([&] { return reader->Read(&req); })) {
      return absl::CancelledError(
          absl::StrCat("job '", begin.job_id(), "' rank ", begin.rank(),
                       ": the initial-parameter stream closed before InitEnd", lease->HowEnded(),
                       "; nothing changed"));
    }
    if (req.kind_case() == v1::InitRequest::kEnd) break;
    if (req.kind_case() != v1::InitRequest::kParams) {
      return absl::InvalidArgumentError(
          absl::StrCat("job '", begin.job_id(), "' rank ", begin.rank(),
                       ": expected a parameter chunk or InitEnd; nothing changed"));
    }
    const v1::DataChunk& c = req.params();
    RETURN_IF_ERROR(upload->Add(c.matrix_index(), c.element_offset(), c.data(), c.crc32c()));
    RecordBytes(Transport::kGrpc, Direction::kIn, c.data().size());
  }
  ASSIGN_OR_RETURN(const uint64_t elements, upload->Finish());
  resp->set_elements(elements);
  resp->set_weights_complete(job->WeightsComplete());
  return absl::OkStatus();
}

grpc::Status MuondService::ExportParams(grpc::ServerContext* ctx, const v1::ExportRequest* req,
                                        grpc::ServerWriter<v1::ExportChunk>* writer) {
  // The snapshot and the chunks are heap memory: trimmed back to the system when the export
  // ends (also when it outlives its deleted job), as a step's buffers are.
  HeapTrimmer::Activity activity;
  return LoggedRpcStatus("ExportParams", RunExportParams(ctx, req, writer));
}

absl::Status MuondService::RunExportParams(grpc::ServerContext* ctx, const v1::ExportRequest* req,
                                           grpc::ServerWriter<v1::ExportChunk>* writer) {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, Authorize(ctx, req->job_id()));
  const auto cancel_on_delete = job->OnDelete([ctx] { ctx->TryCancel(); });
  ASSIGN_OR_RETURN(std::unique_ptr<StreamGuard::Lease> lease,
                   streams_.Admit(ctx, job->id(), job->spec().world_size, "ExportParams"));
  auto parsed = common::DTypeFromProto(req->dtype());
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", req->job_id(), "': export: ", parsed.status().message()));
  }
  const common::DType dtype = *parsed;
  const size_t esize = common::DTypeSize(dtype);
  const size_t per_chunk = kChunkBytes / esize;
  int64_t step = 0;
  std::string bytes;
  v1::ExportChunk out;
  auto sink = [&](uint32_t t, const std::vector<float>& w) -> absl::Status {
    for (size_t at = 0; at < w.size(); at += per_chunk) {
      const size_t n = std::min(per_chunk, w.size() - at);
      bytes.resize(n * esize);
      common::FromFloat32(w.data() + at, n, dtype, bytes.data());
      v1::DataChunk* c = out.mutable_data();
      c->set_matrix_index(t);
      c->set_element_offset(at);
      c->set_crc32c(common::Crc32c(bytes.data(), bytes.size()));
      c->set_data(bytes);
      out.set_step(step);
      if (ctx->IsCancelled() || !lease->Await([&] { return writer->Write(out); })) {
        return absl::CancelledError(absl::StrCat("job '", req->job_id(),
                                                 "': the client went away during the export",
                                                 lease->HowEnded()));
      }
      RecordBytes(Transport::kGrpc, Direction::kOut, bytes.size());
    }
    return absl::OkStatus();
  };
  return job->ExportParams(sink, &step);
}

}  // namespace muond::server
