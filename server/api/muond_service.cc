#include "server/api/muond_service.h"

#include <malloc.h>
#include <unistd.h>

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/logging.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/api/job_status_proto.h"
#include "server/api/logged_rpc_status.h"
#include "server/engine/heap_trimmer.h"
#include "server/record/status_progress.h"

namespace muond::server {
namespace {

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

void MuondService::SetSharedMemory(const ShmServer* shm) {
  absl::MutexLock lock(&shm_mu_);
  shm_ = shm;
}

ShmServer::Usage MuondService::SharedMemoryUsage() const {
  absl::MutexLock lock(&shm_mu_);
  return shm_ != nullptr ? shm_->usage() : ShmServer::Usage();
}

JobReport MuondService::ReportOf(const Job& job, const ShmServer::Usage& usage) {
  JobReport r = job.Report();
  r.memory.buffers += usage.region_bytes(r.spec.job_id);
  return r;
}

grpc::Status MuondService::GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                                  v1::JobStatus* resp) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return Logged("GetJob", job.status());
  *resp = JobStatusToProto(ReportOf(**job, SharedMemoryUsage()));
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
  const ShmServer::Usage usage = SharedMemoryUsage();
  for (const auto& job : registry_->List()) {
    const JobReport r = ReportOf(*job, usage);
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

}  // namespace muond::server
