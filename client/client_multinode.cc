// Multi-node jobs (DESIGN.md 4c) in the client library: the two-phase step calls of Client and
// their C ABI (muond_client.h: muond_step_commit, muond_step_abort, muond_ownership_plan).
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/daemon_call.h"
#include "client/muond_client.h"
#include "client/ownership_plan.h"
#include "common/job_spec.h"

namespace muond::client {
namespace {

constexpr absl::Duration kCommitWaitForReady = absl::Seconds(20);

}  // namespace

absl::Status Client::CommitStep(const std::string& job_id, const std::string& token, int64_t step) {
  v1::CommitStepRequest req;
  req.set_job_id(job_id);
  req.set_step(step);
  // A commit follows a prepare that every node answered; a node whose daemon was restarted since
  // this client last called it (a recovery, as after a daemon kill) is being reconnected to, and
  // the commit waits for that (bounded) instead of failing the step as if the daemon were gone.
  return CallWithToken(*stub_, &v1::Muond::Stub::CommitStep, token, req, "CommitStep",
                       kCommitWaitForReady)
      .status();
}

absl::Status Client::AbortStep(const std::string& job_id, const std::string& token, int64_t step,
                               const std::string& reason) {
  v1::AbortStepRequest req;
  req.set_job_id(job_id);
  req.set_step(step);
  req.set_reason(reason);
  // After a failure: a daemon that is gone fails at once, one that hangs is given up on.
  return CallWithToken(*stub_, &v1::Muond::Stub::AbortStep, token, req, "AbortStep",
                       absl::ZeroDuration(), kCommitWaitForReady)
      .status();
}

absl::Status Client::RollbackStep(const std::string& job_id, const std::string& token, int64_t step,
                                  const std::string& reason) {
  v1::RollbackStepRequest req;
  req.set_job_id(job_id);
  req.set_step(step);
  req.set_reason(reason);
  return CallWithToken(*stub_, &v1::Muond::Stub::RollbackStep, token, req, "RollbackStep",
                       absl::ZeroDuration(), kCommitWaitForReady)
      .status();
}

}  // namespace muond::client

// c_api.cc owns the muond_client struct and the last-error slot; these reach them through
// muond_c_report / muond_c_client.
int muond_c_report(const absl::Status& s);
muond::client::Client* muond_c_client(muond_client* client);

extern "C" {

int muond_step_commit(muond_client* client, const char* job_id, const char* token, int64_t step) {
  if (client == nullptr || job_id == nullptr || token == nullptr) {
    return muond_c_report(absl::InvalidArgumentError("client, job_id or token is NULL"));
  }
  return muond_c_report(muond_c_client(client)->CommitStep(job_id, token, step));
}

int muond_step_abort(muond_client* client, const char* job_id, const char* token, int64_t step,
                     const char* reason) {
  if (client == nullptr || job_id == nullptr || token == nullptr) {
    return muond_c_report(absl::InvalidArgumentError("client, job_id or token is NULL"));
  }
  return muond_c_report(
      muond_c_client(client)->AbortStep(job_id, token, step, reason == nullptr ? "" : reason));
}

int muond_step_rollback(muond_client* client, const char* job_id, const char* token, int64_t step,
                        const char* reason) {
  if (client == nullptr || job_id == nullptr || token == nullptr) {
    return muond_c_report(absl::InvalidArgumentError("client, job_id or token is NULL"));
  }
  return muond_c_report(
      muond_c_client(client)->RollbackStep(job_id, token, step, reason == nullptr ? "" : reason));
}

int muond_checkpoint_list(muond_client* client, const char* job_id, const char* token,
                          int64_t* generations, int64_t* steps, size_t capacity, size_t* total) {
  if (client == nullptr || job_id == nullptr || token == nullptr) {
    return muond_c_report(absl::InvalidArgumentError("client, job_id or token is NULL"));
  }
  auto list = muond_c_client(client)->ListCheckpoints(job_id, token);
  if (!list.ok()) return muond_c_report(list.status());
  if (total != nullptr) *total = list->size();
  for (size_t i = 0; i < list->size() && i < capacity; ++i) {
    if (generations != nullptr) generations[i] = (*list)[i].generation();
    if (steps != nullptr) steps[i] = (*list)[i].step();
  }
  return muond_c_report(absl::OkStatus());
}

namespace {

// The plan of a job.json over `nodes` nodes (what both C functions below report).
absl::StatusOr<muond::client::OwnershipPlan> PlanOf(const char* spec_json, int nodes) {
  if (spec_json == nullptr) return absl::InvalidArgumentError("spec_json is NULL");
  auto spec = muond::common::ParseJobSpecJson(spec_json);
  if (!spec.ok()) return spec.status();
  return muond::client::PlanOwnership(*spec, nodes);
}

}  // namespace

int muond_ownership_plan(const char* spec_json, int nodes, int32_t* owner, size_t capacity,
                         size_t* total, double* node_flops, double* node_bytes) {
  auto plan = PlanOf(spec_json, nodes);
  if (!plan.ok()) return muond_c_report(plan.status());
  if (total != nullptr) *total = plan->owner.size();
  for (size_t i = 0; i < plan->owner.size() && i < capacity && owner != nullptr; ++i) {
    owner[i] = plan->owner[i];
  }
  for (int n = 0; n < nodes; ++n) {
    if (node_flops != nullptr) node_flops[n] = plan->node_flops[n];
    if (node_bytes != nullptr) node_bytes[n] = plan->node_bytes[n];
  }
  return muond_c_report(absl::OkStatus());
}

int muond_ownership_pieces(const char* spec_json, int nodes, int32_t* tensor, int64_t* row_begin,
                           int64_t* row_end, int32_t* node, size_t capacity, size_t* total) {
  auto plan = PlanOf(spec_json, nodes);
  if (!plan.ok()) return muond_c_report(plan.status());
  if (total != nullptr) *total = plan->pieces.size();
  for (size_t i = 0; i < plan->pieces.size() && i < capacity; ++i) {
    const muond::client::PlanPiece& p = plan->pieces[i];
    if (tensor != nullptr) tensor[i] = p.tensor;
    if (row_begin != nullptr) row_begin[i] = p.row_begin;
    if (row_end != nullptr) row_end[i] = p.row_end;
    if (node != nullptr) node[i] = p.node;
  }
  return muond_c_report(absl::OkStatus());
}

}  // extern "C"
