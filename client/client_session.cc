// Attaching a rank (Client::Attach) and the RankSession: its steps over shared memory or gRPC.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/daemon_call.h"
#include "client/shm_channel.h"
#include "client/span_placement.h"
#include "common/crc32c.h"
#include "common/grpc_status.h"
#include "common/job_spec_proto.h"
#include "common/status_macros.h"

namespace muond::client {
namespace {

using common::FromGrpcStatus;

using StepStream = grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>;

// Writes `req` (holding the StepBegin), then the gradient spans in chunks of at most kChunkBytes
// with a CRC32C each, then the StepEnd. Stops at the first failed write: the stream's status then
// says why.
void WriteGradients(StepStream* stream, const common::JobSpec& spec,
                    const std::vector<GradientSpan>& grads, v1::StepRequest* req,
                    double outside_sum_sq) {
  bool open = stream->Write(*req);
  for (size_t i = 0; open && i < grads.size(); ++i) {
    const GradientSpan& g = grads[i];
    const size_t esize = common::DTypeSize(spec.matrices[g.matrix].dtype);
    const size_t per_chunk = kChunkBytes / esize;  // elements
    const char* base = static_cast<const char*>(g.data);
    for (uint64_t at = 0; open && at < g.length; at += per_chunk) {
      const uint64_t n = std::min<uint64_t>(per_chunk, g.length - at);
      v1::DataChunk* c = req->mutable_gradient();
      c->set_matrix_index(g.matrix);
      c->set_element_offset(g.offset + at);
      c->set_data(base + at * esize, n * esize);
      c->set_crc32c(common::Crc32c(base + at * esize, n * esize));
      open = stream->Write(*req);
    }
  }
  if (open) {
    req->mutable_end()->set_outside_sum_sq(outside_sum_sq);
    open = stream->Write(*req);
  }
  stream->WritesDone();
}

// Places the update chunks of a gRPC step in the caller's update spans, where every byte must be
// covered exactly once, and keeps the StepDone. After the first bad chunk the others are read and
// dropped (the stream is drained to learn the daemon's status).
class UpdateAssembler {
 public:
  UpdateAssembler(const common::JobSpec& spec, const std::vector<UpdateSpan>& updates)
      : spec_(spec), updates_(updates), received_(updates.size(), 0) {}

  void Add(const v1::StepResponse& resp) {
    if (resp.kind_case() == v1::StepResponse::kDone) {
      result_.step = resp.done().step();
      result_.replayed = resp.done().replayed();
      result_.skipped = resp.done().skipped();
      result_.compute_seconds = resp.done().compute_seconds();
      result_.grad_sum_sq = resp.done().grad_sum_sq();
      result_.bytes_in = resp.done().bytes_in();
      result_.bytes_out = resp.done().bytes_out();
      done_ = true;
      return;
    }
    if (!bad_.ok() || resp.kind_case() != v1::StepResponse::kUpdate) return;
    bad_ = Place(resp.update());
  }

  // The step's result once the stream finished OK: the first bad chunk's error, INTERNAL without
  // a StepDone or when an update span was not filled.
  absl::StatusOr<StepResult> Result(int64_t step) const {
    RETURN_IF_ERROR(bad_);
    if (!done_) {
      return absl::InternalError(absl::StrCat("step ", step, ": stream ended without StepDone"));
    }
    // A skipped step sends no update: the caller's buffers are left as they were.
    for (size_t i = 0; i < updates_.size() && !result_.skipped; ++i) {
      if (received_[i] != updates_[i].length) {
        return absl::InternalError(absl::StrCat(
            "step ", step, ": update of matrix '", spec_.matrices[updates_[i].matrix].name,
            "' incomplete: ", received_[i], " of ", updates_[i].length, " elements"));
      }
    }
    return result_;
  }

 private:
  absl::Status Place(const v1::DataChunk& c) {
    if (c.matrix_index() >= spec_.matrices.size()) {
      return absl::DataLossError(
          absl::StrCat("update chunk for unknown matrix ", c.matrix_index()));
    }
    const common::MatrixSpec& ms = spec_.matrices[c.matrix_index()];
    if (common::Crc32c(c.data().data(), c.data().size()) != c.crc32c()) {
      return absl::DataLossError(absl::StrCat("update chunk of matrix '", ms.name, "' at element ",
                                              c.element_offset(), ": CRC32C mismatch"));
    }
    const size_t esize = common::DTypeSize(OutputDType(spec_, ms));
    if (c.data().size() % esize != 0) {
      return absl::DataLossError(absl::StrCat("update chunk of matrix '", ms.name, "' at element ",
                                              c.element_offset(), ": ", c.data().size(),
                                              " bytes is not a whole number of elements"));
    }
    const uint64_t n = c.data().size() / esize;
    for (size_t i = 0; i < updates_.size(); ++i) {
      const UpdateSpan& u = updates_[i];
      if (u.matrix == c.matrix_index() && c.element_offset() >= u.offset &&
          c.element_offset() + n <= u.offset + u.length) {
        std::memcpy(static_cast<char*>(u.data) + (c.element_offset() - u.offset) * esize,
                    c.data().data(), n * esize);
        received_[i] += n;
        return absl::OkStatus();
      }
    }
    return absl::InternalError(absl::StrCat("update chunk of matrix '", ms.name, "' elements [",
                                            c.element_offset(), ", ", c.element_offset() + n,
                                            ") matches no update span"));
  }

