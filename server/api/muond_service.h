// The muond.v1.Muond gRPC service (synchronous API): authenticates each call with the job's token
// (metadata "x-muond-job-token") and maps it onto the JobRegistry and Jobs.
//
// Shutdown: after BeginShutdown() new steps and jobs get UNAVAILABLE; steps already in flight run
// to completion until the server's shutdown deadline cancels them (then they abort and fence).
// Thread-safe.
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
#include "server/jobs/job_registry.h"
#include "server/api/peer_identity.h"

namespace muond::server {

inline constexpr char kTokenMetadataKey[] = "x-muond-job-token";

class MuondService final : public v1::Muond::Service {
 public:
  // `access`: who may create jobs (nullptr: everyone); not owned, outlives the service.
  explicit MuondService(JobRegistry* registry, const AccessPolicy* access = nullptr)
      : registry_(registry), access_(access) {}

  void BeginShutdown() { shutting_down_.store(true); }
  // Blocks until no Step call is in flight or `deadline` passed; true when none is in flight.
  bool WaitForStepsToDrain(absl::Time deadline);

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
  absl::Status RunStep(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>* stream);
  absl::Status RunInitParams(grpc::ServerContext* ctx, grpc::ServerReader<v1::InitRequest>* reader,
                             v1::InitResponse* resp);
  absl::Status RunExportParams(grpc::ServerContext* ctx, const v1::ExportRequest* req,
                               grpc::ServerWriter<v1::ExportChunk>* writer);

  JobRegistry* registry_;
  const AccessPolicy* access_;
  std::atomic<bool> shutting_down_{false};
  absl::Mutex steps_mu_;
  int steps_in_flight_ ABSL_GUARDED_BY(steps_mu_) = 0;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_API_MUOND_SERVICE_H_
