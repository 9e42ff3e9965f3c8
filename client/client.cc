// Client: the connection to a daemon (TLS, health) and the calls on jobs and checkpoints.
// Attaching a rank and the RankSession's steps: client_session.cc.
#include "client/client.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/daemon_call.h"
#include "common/grpc_status.h"
#include "common/job_spec_proto.h"
#include "common/paths.h"
#include "common/pem.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace muond::client {
namespace {

using common::FromGrpcStatus;

constexpr char kTokenKey[] = "x-muond-job-token";
constexpr int kMaxMessageBytes = (4 << 20) + (64 << 10);
constexpr char kTlsScheme[] = "tls://";

absl::StatusOr<std::string> ReadPem(const char* what, const std::string& path) {
  return common::ReadPemFile(absl::StrCat("TLS ", what), path);
}

// Plaintext for unix:// and HOST:PORT, TLS (TlsOptions) for tls://HOST:PORT.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const std::string& address, const TlsOptions& tls) {
  const bool any = !tls.ca_file.empty() || !tls.cert_file.empty() || !tls.key_file.empty();
  if (!absl::StartsWith(address, kTlsScheme)) {
    if (any) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TLS settings need a tls://HOST:PORT address, not ", address));
    }
    return grpc::InsecureChannelCredentials();
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS: a client certificate and its key go together (MUOND_TLS_CERT, MUOND_TLS_KEY)");
  }
  grpc::SslCredentialsOptions options;
  if (!tls.ca_file.empty()) {
    ASSIGN_OR_RETURN(options.pem_root_certs, ReadPem("CA", tls.ca_file));
  }
  if (!tls.cert_file.empty()) {
    ASSIGN_OR_RETURN(options.pem_cert_chain, ReadPem("certificate", tls.cert_file));
    ASSIGN_OR_RETURN(options.pem_private_key, ReadPem("key", tls.key_file));
  }
  return grpc::SslCredentials(options);
}

}  // namespace

void SetToken(grpc::ClientContext* ctx, const std::string& token) {
  ctx->AddMetadata(kTokenKey, token);
}

void SetStreamJob(grpc::ClientContext* ctx, const std::string& job_id) {
  // Metadata values are printable ASCII and small; a job id that is not (refused by the daemon
  // anyway) travels in the first message only.
  if (job_id.empty() || job_id.size() > 1024) return;
  for (char c : job_id) {
    if (c < 0x20 || c > 0x7e) return;
  }
  ctx->AddMetadata("x-muond-job-id", job_id);
}

absl::Status Annotate(const absl::Status& s, const std::string& what) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

TlsOptions TlsOptionsFromEnvironment() {
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : std::string(v);
  };
  return TlsOptions{env("MUOND_TLS_CA"), env("MUOND_TLS_CERT"), env("MUOND_TLS_KEY")};
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address) {
  const std::string resolved = address.empty() ? common::DefaultClientAddress() : address;
  return Connect(resolved, absl::StartsWith(resolved, kTlsScheme) ? TlsOptionsFromEnvironment()
                                                                  : TlsOptions{});
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address,
                                                        const TlsOptions& tls) {
  std::unique_ptr<Client> c(new Client());
  c->address_ = address.empty() ? common::DefaultClientAddress() : address;
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ChannelCredentialsFor(c->address_, tls));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // A daemon that restarts (systemd, a recovery) is reconnected to within a second; gRPC's default
  // backoff grows to two minutes, during which every call fails at once.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  const std::string target = absl::StartsWith(c->address_, kTlsScheme)
                                 ? c->address_.substr(std::strlen(kTlsScheme))
                                 : c->address_;
  c->channel_ = grpc::CreateCustomChannel(target, credentials, args);
  if (c->channel_ == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to ", c->address_));
  }
  c->stub_ = v1::Muond::NewStub(c->channel_);
  return c;
}