  const common::JobSpec& spec_;
  const std::vector<UpdateSpan>& updates_;
  std::vector<uint64_t> received_;  // elements, per update span
  absl::Status bad_;
  StepResult result_;
  bool done_ = false;
};

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

namespace {

// A shared-memory step's outcome (its whole buffer went in, its update came out).
absl::StatusOr<StepResult> SharedResult(const absl::StatusOr<ShmChannel::Ringing>& r,
                                        int64_t step, uint64_t buffer_bytes) {
  if (!r.ok()) return Annotate(r.status(), absl::StrCat("step ", step));
  StepResult result;
  result.step = r->step;
  result.replayed = r->replayed;
  result.skipped = r->skipped;
  result.compute_seconds = r->seconds;
  result.grad_sum_sq = r->grad_sum_sq;
  result.bytes_in = buffer_bytes;
  result.bytes_out = r->skipped ? 0 : buffer_bytes;
  return result;
}

}  // namespace

absl::StatusOr<StepResult> RankSession::StepInPlace(int64_t step) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  RETURN_IF_ERROR(CheckStepHyper(step));
  if (apply() && step >= 0) RETURN_IF_ERROR(WriteSharedHyper(step));  // Ring refuses step < 0
  if (step >= 0) RETURN_IF_ERROR(WriteSharedOutsideSumSq(step));
  return SharedResult(shm_->Ring(step), step, shm_->buffer_bytes());
}

absl::Status RankSession::PostPart(int64_t step, uint64_t byte_offset, uint64_t bytes,
                                   bool last) {
  if (shm_ == nullptr) {
    return absl::FailedPreconditionError(
        "steps in parts are a shared-memory feature; over gRPC the step stream sends the "
        "gradients chunk by chunk (StepBuffer, Step)");
  }
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("step ", step, " is negative"));
  if (parts_step_ != step) {  // the first part: the daemon reads the hyperparameters with it
    RETURN_IF_ERROR(CheckStepHyper(step));
    if (apply()) RETURN_IF_ERROR(WriteSharedHyper(step));
  }
  if (last) RETURN_IF_ERROR(WriteSharedOutsideSumSq(step));  // read with the last part
  absl::Status posted = shm_->Post(step, byte_offset, bytes, last);
  if (!posted.ok()) return Annotate(posted, absl::StrCat("step ", step));
  parts_step_ = last ? -1 : step;
  return absl::OkStatus();
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

absl::Status RankSession::WriteSharedOutsideSumSq(int64_t step) {
  if (!spec_.clips_outside_share()) return absl::OkStatus();
  const uint64_t at = shm_->hyper_byte_offset();
  const uint64_t size = shm_->buffer_bytes();
  bool fits = at % alignof(double) == 0 && at <= size &&
              common::shm::kOutsideSumSqBytes <= size - at;
  for (const ShmSpan& r : shm_->spans()) {
    const uint64_t begin = r.byte_offset;
    const uint64_t end = begin + r.length * common::DTypeSize(spec_.matrices[r.matrix].dtype);
    if (at < end && begin < at + common::shm::kOutsideSumSqBytes) fits = false;
  }
  if (!fits) {
    return absl::InternalError(absl::StrCat(
        "the daemon's shared-memory layout has no room for the step's outside sum of squares "
        "(8 bytes at byte ", at, " of a ", size, "-byte gradient buffer, clear of the gradients)"));
  }
  std::memcpy(shm_->GradientBuffer(step) + at, &outside_sum_sq_, sizeof(double));
  return absl::OkStatus();
}

absl::StatusOr<StepResult> RankSession::WaitParts(int64_t step) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  return SharedResult(shm_->WaitStep(step), step, shm_->buffer_bytes());
}

