#include "client/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/shm_channel.h"
#include "common/crc32c.h"
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
constexpr size_t kChunkBytes = size_t{4} << 20;
constexpr int kMaxMessageBytes = (4 << 20) + (64 << 10);

void SetToken(grpc::ClientContext* ctx, const std::string& token) {
  ctx->AddMetadata(kTokenKey, token);
}

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

// Prefixes a daemon error with the operation, keeping its code.
absl::Status Annotate(const absl::Status& s, const std::string& what) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

}  // namespace

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
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::DeleteJobRequest req;
  req.set_job_id(job_id);
  v1::DeleteJobResponse resp;
  return Annotate(FromGrpcStatus(stub_->DeleteJob(&ctx, req, &resp)), "DeleteJob");
}

absl::Status Client::ResetJob(const std::string& job_id, const std::string& token,
                              int64_t next_step) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::ResetJobRequest req;
  req.set_job_id(job_id);
  req.set_next_step(next_step);
  v1::ResetJobResponse resp;
  return Annotate(FromGrpcStatus(stub_->ResetJob(&ctx, req, &resp)), "ResetJob");
}

absl::StatusOr<v1::CheckpointInfo> Client::SaveCheckpoint(const std::string& job_id,
                                                          const std::string& token) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::SaveCheckpointRequest req;
  req.set_job_id(job_id);
  v1::CheckpointInfo resp;
  RETURN_IF_ERROR(
      Annotate(FromGrpcStatus(stub_->SaveCheckpoint(&ctx, req, &resp)), "SaveCheckpoint"));
  return resp;
}

absl::StatusOr<v1::LoadCheckpointResponse> Client::LoadCheckpoint(const std::string& job_id,
                                                                  const std::string& token,
                                                                  int64_t generation,
                                                                  int64_t step) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::LoadCheckpointRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  if (step >= 0) req.set_step(step);
  v1::LoadCheckpointResponse resp;
  RETURN_IF_ERROR(
      Annotate(FromGrpcStatus(stub_->LoadCheckpoint(&ctx, req, &resp)), "LoadCheckpoint"));
  return resp;
}

absl::StatusOr<std::vector<v1::CheckpointInfo>> Client::ListCheckpoints(
    const std::string& job_id, const std::string& token) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::ListCheckpointsRequest req;
  req.set_job_id(job_id);
  v1::ListCheckpointsResponse resp;
  RETURN_IF_ERROR(
      Annotate(FromGrpcStatus(stub_->ListCheckpoints(&ctx, req, &resp)), "ListCheckpoints"));
  return std::vector<v1::CheckpointInfo>(resp.generations().begin(), resp.generations().end());
}

absl::StatusOr<v1::JobStatus> Client::GetJob(const std::string& job_id, const std::string& token) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::GetJobRequest req;
  req.set_job_id(job_id);
  v1::JobStatus resp;
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(stub_->GetJob(&ctx, req, &resp)), "GetJob"));
  return resp;
}

absl::StatusOr<std::vector<v1::JobStatus>> Client::ListJobs() {
  ASSIGN_OR_RETURN(const v1::ListJobsResponse resp, ListJobsWithBroken());
  return std::vector<v1::JobStatus>(resp.jobs().begin(), resp.jobs().end());
}

absl::StatusOr<v1::ListJobsResponse> Client::ListJobsWithBroken() {
  grpc::ClientContext ctx;
  v1::ListJobsRequest req;
  v1::ListJobsResponse resp;
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(stub_->ListJobs(&ctx, req, &resp)), "ListJobs"));
  return resp;
}

absl::StatusOr<Transport> ParseTransport(const std::string& name) {
  if (name == "auto") return Transport::kAuto;
  if (name == "shm") return Transport::kShm;
  if (name == "grpc") return Transport::kGrpc;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown transport '", name, "' (accepted: auto, shm, grpc)"));
}

