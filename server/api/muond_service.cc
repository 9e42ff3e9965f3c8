#include "server/api/muond_service.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/logging.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/api/job_status_proto.h"
#include "server/api/logged_rpc_status.h"
#include "server/engine/apply_step.h"
#include "server/engine/heap_trimmer.h"
#include "server/record/daemon_metrics.h"
#include "server/record/status_progress.h"

namespace muond::server {
namespace {

// Update chunks sent back carry at most this many bytes.
constexpr size_t kChunkBytes = size_t{4} << 20;

grpc::Status Logged(const char* rpc, const absl::Status& s) { return LoggedRpcStatus(rpc, s); }

void ToProto(const checkpoint::GenerationInfo& info, v1::CheckpointInfo* out) {
  out->set_generation(info.generation);
  out->set_step(info.step);
  out->set_created_unix_ms(info.created_unix_ms);
  out->set_bytes(info.bytes);
  out->set_path(info.path);
  out->set_problem(info.problem);
}

// Which checkpoint generation a request names (generation > 0, else the newest at `step` when
// given, else the newest good one). INVALID_ARGUMENT, prefixed by `what`, for negative numbers.
template <typename Request>
absl::StatusOr<checkpoint::Selector> SelectorOf(const std::string& what, const Request& r) {
  if (r.generation() < 0 || (r.has_step() && r.step() < 0)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": generation ", r.generation(),
                                                   " / step ", r.has_step() ? r.step() : 0,
                                                   " must not be negative"));
  }
  checkpoint::Selector selector;
  selector.generation = r.generation() > 0 ? r.generation() : -1;
  selector.step = r.has_step() ? r.step() : -1;
  return selector;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Job>> MuondService::Authorize(grpc::ServerContext* ctx,
                                                             const std::string& job_id) const {
  const auto& md = ctx->client_metadata();
  auto it = md.find(kTokenMetadataKey);
  // An empty value counts as missing: a client without a token (e.g. muonctl with no token file
  // and no $MUOND_JOB_TOKEN) still sends the key.
  const std::string_view token =
      it == md.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
  return registry_->Authorize(job_id, token, absl::StrCat(" (metadata '", kTokenMetadataKey, "')"));
}

absl::StatusOr<std::shared_ptr<Job>> MuondService::AuthorizeStream(grpc::ServerContext* ctx,
                                                                   bool* named) const {
  const auto& md = ctx->client_metadata();
  auto id = md.find(kJobIdMetadataKey);
  *named = id != md.end() && !id->second.empty();
  if (*named) return Authorize(ctx, std::string(id->second.data(), id->second.size()));
  auto it = md.find(kTokenMetadataKey);
  const std::string_view token =
      it == md.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
  if (token.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat("missing job token (metadata '", kTokenMetadataKey, "')"));
  }
  for (std::shared_ptr<Job>& job : registry_->List()) {
    if (job->TokenMatches(token)) return std::move(job);
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "wrong job token: it is no job's (metadata '", kTokenMetadataKey,
      "'; send the job id in metadata '", kJobIdMetadataKey, "' for a message naming the job)"));
}

absl::StatusOr<std::shared_ptr<Job>> MuondService::AuthorizeNamed(grpc::ServerContext* ctx,
                                                                  std::shared_ptr<Job> job,
                                                                  bool named,
                                                                  const std::string& job_id) const {
  if (!named) return Authorize(ctx, job_id);
  if (job_id != job->id()) {
    return absl::InvalidArgumentError(absl::StrCat("the stream's metadata '", kJobIdMetadataKey,
                                                   "' names job '", job->id(),
                                                   "', its first message job '", job_id, "'"));
  }
  return job;
}

grpc::Status MuondService::CreateJob(grpc::ServerContext* ctx, const v1::CreateJobRequest* req,
                                     v1::CreateJobResponse* resp) {
  const PeerIdentity peer = PeerOf(*ctx);
  absl::Status allowed = access_ ? access_->MayCreateJob(peer) : absl::OkStatus();
  if (!allowed.ok()) return Logged("CreateJob", allowed);
  if (shutting_down_.load())
    return Logged("CreateJob", absl::UnavailableError("muond is shutting down"));
  auto spec = common::JobSpecFromProto(req->spec());
  if (!spec.ok()) return Logged("CreateJob", spec.status());
  std::optional<JobRegistry::RestoreFrom> restore;
  if (req->has_restore()) {
    const v1::RestoreFrom& r = req->restore();
    auto selector = SelectorOf("restore", r);
    if (!selector.ok()) return Logged("CreateJob", selector.status());
    restore = JobRegistry::RestoreFrom{r.job_id(), r.token(), *selector};
  }
  JobOwner owner;
  if (peer.unix_credentials) owner.uid = peer.unix_credentials->uid;
  owner.description = peer.Describe();
  auto created = registry_->Create(*std::move(spec), restore, std::move(owner), req->import_dir());
  if (!created.ok()) {
    // A refused spec can be megabytes of parsed request: give it back to the system.
    ::malloc_trim(0);
    return Logged("CreateJob", created.status());
  }
  resp->set_job_id(created->job->id());
  resp->set_token(created->token);
  return grpc::Status::OK;
}

