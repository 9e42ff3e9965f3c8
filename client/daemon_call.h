// What the client library's gRPC calls to the daemon share (internal to client/): the job token in
// a call's metadata, and errors prefixed with the operation that failed. SetToken and Annotate are
// defined in client.cc. Thread-safe (no state).
#ifndef MUOND_CLIENT_DAEMON_CALL_H_
#define MUOND_CLIENT_DAEMON_CALL_H_

#include <grpcpp/client_context.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "muond/v1/muond.grpc.pb.h"

namespace muond::client {

// Sends the job's token with the call; the daemon checks it for every call on a job.
void SetToken(grpc::ClientContext* ctx, const std::string& token);
// Sends the job's id with a stream (Step, InitParams): the daemon checks the token against it
// before it reads anything, and names the job in a refusal.
void SetStreamJob(grpc::ClientContext* ctx, const std::string& job_id);

// Prefixes a daemon error with the operation (`what`), keeping its code; OK stays OK.
absl::Status Annotate(const absl::Status& s, const std::string& what);

// Calls the unary `method` of the daemon with the job's token and waits for it: the response, or
// the daemon's error prefixed with `what` (the method's name). `wait_for_ready` > 0: a call made
// while the channel is reconnecting (the daemon was just restarted) waits for it up to that long
// instead of failing at once with UNAVAILABLE; the deadline then bounds the whole call.
// `deadline` > 0 (without wait_for_ready): the call fails at once when the daemon cannot be
// reached, and with DEADLINE_EXCEEDED when it does not answer within that long.
template <typename Request, typename Response>
absl::StatusOr<Response> CallWithToken(
    v1::Muond::Stub& stub,
    grpc::Status (v1::Muond::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    const std::string& token, const Request& req, const std::string& what,
    absl::Duration wait_for_ready = absl::ZeroDuration(),
    absl::Duration deadline = absl::ZeroDuration()) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  if (wait_for_ready > absl::ZeroDuration()) {
    ctx.set_wait_for_ready(true);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + wait_for_ready));
  } else if (deadline > absl::ZeroDuration()) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  }
  Response resp;
  RETURN_IF_ERROR(Annotate(common::FromGrpcStatus((stub.*method)(&ctx, req, &resp)), what));
  return resp;
}

}  // namespace muond::client

#endif  // MUOND_CLIENT_DAEMON_CALL_H_
