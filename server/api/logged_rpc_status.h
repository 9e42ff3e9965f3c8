// The status an RPC handler of muond returns: a failure is logged (debug) and counted
// (muond_rpc_errors_total, by RPC and code) before it becomes the gRPC status. Shared by the
// files of MuondService.
#ifndef MUOND_SERVER_API_LOGGED_RPC_STATUS_H_
#define MUOND_SERVER_API_LOGGED_RPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "server/record/daemon_metrics.h"

namespace muond::server {

inline grpc::Status LoggedRpcStatus(const char* rpc, const absl::Status& s) {
  if (!s.ok()) {
    MUOND_LOG(DEBUG) << rpc << ": " << s;
    RecordRpcError(rpc, s.code());
  }
  return common::ToGrpcStatus(s);
}

}  // namespace muond::server

#endif  // MUOND_SERVER_API_LOGGED_RPC_STATUS_H_
