// MuondService::ExportState: a job's full state by tensor name (Job::ExportState), streamed as a
// header and chunks of each array's data as held, or as float32 on request (muond.proto
// ExportStateChunk). The client writes the files (client/client_export_state.cc,
// common/state_export.h).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/grpc_status.h"
#include "common/job_spec_proto.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/api/muond_service.h"
#include "server/engine/heap_trimmer.h"
#include "server/record/daemon_metrics.h"

namespace muond::server {
namespace {

constexpr size_t kChunkBytes = size_t{4} << 20;

// `lease`: the stream's admission; writes run with its idle clock (a reader that stops reading is
// cancelled after --stream-idle-seconds). Job::ExportState holds nothing of the job while it
// calls `header` and `sink`.
absl::Status RunExportState(const std::shared_ptr<Job>& job, grpc::ServerContext* ctx,
                            const v1::ExportStateRequest* req,
                            grpc::ServerWriter<v1::ExportStateChunk>* writer,
                            StreamGuard::Lease& lease) {
  std::optional<checkpoint::Selector> from;
  if (req->generation() < 0 || (req->has_step() && req->step() < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("job '", job->id(), "': export: generation ",
                                                   req->generation(), " / step ", req->step(),
                                                   " must not be negative"));
  }
  if (req->generation() > 0 || req->has_step()) {
    from.emplace();
    from->generation = req->generation() > 0 ? req->generation() : -1;
    from->step = req->has_step() ? req->step() : -1;
  }
  const auto gone = [&] {
    return absl::CancelledError(absl::StrCat(
        "job '", job->id(), "': the client went away during the export", lease.HowEnded()));
  };
  const auto write = [&](const v1::ExportStateChunk& out) {
    return !ctx->IsCancelled() && lease.Await([&] { return writer->Write(out); });
  };
  std::vector<uint64_t> bytes;  // per array: the bytes of its data
  auto header = [&](const Job::ExportedState& state) -> absl::Status {
    v1::ExportStateChunk out;
    v1::ExportStateHeader* h = out.mutable_header();
    *h->mutable_spec() = common::JobSpecToProto(job->spec());
    h->set_step(state.step);
    h->set_generation(state.generation);
    for (size_t a = 0; a < state.arrays.size(); ++a) {
      v1::StateArray* sa = h->add_arrays();
      sa->set_name(state.arrays[a].name);
      sa->set_tensor(state.tensor_of[a]);
      for (int64_t d : state.arrays[a].shape) sa->add_shape(d);
      sa->set_dtype(std::string(common::StateDTypeName(state.arrays[a].dtype)));
      sa->set_non_negative(state.arrays[a].dtype == common::StateDType::kInt8 &&
                           state.arrays[a].non_negative);
      bytes.push_back(state.arrays[a].stored_bytes());
    }
    for (int64_t t : state.tensor_steps) h->add_tensor_steps(t);
    if (!write(out)) return gone();
    return absl::OkStatus();
  };
  v1::ExportStateChunk out;
  auto sink = [&](size_t a, const std::vector<float>& w) -> absl::Status {
    const uint64_t size = bytes[a];
    if (size > w.size() * sizeof(float)) {
      return absl::InternalError(absl::StrCat("job '", job->id(), "': export: array ", a, " holds ",
                                              w.size() * sizeof(float), " bytes, not ", size));
    }
    const char* data = reinterpret_cast<const char*>(w.data());
    for (uint64_t at = 0; at < size; at += kChunkBytes) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, size - at));
      v1::DataChunk* c = out.mutable_data();
      c->set_matrix_index(static_cast<uint32_t>(a));
      c->set_element_offset(at);
      c->set_data(data + at, n);
      c->set_crc32c(common::Crc32c(c->data().data(), c->data().size()));
      if (!write(out)) return gone();
      RecordBytes(Transport::kGrpc, Direction::kOut, n);
    }
    return absl::OkStatus();
  };
  return job->ExportState(from, req->float32(), header, sink);
}

}  // namespace

grpc::Status MuondService::ExportState(grpc::ServerContext* ctx, const v1::ExportStateRequest* req,
                                       grpc::ServerWriter<v1::ExportStateChunk>* writer) {
  // The snapshot and the chunks are heap memory: trimmed back to the system when the export
  // ends (also when it outlives its deleted job), as a step's buffers are.
  HeapTrimmer::Activity activity;
  absl::StatusOr<std::shared_ptr<Job>> job = Authorize(ctx, req->job_id());
  absl::Status s = job.status();
  if (s.ok()) {
    // Deleting the job cancels the export (issue 32, item 6).
    const auto cancel_on_delete = (*job)->OnDelete([ctx] { ctx->TryCancel(); });
    auto lease = streams_.Admit(ctx, (*job)->id(), (*job)->spec().world_size, "ExportState");
    s = lease.ok() ? RunExportState(*job, ctx, req, writer, **lease) : lease.status();
  }
  if (!s.ok()) {
    MUOND_LOG(DEBUG) << "ExportState: " << s;
    RecordRpcError("ExportState", s.code());
  }
  return common::ToGrpcStatus(s);
}

}  // namespace muond::server
