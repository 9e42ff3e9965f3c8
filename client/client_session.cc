// Attaching a rank (Client::Attach) and the RankSession: its life (detach, the session watch) and
// its transport-neutral steps (Step, StepBuffer, StepTensors), which run over shared memory
// (client_session_shm.cc) or gRPC (client_session_grpc.cc).
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/daemon_call.h"
#include "client/shm_channel.h"
#include "client/span_placement.h"
#include "common/grpc_status.h"
#include "common/job_spec_proto.h"
#include "common/status_macros.h"

namespace muond::client {
namespace {

using common::FromGrpcStatus;

// INVALID_ARGUMENT naming the matrix when `g` does not have the shape, dtype and size of the
// whole matrix `ms`.
absl::Status CheckWholeMatrixGradient(const NamedTensor& g, const common::MatrixSpec& ms) {
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
  return absl::OkStatus();
}

}  // namespace

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
        std::unique_ptr<RankSession> session(
            new RankSession(stub_, token, (*channel)->spec(), rank, (*channel)->session_id(),
                            (*channel)->next_step_at_attach()));
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
  return AttachOverGrpc(job_id, rank, token, takeover);
}

absl::StatusOr<std::unique_ptr<RankSession>> Client::AttachOverGrpc(const std::string& job_id,
                                                                    int rank,
                                                                    const std::string& token,
                                                                    bool takeover) {
  ASSIGN_OR_RETURN(v1::JobStatus status, GetJob(job_id, token));
  ASSIGN_OR_RETURN(common::JobSpec spec, common::JobSpecFromProto(status.spec()));
  if (rank < 0 || rank >= spec.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("job '", job_id, "': rank ", rank,
                                                   " out of range [0, ", spec.world_size, ")"));
  }
  v1::AttachRankRequest req;
  req.set_job_id(job_id);
  req.set_rank(rank);
  req.set_takeover(takeover);
  ASSIGN_OR_RETURN(const v1::AttachRankResponse resp,
                   CallWithToken(*stub_, &v1::Muond::Stub::AttachRank, token, req, "AttachRank"));
  std::unique_ptr<RankSession> session(new RankSession(stub_, token, std::move(spec), rank,
                                                       resp.session_id(), resp.next_step()));
  session->attached_ = true;
  v1::WatchSessionRequest watch;
  watch.set_job_id(job_id);
  watch.set_rank(rank);
  watch.set_session_id(resp.session_id());
  session->watch_ = std::make_unique<SessionWatch>(stub_.get(), token, std::move(watch));
  return session;
}

RankSession::RankSession(std::shared_ptr<v1::Muond::Stub> stub, std::string token,
                         common::JobSpec spec, int rank, uint64_t session_id, int64_t next_step)
    : stub_(std::move(stub)),
      token_(std::move(token)),
      spec_(std::move(spec)),
      rank_(rank),
      session_id_(session_id),
      next_step_(next_step),
      spans_(common::RankSpans(spec_, rank_)) {}

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

absl::Status RankSession::SetOutsideSumSq(double sum_sq) {
  if (!spec_.clips_outside_share()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetOutsideSumSq: job '", spec_.job_id,
        "' does not clip in mode 'update' (max_grad_norm 0, or mode 'apply', where the daemon "
        "holds every tensor)"));
  }
  // A non-finite sum is a non-finite gradient: the daemon applies the job's rule to it (refuse,
  // or "skip" the step on every rank).
  if (sum_sq < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetOutsideSumSq: the sum of squares ", sum_sq, " must be >= 0"));
  }
  outside_sum_sq_ = sum_sq;
  return absl::OkStatus();
}

absl::StatusOr<StepResult> RankSession::Step(int64_t step, const std::vector<GradientSpan>& grads,
                                             const std::vector<UpdateSpan>& updates) {
  RETURN_IF_ERROR(CheckMatrixIndices(grads, spec_, "gradient"));
  RETURN_IF_ERROR(CheckMatrixIndices(updates, spec_, "update"));
  RETURN_IF_ERROR(CheckStepHyper(step));
  if (shm_ != nullptr) return StepShared(step, grads, updates);
  return StepOverGrpc(step, grads, updates);
}

uint64_t RankSession::buffer_elements() const { return common::RankBufferElements(spec_, rank_); }

absl::StatusOr<StepResult> RankSession::StepBuffer(int64_t step, const void* grads, void* updates) {
  const common::DType dtype = spec_.matrices[0].dtype;
  const common::DType out_dtype = OutputDType(spec_, spec_.matrices[0]);
  for (const common::MatrixSpec& ms : spec_.matrices) {
    if (ms.dtype != dtype) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", spec_.job_id, "' mixes dtypes (matrix '", ms.name,
          "'); a flat rank buffer needs one dtype: push spans with Step()"));
    }
    if (OutputDType(spec_, ms) != out_dtype) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", spec_.job_id, "' mixes param dtypes (tensor '", ms.name,
          "'); a flat rank buffer needs one param dtype: push spans with Step()"));
    }
  }
  const size_t esize = common::DTypeSize(dtype);
  const size_t out_esize = common::DTypeSize(out_dtype);
  std::memset(updates, 0, buffer_elements() * out_esize);
  std::vector<GradientSpan> in;
  std::vector<UpdateSpan> out;
  for (const common::ShardSpan& s : spans_) {
    in.push_back({s.matrix, s.offset, static_cast<const char*>(grads) + s.rank_offset * esize,
                  s.length});
    out.push_back({s.matrix, s.offset, static_cast<char*>(updates) + s.rank_offset * out_esize,
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
    RETURN_IF_ERROR(CheckWholeMatrixGradient(g, ms));
    const uint64_t numel = static_cast<uint64_t>(ms.numel());
    updates[m].name = ms.name;
    updates[m].dtype = OutputDType(spec_, ms);
    updates[m].shape = ms.shape;
    updates[m].data.resize(numel * common::DTypeSize(updates[m].dtype));
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