absl::Status RankSession::PartsProgress(int64_t step, double timeout_seconds,
                                        std::vector<bool>* ready, bool* ended) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  const int timeout_ms =
      timeout_seconds < 0 ? -1 : static_cast<int>(std::min(timeout_seconds, 3600.0) * 1e3);
  RETURN_IF_ERROR(shm_->WaitProgress(timeout_ms));
  *ended = shm_->StepEnded(step);
  ready->resize(shm_->spans().size());
  for (size_t i = 0; i < ready->size(); ++i) (*ready)[i] = shm_->SpanReady(i, step);
  if (*ended) {
    absl::Status outcome = shm_->StepOutcome(step);
    if (!outcome.ok()) return Annotate(outcome, absl::StrCat("step ", step));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> RankSession::StepShared(int64_t step,
                                                   const std::vector<GradientSpan>& grads,
                                                   const std::vector<UpdateSpan>& updates) {
  // Place every gradient span in the region; together they must cover the rank's spans exactly,
  // since the daemon reads the whole buffer.
  ASSIGN_OR_RETURN(View in, GradientView(step));
  const auto& regions = shm_->spans();
  std::vector<uint64_t> covered(regions.size(), 0);
  for (const GradientSpan& g : grads) {
    ASSIGN_OR_RETURN(const BufferPlace place,
                     PlaceInBuffer(regions, spec_, g.matrix, g.offset, g.length, "gradient",
                                   BufferLayout::kGradients));
    std::memcpy(in.data + place.byte_offset, g.data, place.bytes);
    covered[place.region] += g.length;
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    if (covered[i] != regions[i].length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "matrix '", spec_.matrices[regions[i].matrix].name, "': the gradient spans cover ",
          covered[i], " of the rank's ", regions[i].length, " elements at element ",
          regions[i].offset));
    }
  }
  // Check the update spans before the step: a step that ran cannot be taken back.
  const BufferLayout out_layout = apply() ? BufferLayout::kParameters : BufferLayout::kGradients;
  std::vector<BufferPlace> out_places;
  for (const UpdateSpan& u : updates) {
    ASSIGN_OR_RETURN(const BufferPlace place, PlaceInBuffer(regions, spec_, u.matrix, u.offset,
                                                            u.length, "update", out_layout));
    if (place.byte_offset + place.bytes > shm_->buffer_bytes()) {
      return absl::InternalError(absl::StrCat(
          "the daemon's shared-memory layout puts the update of matrix '",
          spec_.matrices[u.matrix].name, "' past the end of its ", shm_->buffer_bytes(),
          "-byte buffer"));
    }
    out_places.push_back(place);
  }
  ASSIGN_OR_RETURN(StepResult result, StepInPlace(step));
  const char* out = shm_->UpdateBuffer(step);
  for (size_t i = 0; i < updates.size(); ++i) {
    const UpdateSpan& u = updates[i];
    const BufferPlace& place = out_places[i];
    std::memcpy(u.data, out + place.byte_offset, place.bytes);
  }
  return result;
}

absl::StatusOr<StepResult> RankSession::StepOverGrpc(int64_t step,
                                                     const std::vector<GradientSpan>& grads,
                                                     const std::vector<UpdateSpan>& updates) {
  grpc::ClientContext ctx;
  SetToken(&ctx, token_);
  SetStreamJob(&ctx, spec_.job_id);
  std::unique_ptr<StepStream> stream = stub_->Step(&ctx);
  v1::StepRequest req;
  v1::StepBegin* begin = req.mutable_begin();
  begin->set_job_id(spec_.job_id);
  begin->set_rank(rank_);
  begin->set_session_id(session_id_);
  begin->set_step(step);
  if (hyper_) {
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      v1::GroupHyper* h = begin->add_hyper();
      h->set_group(spec_.groups[g].name);
      h->set_lr(hyper_->lr[g]);
      h->set_weight_decay(hyper_->weight_decay[g]);
    }
    begin->set_grad_divisor(hyper_->grad_divisor);
    if (global_clip_mode_ != 0) {
      begin->mutable_global_clip()->set_speculate(global_clip_mode_ == 1);
      begin->mutable_global_clip()->set_sum_sq(global_sum_sq_);
    }
  }
  for (uint32_t t = 0; t < absent_.size(); ++t) {
    if (absent_[t] != 0) begin->add_absent_tensors(t);
  }
  for (float v : max_logits_) begin->add_max_logits(v);
  WriteGradients(stream.get(), spec_, grads, &req,
                 spec_.clips_outside_share() ? outside_sum_sq_ : 0);
  UpdateAssembler assembler(spec_, updates);
  v1::StepResponse resp;
  while (stream->Read(&resp)) assembler.Add(resp);
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(stream->Finish()), absl::StrCat("step ", step)));
  return assembler.Result(step);
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
