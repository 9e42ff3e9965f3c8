// The muond.v1.Muond gRPC service (synchronous API): authenticates each call with the job's token
// (metadata "x-muond-job-token") and maps it onto the JobRegistry and Jobs.
//
// Streams (Step, InitParams, ExportState, ExportParams) hold a server thread while they run: the
// token in the metadata is checked before the first Read (with "x-muond-job-id" in the metadata
// against that job, else it must be some job's token and the job the first message names is
// checked after it), each stream is admitted by a StreamGuard (bounded per job and in all) and
// cancelled when its client is idle for --stream-idle-seconds (stream_guard.h).
//
// Shutdown: after BeginShutdown() new steps and jobs get UNAVAILABLE, and streams waiting for their
// client outside a step are cancelled at once; steps already in flight run to completion until
// the server's shutdown deadline cancels them (then they abort and fence). Thread-safe.
#ifndef MUOND_SERVER_API_MUOND_SERVICE_H_
#define MUOND_SERVER_API_MUOND_SERVICE_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "muond/v1/muond.grpc.pb.h"
#include "server/api/peer_identity.h"
#include "server/api/shm_server.h"
#include "server/api/stream_guard.h"
#include "server/jobs/job_registry.h"
#include "server/jobs/job_report.h"

namespace muond::server {

inline constexpr char kTokenMetadataKey[] = "x-muond-job-token";
// Optional on streams: the job the stream is about, so that the token is checked against it
// before the first message (the client library sends it on Step and InitParams).
inline constexpr char kJobIdMetadataKey[] = "x-muond-job-id";

// The commit-window test's fault (armed by muond's main from $MUOND_TEST_COMMIT_FAULT in
// MUOND_TEST_HOOKS builds only): when CommitStep of step `step` reaches `point` ("commit": before
// the step is committed; "committed": after, before the reply), the daemon raises `signal` on
// itself (SIGKILL: dies there; SIGTERM: begins its shutdown and the call answers UNAVAILABLE, as a
// daemon that stops answers). Once.
void SetCommitFaultForTesting(const std::string& point, int signal, int64_t step);

class MuondService final : public v1::Muond::Service {
 public:
  // `access`: who may create jobs (nullptr: everyone); not owned, outlives the service.
  // `streams`: the bounds and idle limit of streams (stream_guard.h).
  explicit MuondService(JobRegistry* registry, const AccessPolicy* access = nullptr,
                        const StreamGuard::Options& streams = StreamGuard::Options())
      : registry_(registry), access_(access), streams_(streams) {}

  void BeginShutdown() {
    shutting_down_.store(true);
    streams_.BeginShutdown();
  }
  // Cancels every stream; one still blocked on its client kCloseAfterCancel later has its
  // connection closed (stream_guard.h). Before the server shuts down at once.
  void CancelAllStreams() { streams_.CancelAll(); }
  // Blocks until no Step call is in flight or `deadline` passed; true when none is in flight.
  bool WaitForStepsToDrain(absl::Time deadline);
  // The shared-memory server whose sessions' regions GetJob and ListJobs count in each job's
  // "buffers" memory (null: none). Set once it started; cleared before it stops.
  void SetSharedMemory(const ShmServer* shm) ABSL_LOCKS_EXCLUDED(shm_mu_);