grpc::Status MuondService::DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* req,
                                     v1::DeleteJobResponse*) {
  // What the job held in the heap is trimmed back when the delete ends (HeapTrimmer).
  HeapTrimmer::Activity activity;
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("DeleteJob", job.status());
  // The registry drops this reference too: Delete returns once the job's memory is back.
  return Logged("DeleteJob", registry_->Delete(*std::move(job)));
}

grpc::Status MuondService::GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                                  v1::JobStatus* resp) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("GetJob", job.status());
  *resp = JobStatusToProto((*job)->Report());
  return grpc::Status::OK;
}

grpc::Status MuondService::ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest*,
                                    v1::ListJobsResponse* resp) {
  // Details for the job's owner (its uid on the Unix socket), the daemon's own user and root,
  // and whoever sent the job's token; ids, sizes and state for everyone else.
  const PeerIdentity peer = PeerOf(*ctx);
  const std::optional<int64_t> uid =
      peer.unix_credentials ? std::optional<int64_t>(peer.unix_credentials->uid) : std::nullopt;
  const bool admin = uid && (*uid == 0 || *uid == static_cast<int64_t>(::geteuid()));
  const auto& md = ctx->client_metadata();
  const auto token_it = md.find(kTokenMetadataKey);
  const std::string_view token =
      token_it == md.end() ? std::string_view()
                           : std::string_view(token_it->second.data(), token_it->second.size());
  for (const auto& job : registry_->List()) {
    const JobReport r = job->Report();
    const bool owner = uid && r.owner_uid && *r.owner_uid == *uid;
    const bool details = admin || owner || (!token.empty() && job->TokenMatches(token));
    *resp->add_jobs() = details ? JobStatusToProto(r) : WithheldJobStatus(r);
  }
  for (const JobRegistry::BrokenJob& b : registry_->Broken()) {
    v1::BrokenJob* out = resp->add_broken();
    out->set_directory(b.directory);
    // The reason can name files of the job: the daemon's user and root only.
    out->set_reason(admin ? b.reason : "(withheld: ask the daemon's administrator)");
  }
  return grpc::Status::OK;
}

grpc::Status MuondService::ResetJob(grpc::ServerContext* ctx, const v1::ResetJobRequest* req,
                                    v1::ResetJobResponse*) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("ResetJob", job.status());
  return Logged("ResetJob", registry_->Reset(*job, req->next_step()));
}

grpc::Status MuondService::SaveCheckpoint(grpc::ServerContext* ctx,
                                          const v1::SaveCheckpointRequest* req,
                                          v1::CheckpointInfo* resp) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("SaveCheckpoint", job.status());
  auto info = (*job)->SaveCheckpoint();
  if (!info.ok()) return Logged("SaveCheckpoint", info.status());
  ToProto(*info, resp);
  return grpc::Status::OK;
}

grpc::Status MuondService::LoadCheckpoint(grpc::ServerContext* ctx,
                                          const v1::LoadCheckpointRequest* req,
                                          v1::LoadCheckpointResponse* resp) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("LoadCheckpoint", job.status());
  auto selector = SelectorOf(absl::StrCat("job '", req->job_id(), "'"), *req);
  if (!selector.ok()) return Logged("LoadCheckpoint", selector.status());
  auto loaded = registry_->LoadCheckpoint(*job, *selector);
  if (!loaded.ok()) return Logged("LoadCheckpoint", loaded.status());
  ToProto(loaded->info, resp->mutable_loaded());
  resp->set_next_step(loaded->next_step);
  for (const std::string& p : loaded->set_aside) resp->add_set_aside(p);
  return grpc::Status::OK;
}

grpc::Status MuondService::GetProgress(grpc::ServerContext* ctx, const v1::GetProgressRequest* req,
                                       v1::GetProgressResponse* resp) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("GetProgress", job.status());
  for (const OperationReport& o : OperationProgress::Default().ForJob(req->job_id())) {
    v1::OperationProgress* p = resp->add_operations();
    p->set_id(o.id);
    p->set_kind(o.kind);
    p->set_target(o.target);
    p->set_bytes_done(o.bytes_done);
    p->set_bytes_total(o.bytes_total);
    p->set_started_unix_ms(o.started_unix_ms);
    p->set_ended_unix_ms(o.ended_unix_ms);
    p->set_done(o.done);
    p->set_error(o.error);
  }
  return grpc::Status::OK;
}

grpc::Status MuondService::ListCheckpoints(grpc::ServerContext* ctx,
                                           const v1::ListCheckpointsRequest* req,
                                           v1::ListCheckpointsResponse* resp) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("ListCheckpoints", job.status());
  auto list = (*job)->ListCheckpoints();
  if (!list.ok()) return Logged("ListCheckpoints", list.status());
  for (const checkpoint::GenerationInfo& info : *list) ToProto(info, resp->add_generations());
  return grpc::Status::OK;
}

