// A rank's step over gRPC (RankSession::StepOverGrpc): the StepBegin with the step's
// hyperparameters, the gradients in CRC-checked chunks, then the update chunks placed in the
// caller's spans. Attaching and the transport-neutral steps are in client_session.cc.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/daemon_call.h"
#include "client/span_placement.h"
#include "common/crc32c.h"
#include "common/grpc_status.h"
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

}  // namespace

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

}  // namespace muond::client