// Holds a WatchSession call open on its own thread for as long as the session lives.
class SessionWatch {
 public:
  SessionWatch(v1::Muond::Stub* stub, const std::string& token, v1::WatchSessionRequest req) {
    SetToken(&ctx_, token);
    reader_ = stub->WatchSession(&ctx_, req);
    thread_ = std::thread([this] {
      v1::SessionEvent event;
      while (reader_->Read(&event)) {
      }
      (void)reader_->Finish();
    });
  }
  ~SessionWatch() {
    ctx_.TryCancel();
    thread_.join();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::SessionEvent>> reader_;
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<RankSession>> Client::Attach(const std::string& job_id, int rank,
                                                            const std::string& token,
                                                            bool takeover, Transport transport) {
  if (transport != Transport::kGrpc) {
    const std::string path = ShmSocketFor(address_);
    if (path.empty() && transport == Transport::kShm) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared memory needs a unix:// daemon address on this host, not ", address_));
    }
    if (!path.empty()) {
      auto channel = ShmChannel::Attach(path, job_id, rank, token, takeover);
      if (channel.ok()) {
        std::unique_ptr<RankSession> session(new RankSession());
        session->stub_ = stub_;
        session->token_ = token;
        session->spec_ = (*channel)->spec();
        session->spans_ = common::RankSpans(session->spec_, rank);
        session->rank_ = rank;
        session->session_id_ = (*channel)->session_id();
        session->next_step_ = (*channel)->next_step_at_attach();
        session->shm_ = *std::move(channel);
        return session;
      }
      // auto falls back to gRPC only when the shared-memory socket cannot be reached or the
      // daemon has no shared-memory session to spare (its session limit, its descriptors).
      if (transport == Transport::kShm || !(absl::IsUnavailable(channel.status()) ||
                                            absl::IsResourceExhausted(channel.status()))) {
        return Annotate(channel.status(), "AttachRank (shared memory)");
      }
    }
  }
  ASSIGN_OR_RETURN(v1::JobStatus status, GetJob(job_id, token));
  ASSIGN_OR_RETURN(common::JobSpec spec, common::JobSpecFromProto(status.spec()));
  if (rank < 0 || rank >= spec.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("job '", job_id, "': rank ", rank,
                                                   " out of range [0, ", spec.world_size, ")"));
  }
  grpc::ClientContext ctx;
  SetToken(&ctx, token);
  v1::AttachRankRequest req;
  req.set_job_id(job_id);
  req.set_rank(rank);
  req.set_takeover(takeover);
  v1::AttachRankResponse resp;
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(stub_->AttachRank(&ctx, req, &resp)), "AttachRank"));
  std::unique_ptr<RankSession> session(new RankSession());
  session->stub_ = stub_;
  session->token_ = token;
  session->spans_ = common::RankSpans(spec, rank);
  session->spec_ = std::move(spec);
  session->rank_ = rank;
  session->session_id_ = resp.session_id();
  session->next_step_ = resp.next_step();
  session->attached_ = true;
  v1::WatchSessionRequest watch;
  watch.set_job_id(job_id);
  watch.set_rank(rank);
  watch.set_session_id(resp.session_id());
  session->watch_ = std::make_unique<SessionWatch>(stub_.get(), token, std::move(watch));
  return session;
}

RankSession::~RankSession() {
  if (attached_ || shm_ != nullptr) (void)Detach();
}

Transport RankSession::transport() const {
  return shm_ != nullptr ? Transport::kShm : Transport::kGrpc;
}

absl::Status RankSession::Detach() {
  if (shm_ != nullptr) {
    shm_.reset();  // the daemon ends the session when the socket closes
    return absl::OkStatus();
  }
  if (!attached_) return absl::OkStatus();
  attached_ = false;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  SetToken(&ctx, token_);
  v1::DetachRankRequest req;
  req.set_job_id(spec_.job_id);
  req.set_rank(rank_);
  req.set_session_id(session_id_);
  v1::DetachRankResponse resp;
  absl::Status s = Annotate(FromGrpcStatus(stub_->DetachRank(&ctx, req, &resp)), "DetachRank");
  watch_.reset();  // after the detach: the daemon sees a session that already ended
  return s;
}