absl::Status Client::Health(double timeout_seconds) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("muond at ", address_, " is not reachable: ", s.error_message()));
  }
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(
        "muond at ", address_, " reports ",
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Client::CreateJob(const common::JobSpec& spec,
                                              const v1::RestoreFrom* restore) {
  grpc::ClientContext ctx;
  v1::CreateJobRequest req;
  *req.mutable_spec() = common::JobSpecToProto(spec);
  if (restore != nullptr) *req.mutable_restore() = *restore;
  v1::CreateJobResponse resp;
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(stub_->CreateJob(&ctx, req, &resp)), "CreateJob"));
  return resp.token();
}

absl::Status Client::DeleteJob(const std::string& job_id, const std::string& token) {
  v1::DeleteJobRequest req;
  req.set_job_id(job_id);
  return CallWithToken(*stub_, &v1::Muond::Stub::DeleteJob, token, req, "DeleteJob").status();
}

absl::Status Client::ResetJob(const std::string& job_id, const std::string& token,
                              int64_t next_step) {
  v1::ResetJobRequest req;
  req.set_job_id(job_id);
  req.set_next_step(next_step);
  return CallWithToken(*stub_, &v1::Muond::Stub::ResetJob, token, req, "ResetJob").status();
}

absl::StatusOr<v1::CheckpointInfo> Client::SaveCheckpoint(const std::string& job_id,
                                                          const std::string& token) {
  v1::SaveCheckpointRequest req;
  req.set_job_id(job_id);
  return CallWithToken(*stub_, &v1::Muond::Stub::SaveCheckpoint, token, req, "SaveCheckpoint");
}

absl::StatusOr<v1::LoadCheckpointResponse> Client::LoadCheckpoint(const std::string& job_id,
                                                                  const std::string& token,
                                                                  int64_t generation,
                                                                  int64_t step) {
  v1::LoadCheckpointRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  if (step >= 0) req.set_step(step);
  return CallWithToken(*stub_, &v1::Muond::Stub::LoadCheckpoint, token, req, "LoadCheckpoint");
}

absl::StatusOr<std::vector<v1::CheckpointInfo>> Client::ListCheckpoints(
    const std::string& job_id, const std::string& token) {
  v1::ListCheckpointsRequest req;
  req.set_job_id(job_id);
  ASSIGN_OR_RETURN(const v1::ListCheckpointsResponse resp,
                   CallWithToken(*stub_, &v1::Muond::Stub::ListCheckpoints, token, req,
                                 "ListCheckpoints"));
  return std::vector<v1::CheckpointInfo>(resp.generations().begin(), resp.generations().end());
}

absl::StatusOr<std::vector<v1::OperationProgress>> Client::GetProgress(
    const std::string& job_id, const std::string& token) {
  v1::GetProgressRequest req;
  req.set_job_id(job_id);
  ASSIGN_OR_RETURN(
      const v1::GetProgressResponse resp,
      CallWithToken(*stub_, &v1::Muond::Stub::GetProgress, token, req, "GetProgress"));
  return std::vector<v1::OperationProgress>(resp.operations().begin(), resp.operations().end());
}

absl::StatusOr<v1::JobStatus> Client::GetJob(const std::string& job_id, const std::string& token) {
  v1::GetJobRequest req;
  req.set_job_id(job_id);
  return CallWithToken(*stub_, &v1::Muond::Stub::GetJob, token, req, "GetJob");
}

absl::StatusOr<std::vector<v1::JobStatus>> Client::ListJobs() {
  ASSIGN_OR_RETURN(const v1::ListJobsResponse resp, ListJobsWithBroken());
  return std::vector<v1::JobStatus>(resp.jobs().begin(), resp.jobs().end());
}

absl::StatusOr<v1::ListJobsResponse> Client::ListJobsWithBroken(const std::string& token) {
  grpc::ClientContext ctx;
  if (!token.empty()) SetToken(&ctx, token);
  v1::ListJobsRequest req;
  v1::ListJobsResponse resp;
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(stub_->ListJobs(&ctx, req, &resp)), "ListJobs"));
  return resp;
}

}  // namespace muond::client
