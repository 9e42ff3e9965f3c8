// The two-phase calls of multi-node jobs (DESIGN.md 4c; server/jobs/job_prepare.cc):
// CommitStep, AbortStep and RollbackStep, and the commit-window test's fault hook.
#include <signal.h>
#include <unistd.h>

#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "server/api/logged_rpc_status.h"
#include "server/api/muond_service.h"

namespace muond::server {
namespace {

struct CommitFault {
  absl::Mutex mu;
  std::string point ABSL_GUARDED_BY(mu);
  int signal ABSL_GUARDED_BY(mu) = 0;
  int64_t step ABSL_GUARDED_BY(mu) = -1;
};

CommitFault& TheCommitFault() {
  static auto* fault = new CommitFault();
  return *fault;
}

// True when the armed fault fired here (after SIGTERM: the call answers UNAVAILABLE).
bool CommitFaultAt(const char* point, int64_t step) {
  CommitFault& f = TheCommitFault();
  int signal = 0;
  {
    absl::MutexLock lock(&f.mu);
    if (f.signal == 0 || f.point != point || f.step != step) return false;
    signal = std::exchange(f.signal, 0);
  }
  MUOND_LOG(WARNING) << "test hook MUOND_TEST_COMMIT_FAULT: signal " << signal << " at '" << point
                     << "' of step " << step;
  ::kill(::getpid(), signal);  // to the process (raise() would target this thread alone)
  return true;
}

}  // namespace

void SetCommitFaultForTesting(const std::string& point, int signal, int64_t step) {
  CommitFault& f = TheCommitFault();
  absl::MutexLock lock(&f.mu);
  f.point = point;
  f.signal = signal;
  f.step = step;
}

grpc::Status MuondService::CommitStep(grpc::ServerContext* ctx, const v1::CommitStepRequest* req,
                                      v1::CommitStepResponse*) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return LoggedRpcStatus("CommitStep", job.status());
  const absl::Status stopping = absl::UnavailableError("muond is shutting down");
  if (CommitFaultAt("commit", req->step())) return LoggedRpcStatus("CommitStep", stopping);
  const absl::Status s = (*job)->CommitStep(req->step());
  if (CommitFaultAt("committed", req->step())) return LoggedRpcStatus("CommitStep", stopping);
  return LoggedRpcStatus("CommitStep", s);
}

grpc::Status MuondService::AbortStep(grpc::ServerContext* ctx, const v1::AbortStepRequest* req,
                                     v1::AbortStepResponse*) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return LoggedRpcStatus("AbortStep", job.status());
  const std::string reason =
      req->reason().empty() ? "no reason given" : req->reason().substr(0, 1024);
  return LoggedRpcStatus("AbortStep", (*job)->AbortStep(req->step(), reason));
}

grpc::Status MuondService::RollbackStep(grpc::ServerContext* ctx,
                                        const v1::RollbackStepRequest* req,
                                        v1::RollbackStepResponse*) {
  auto job = Authorize(ctx, req->job_id());
  if (!job.ok()) return LoggedRpcStatus("RollbackStep", job.status());
  const std::string reason =
      req->reason().empty() ? "no reason given" : req->reason().substr(0, 1024);
  return LoggedRpcStatus("RollbackStep", (*job)->RollbackStep(req->step(), reason));
}

}  // namespace muond::server