absl::StatusOr<RankSession::View> RankSession::GradientView(int64_t step) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  if (step < 0) return absl::InvalidArgumentError("negative step");
  return View{shm_->GradientBuffer(step), shm_->buffer_bytes()};
}

absl::StatusOr<RankSession::View> RankSession::UpdateView(int64_t step) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  if (step < 0) return absl::InvalidArgumentError("negative step");
  return View{const_cast<char*>(shm_->UpdateBuffer(step)), shm_->buffer_bytes()};
}

absl::StatusOr<StepResult> RankSession::StepInPlace(int64_t step) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  auto r = shm_->Ring(step);
  if (!r.ok()) return Annotate(r.status(), absl::StrCat("step ", step));
  StepResult result;
  result.step = r->step;
  result.replayed = r->replayed;
  result.compute_seconds = r->seconds;
  result.bytes_in = shm_->buffer_bytes();
  result.bytes_out = shm_->buffer_bytes();
  return result;
}

absl::StatusOr<StepResult> RankSession::StepShared(int64_t step,
                                                   const std::vector<GradientSpan>& grads,
                                                   const std::vector<UpdateSpan>& updates) {
  // Place every gradient span in the region; together they must cover the rank's spans exactly,
  // since the daemon reads the whole buffer.
  ASSIGN_OR_RETURN(View in, GradientView(step));
  const auto& regions = shm_->spans();
  std::vector<uint64_t> covered(regions.size(), 0);
  auto locate = [&](uint32_t matrix, uint64_t offset, uint64_t length) -> int {
    for (size_t i = 0; i < regions.size(); ++i) {
      const ShmSpan& r = regions[i];
      if (r.matrix == matrix && offset >= r.offset && offset - r.offset <= r.length &&
          length <= r.length - (offset - r.offset)) {
        return static_cast<int>(i);
      }
    }
    return -1;
  };
  for (const GradientSpan& g : grads) {
    const int i = locate(g.matrix, g.offset, g.length);
    if (i < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient span of matrix ", g.matrix, " elements [", g.offset, ", ", g.offset + g.length,
          ") is outside the rank's shard"));
    }
    const size_t esize = common::DTypeSize(spec_.matrices[g.matrix].dtype);
    std::memcpy(in.data + regions[i].byte_offset + (g.offset - regions[i].offset) * esize, g.data,
                g.length * esize);
    covered[i] += g.length;
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    if (covered[i] != regions[i].length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "matrix '", spec_.matrices[regions[i].matrix].name, "': the gradient spans cover ",
          covered[i], " of the rank's ", regions[i].length, " elements at element ",
          regions[i].offset));
    }
  }
  ASSIGN_OR_RETURN(StepResult result, StepInPlace(step));
  const char* out = shm_->UpdateBuffer(step);
  for (const UpdateSpan& u : updates) {
    const int i = locate(u.matrix, u.offset, u.length);
    if (i < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "update span of matrix ", u.matrix, " elements [", u.offset, ", ", u.offset + u.length,
          ") is outside the rank's shard"));
    }
    const size_t esize = common::DTypeSize(spec_.matrices[u.matrix].dtype);
    std::memcpy(u.data, out + regions[i].byte_offset + (u.offset - regions[i].offset) * esize,
                u.length * esize);
  }
  return result;
}