  grpc::Status CreateJob(grpc::ServerContext* ctx, const v1::CreateJobRequest* req,
                         v1::CreateJobResponse* resp) override;
  grpc::Status DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* req,
                         v1::DeleteJobResponse* resp) override;
  grpc::Status GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                      v1::JobStatus* resp) override;
  grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                        v1::ListJobsResponse* resp) override;
  grpc::Status ResetJob(grpc::ServerContext* ctx, const v1::ResetJobRequest* req,
                        v1::ResetJobResponse* resp) override;
  grpc::Status CommitStep(grpc::ServerContext* ctx, const v1::CommitStepRequest* req,
                          v1::CommitStepResponse* resp) override;
  grpc::Status AbortStep(grpc::ServerContext* ctx, const v1::AbortStepRequest* req,
                         v1::AbortStepResponse* resp) override;
  grpc::Status RollbackStep(grpc::ServerContext* ctx, const v1::RollbackStepRequest* req,
                            v1::RollbackStepResponse* resp) override;
  grpc::Status AttachRank(grpc::ServerContext* ctx, const v1::AttachRankRequest* req,
                          v1::AttachRankResponse* resp) override;
  grpc::Status DetachRank(grpc::ServerContext* ctx, const v1::DetachRankRequest* req,
                          v1::DetachRankResponse* resp) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext* ctx, const v1::SaveCheckpointRequest* req,
                              v1::CheckpointInfo* resp) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext* ctx, const v1::LoadCheckpointRequest* req,
                              v1::LoadCheckpointResponse* resp) override;
  grpc::Status ListCheckpoints(grpc::ServerContext* ctx, const v1::ListCheckpointsRequest* req,
                               v1::ListCheckpointsResponse* resp) override;
  grpc::Status GetProgress(grpc::ServerContext* ctx, const v1::GetProgressRequest* req,
                           v1::GetProgressResponse* resp) override;
  grpc::Status WatchSession(grpc::ServerContext* ctx, const v1::WatchSessionRequest* req,
                            grpc::ServerWriter<v1::SessionEvent>* writer) override;
  grpc::Status Step(grpc::ServerContext* ctx,
                    grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream) override;
  grpc::Status InitParams(grpc::ServerContext* ctx, grpc::ServerReader<v1::InitRequest>* reader,
                          v1::InitResponse* resp) override;
  grpc::Status ExportParams(grpc::ServerContext* ctx, const v1::ExportRequest* req,
                            grpc::ServerWriter<v1::ExportChunk>* writer) override;
  // The full state by tensor name (export_state_service.cc).
  grpc::Status ExportState(grpc::ServerContext* ctx, const v1::ExportStateRequest* req,
                           grpc::ServerWriter<v1::ExportStateChunk>* writer) override;

 private:
  // The job named `job_id` if the call carries its token: NOT_FOUND, UNAUTHENTICATED (no token),
  // PERMISSION_DENIED (wrong token).
  absl::StatusOr<std::shared_ptr<Job>> Authorize(grpc::ServerContext* ctx,
                                                 const std::string& job_id) const;
  // Before a client stream's first Read: the job of its metadata. With "x-muond-job-id", as
  // Authorize (*named = true); without, UNAUTHENTICATED for no token, PERMISSION_DENIED for a token
  // that is no job's, else the job whose token it is (*named = false: the caller authorizes the
  // job its first message names).
  absl::StatusOr<std::shared_ptr<Job>> AuthorizeStream(grpc::ServerContext* ctx,
                                                       bool* named) const;
  // A stream's first message named `job_id`: the job to use. `job` from AuthorizeStream.
  absl::StatusOr<std::shared_ptr<Job>> AuthorizeNamed(grpc::ServerContext* ctx,
                                                      std::shared_ptr<Job> job, bool named,
                                                      const std::string& job_id) const;
  class StepInFlight;
  absl::Status RunStep(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream);
  absl::Status RunInitParams(grpc::ServerContext* ctx, grpc::ServerReader<v1::InitRequest>* reader,
                             v1::InitResponse* resp);
  absl::Status RunExportParams(grpc::ServerContext* ctx, const v1::ExportRequest* req,
                               grpc::ServerWriter<v1::ExportChunk>* writer);

  // The shared-memory sessions' usage now (none without a shared-memory server).
  ShmServer::Usage SharedMemoryUsage() const ABSL_LOCKS_EXCLUDED(shm_mu_);
  // `job`'s report with its shared-memory sessions' regions (from `usage`) in memory.buffers.
  static JobReport ReportOf(const Job& job, const ShmServer::Usage& usage);

  JobRegistry* registry_;
  mutable absl::Mutex shm_mu_;  // held only to read the server's usage (no I/O)
  const ShmServer* shm_ ABSL_GUARDED_BY(shm_mu_) = nullptr;
  const AccessPolicy* access_;
  std::atomic<bool> shutting_down_{false};
  StreamGuard streams_;
  absl::Mutex steps_mu_;
  int steps_in_flight_ ABSL_GUARDED_BY(steps_mu_) = 0;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_API_MUOND_SERVICE_H_
