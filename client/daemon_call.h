// What the client library's gRPC calls to the daemon share (internal to client/): the job token in
// a call's metadata, and errors prefixed with the operation that failed. SetToken and Annotate are
// defined in client.cc. Thread-safe (no state).
#ifndef MUOND_CLIENT_DAEMON_CALL_H_
#define MUOND_CLIENT_DAEMON_CALL_H_

#include <grpcpp/client_context.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "muond/v1/muond.grpc.pb.h"

namespace muond::client {

// Sends the job's token with the call; the daemon checks it for every call on a job.
void SetToken(grpc::ClientContext* ctx, const std::string& token);

// Prefixes a daemon error with the operation (`what`), keeping its code; OK stays OK.
absl::Status Annotate(const absl::Status& s, const std::string& what);

// Calls the unary `method` of the daemon with the job's token and waits for it: the response, or
// the daemon's error prefixed with `what` (the method's name).
template <typename Request, typename Response>
absl::StatusOr<Response> CallWithToken(
    v1::Muond::Stub& stub,
    grpc::Status (v1::Muond::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    const std::string& token, const Request& req, const std::string& what) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  Response resp;
  RETURN_IF_ERROR(Annotate(common::FromGrpcStatus((stub.*method)(&ctx, req, &resp)), what));
  return resp;
}

}  // namespace muond::client

#endif  // MUOND_CLIENT_DAEMON_CALL_H_