absl::StatusOr<StepResult> RankSession::Step(int64_t step, const std::vector<GradientSpan>& grads,
                                             const std::vector<UpdateSpan>& updates) {
  for (const GradientSpan& g : grads) {
    if (g.matrix >= spec_.matrices.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient span: matrix index ", g.matrix, " out of range"));
    }
  }
  for (const UpdateSpan& u : updates) {
    if (u.matrix >= spec_.matrices.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("update span: matrix index ", u.matrix, " out of range"));
    }
  }
  if (shm_ != nullptr) return StepShared(step, grads, updates);
  grpc::ClientContext ctx;
  SetToken(&ctx, token_);
  auto stream = stub_->Step(&ctx);
  v1::StepRequest req;
  v1::StepBegin* begin = req.mutable_begin();
  begin->set_job_id(spec_.job_id);
  begin->set_rank(rank_);
  begin->set_session_id(session_id_);
  begin->set_step(step);
  bool open = stream->Write(req);
  for (size_t i = 0; open && i < grads.size(); ++i) {
    const GradientSpan& g = grads[i];
    const size_t esize = common::DTypeSize(spec_.matrices[g.matrix].dtype);
    const size_t per_chunk = kChunkBytes / esize;  // elements
    const char* base = static_cast<const char*>(g.data);
    for (uint64_t at = 0; open && at < g.length; at += per_chunk) {
      const uint64_t n = std::min<uint64_t>(per_chunk, g.length - at);
      v1::DataChunk* c = req.mutable_gradient();
      c->set_matrix_index(g.matrix);
      c->set_element_offset(g.offset + at);
      c->set_data(base + at * esize, n * esize);
      c->set_crc32c(common::Crc32c(base + at * esize, n * esize));
      open = stream->Write(req);
    }
  }
  if (open) {
    req.mutable_end();
    open = stream->Write(req);
  }
  stream->WritesDone();
  // Update chunks land in the caller's spans; every byte must be covered exactly once.
  std::vector<uint64_t> received(updates.size(), 0);
  absl::Status bad;
  StepResult result;
  bool done = false;
  v1::StepResponse resp;
  while (stream->Read(&resp)) {
    if (resp.kind_case() == v1::StepResponse::kDone) {
      result.step = resp.done().step();
      result.replayed = resp.done().replayed();
      result.compute_seconds = resp.done().compute_seconds();
      result.bytes_in = resp.done().bytes_in();
      result.bytes_out = resp.done().bytes_out();
      done = true;
      continue;
    }
    if (!bad.ok() || resp.kind_case() != v1::StepResponse::kUpdate) continue;
    const v1::DataChunk& c = resp.update();
    if (c.matrix_index() >= spec_.matrices.size()) {
      bad = absl::DataLossError(absl::StrCat("update chunk for unknown matrix ", c.matrix_index()));
      continue;
    }
    if (common::Crc32c(c.data().data(), c.data().size()) != c.crc32c()) {
      bad = absl::DataLossError(absl::StrCat("update chunk of matrix '",
                                             spec_.matrices[c.matrix_index()].name,
                                             "' at element ", c.element_offset(),
                                             ": CRC32C mismatch"));
      continue;
    }
    const size_t esize = common::DTypeSize(spec_.matrices[c.matrix_index()].dtype);
    const uint64_t n = c.data().size() / esize;
    bool placed = false;
    for (size_t i = 0; i < updates.size(); ++i) {
      const UpdateSpan& u = updates[i];
      if (u.matrix == c.matrix_index() && c.element_offset() >= u.offset &&
          c.element_offset() + n <= u.offset + u.length) {
        std::memcpy(static_cast<char*>(u.data) + (c.element_offset() - u.offset) * esize,
                    c.data().data(), n * esize);
        received[i] += n;
        placed = true;
        break;
      }
    }
    if (!placed) {
      bad = absl::InternalError(absl::StrCat(
          "update chunk of matrix '", spec_.matrices[c.matrix_index()].name, "' elements [",
          c.element_offset(), ", ", c.element_offset() + n, ") matches no update span"));
    }
  }
  absl::Status s = FromGrpcStatus(stream->Finish());
  RETURN_IF_ERROR(Annotate(s, absl::StrCat("step ", step)));
  RETURN_IF_ERROR(bad);
  if (!done) return absl::InternalError(absl::StrCat("step ", step, ": stream ended without StepDone"));
  for (size_t i = 0; i < updates.size(); ++i) {
    if (received[i] != updates[i].length) {
      return absl::InternalError(absl::StrCat(
          "step ", step, ": update of matrix '", spec_.matrices[updates[i].matrix].name,
          "' incomplete: ", received[i], " of ", updates[i].length, " elements"));
    }
  }
  return result;
}