grpc::Status MuondService::AttachRank(grpc::ServerContext* ctx, const v1::AttachRankRequest* req,
                                      v1::AttachRankResponse* resp) {
  if (shutting_down_.load())
    return Logged("AttachRank", absl::UnavailableError("muond is shutting down"));
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("AttachRank", job.status());
  auto session = (*job)->Attach(req->rank(), req->takeover());
  if (!session.ok()) return Logged("AttachRank", session.status());
  resp->set_session_id(*session);
  resp->set_next_step((*job)->Report().next_step);
  return grpc::Status::OK;
}

grpc::Status MuondService::DetachRank(grpc::ServerContext* ctx, const v1::DetachRankRequest* req,
                                      v1::DetachRankResponse*) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("DetachRank", job.status());
  return Logged("DetachRank", (*job)->Detach(req->rank(), req->session_id()));
}

grpc::Status MuondService::WatchSession(grpc::ServerContext* ctx,
                                        const v1::WatchSessionRequest* req,
                                        grpc::ServerWriter<v1::SessionEvent>* writer) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("WatchSession", job.status());
  if (absl::Status s = (*job)->CheckSession(req->rank(), req->session_id()); !s.ok()) {
    return Logged("WatchSession", s);
  }
  // Each watch holds a server thread for its session's life: bounded per job and in all.
  auto lease = streams_.AdmitWatch(ctx, (*job)->id(), (*job)->spec().world_size);
  if (!lease.ok()) return Logged("WatchSession", lease.status());
  v1::SessionEvent event;
  event.set_event("watching");
  writer->Write(event);
  // Held until the rank's process goes away (the call is cancelled), the session ends on the
  // daemon's side (detach, takeover, deleted job) or the daemon stops.
  while (true) {
    if (shutting_down_.load()) {
      return Logged("WatchSession", absl::UnavailableError("muond is shutting down"));
    }
    if (ctx->IsCancelled()) {
      (*job)->EndLostSession(req->rank(), req->session_id(),
                             "its session watch ended: the process or its connection is gone");
      return grpc::Status::CANCELLED;
    }
    if (absl::Status s = (*job)->CheckSession(req->rank(), req->session_id()); !s.ok()) {
      event.set_event(std::string(s.message()));
      writer->Write(event);
      return grpc::Status::OK;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

grpc::Status MuondService::Step(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) {
  // What the stream's messages took on the heap is trimmed back when it ends (also after its
  // job was deleted), as a step's buffers are.
  HeapTrimmer::Activity activity;
  return Logged("Step", RunStep(ctx, stream));
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
  bool ended = false;
  double outside_sum_sq = 0;  // update mode with max_grad_norm: StepEnd's
  while (!ended) {
    if (!lease->Await([&] { return stream->Read(&req); })) {
      return rank_step->Abandon(
          absl::StrCat("closed its stream before StepEnd", lease->HowEnded()));
    }
    switch (req.kind_case()) {
      case v1::StepRequest::kGradient: {
        const v1::DataChunk& c = req.gradient();
        RETURN_IF_ERROR(
            rank_step->AddGradient(c.matrix_index(), c.element_offset(), c.data(), c.crc32c()));
        RecordBytes(Transport::kGrpc, Direction::kIn, c.data().size());
        break;
      }
      case v1::StepRequest::kEnd:
        ended = true;
        outside_sum_sq = req.end().outside_sum_sq();
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": expected a gradient chunk or StepEnd"));
    }
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const RankUpdate> update,
                   rank_step->Finish([ctx] { return ctx->IsCancelled(); }, outside_sum_sq));
  const common::JobSpec& spec = job->spec();
  uint64_t bytes_out = 0;
  v1::StepResponse resp;
  for (const UpdateSpan& span : update->spans) {
    // Apply mode returns new parameters, in the tensor's param dtype.
    const common::MatrixSpec& ms = spec.matrices[span.matrix];
    const size_t esize = common::DTypeSize(job->apply() ? ms.param_dtype : ms.dtype);
    const size_t per_chunk = kChunkBytes / esize * esize;
    for (size_t at = 0; at < span.size; at += per_chunk) {
      const size_t n = std::min(per_chunk, span.size - at);
      v1::DataChunk* c = resp.mutable_update();
      c->set_matrix_index(span.matrix);
      c->set_element_offset(span.offset + at / esize);
      c->set_data(span.data + at, n);
      job->CountTransportCopy(n);
      c->set_crc32c(common::Crc32c(span.data + at, n));
      if (!lease->Await([&] { return stream->Write(resp); })) {
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

}  // namespace muond::server

namespace muond::server {

grpc::Status MuondService::InitParams(grpc::ServerContext* ctx,
                                      grpc::ServerReader<v1::InitRequest>* reader,
                                      v1::InitResponse* resp) {
  HeapTrimmer::Activity activity;  // as Step
  return Logged("InitParams", RunInitParams(ctx, reader, resp));
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
  return Logged("ExportParams", RunExportParams(ctx, req, writer));
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