uint64_t RankSession::buffer_elements() const { return common::RankBufferElements(spec_, rank_); }

absl::StatusOr<StepResult> RankSession::StepBuffer(int64_t step, const void* grads, void* updates) {
  const common::DType dtype = spec_.matrices[0].dtype;
  for (const common::MatrixSpec& ms : spec_.matrices) {
    if (ms.dtype != dtype) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", spec_.job_id, "' mixes dtypes (matrix '", ms.name,
          "'); a flat rank buffer needs one dtype: push spans with Step()"));
    }
  }
  const size_t esize = common::DTypeSize(dtype);
  std::memset(updates, 0, buffer_elements() * esize);
  std::vector<GradientSpan> in;
  std::vector<UpdateSpan> out;
  for (const common::ShardSpan& s : spans_) {
    in.push_back({s.matrix, s.offset, static_cast<const char*>(grads) + s.rank_offset * esize,
                  s.length});
    out.push_back({s.matrix, s.offset, static_cast<char*>(updates) + s.rank_offset * esize,
                   s.length});
  }
  return Step(step, in, out);
}

absl::StatusOr<std::vector<NamedTensor>> RankSession::StepTensors(
    int64_t step, const std::vector<NamedTensor>& grads, StepResult* result) {
  if (spec_.zero_stage != 0 || !spec_.explicit_layout.empty()) {
    return absl::FailedPreconditionError(
        "whole-matrix steps need a zero_stage 0 job without an explicit layout; push the rank's "
        "spans with Step() or StepBuffer()");
  }
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!by_name.emplace(grads[i].name, i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient '", grads[i].name, "' given twice"));
    }
  }
  std::vector<GradientSpan> in;
  std::vector<UpdateSpan> out;
  std::vector<NamedTensor> updates(spec_.matrices.size());
  for (uint32_t m = 0; m < spec_.matrices.size(); ++m) {
    const common::MatrixSpec& ms = spec_.matrices[m];
    auto it = by_name.find(ms.name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient for matrix '", ms.name, "' is missing"));
    }
    const NamedTensor& g = grads[it->second];
    by_name.erase(it);
    if (g.shape != ms.shape) {
      std::string got, want;
      for (int64_t d : g.shape) absl::StrAppend(&got, got.empty() ? "" : ", ", d);
      for (int64_t d : ms.shape) absl::StrAppend(&want, want.empty() ? "" : ", ", d);
      return absl::InvalidArgumentError(absl::StrCat("gradient '", ms.name, "': shape [", got,
                                                     "] does not match the job's [", want, "]"));
    }
    if (g.dtype != ms.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient '", ms.name, "': dtype ", std::string(common::DTypeName(g.dtype)),
          " does not match the job's ", std::string(common::DTypeName(ms.dtype))));
    }
    const uint64_t numel = static_cast<uint64_t>(ms.numel());
    if (g.data.size() != numel * common::DTypeSize(ms.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("gradient '", ms.name, "': ", g.data.size(),
                                                     " bytes for ", numel, " elements"));
    }
    updates[m].name = ms.name;
    updates[m].dtype = ms.dtype;
    updates[m].shape = ms.shape;
    updates[m].data.resize(g.data.size());
    in.push_back({m, 0, g.data.data(), numel});
    out.push_back({m, 0, updates[m].data.data(), numel});
  }
  if (!by_name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("gradient '", by_name.begin()->first,
                                                   "' is not a matrix of job '", spec_.job_id,
                                                   "'"));
  }
  ASSIGN_OR_RETURN(StepResult r, Step(step, in, out));
  if (result != nullptr) *result = r;
  return updates;
}

}  // namespace muond::client
