// A session's doorbell: the submissions the server reads off the session's ring, checks and hands
// to the job (a step, whole or in parts, or apply mode's initial parameters). The server's loop,
// its sessions' lifetimes and their end are in shm_server.cc; attaching is in shm_admission.cc.
#include <unistd.h>

#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "common/shm_protocol.h"
#include "common/shm_region.h"
#include "server/api/shm_server.h"
#include "server/api/shm_session.h"
#include "server/api/shm_wire.h"
#include "server/record/daemon_metrics.h"

namespace muond::server {

namespace shm = common::shm;

namespace {

// Apply mode: the step's hyperparameters in the step's buffer at hyper_byte_offset (lr and weight
// decay per group, the divisor, the global clip, the presence mask, QK-Clip's maxima), copied out
// of the peer's memory once: it may change them.
StepHyper ReadHyper(const ShmSession& s, const char* in_base) {
  StepHyper hyper;
  const size_t groups = s.job->spec().groups.size();
  std::vector<double> values(2 * groups + 3);
  std::memcpy(values.data(), in_base + s.hyper_byte_offset, values.size() * sizeof(double));
  hyper.lr.assign(values.begin(), values.begin() + groups);
  hyper.weight_decay.assign(values.begin() + groups, values.begin() + 2 * groups);
  hyper.grad_divisor = values[2 * groups];
  // The global clip's mode as a float64 (checked by the job: 0, 1 or 2; anything else, a NaN
  // included, becomes a value it refuses).
  const double mode = values[2 * groups + 1];
  hyper.clip_source = mode == 0   ? ClipSource::kLocal
                      : mode == 1 ? ClipSource::kSpeculate
                      : mode == 2 ? ClipSource::kGlobal
                                  : static_cast<ClipSource>(255);
  hyper.global_sum_sq = values[2 * groups + 2];
  const char* mask = in_base + s.hyper_byte_offset + values.size() * sizeof(double);
  hyper.absent.assign(mask, mask + s.job->spec().matrices.size());  // checked by the job
  // QK-Clip's per-head maxima (checked by the job: every one finite).
  const common::JobSpec& spec = s.job->spec();
  if (const size_t logits = spec.qk_clip.logits(); logits > 0) {
    hyper.max_logits.resize(logits);
    std::memcpy(
        hyper.max_logits.data(),
        in_base + s.hyper_byte_offset + common::shm::MaxLogitsOffset(groups, spec.matrices.size()),
        logits * sizeof(float));
  }
  return hyper;
}

// The completion of a step's submission: its bytes counted when it was not skipped, then the
// completion posted.
SharedDone StepDone(std::shared_ptr<CompletionChannel> channel, uint64_t seq, int64_t step,
                    uint64_t buffer_bytes) {
  return [channel, seq, step, buffer_bytes](const absl::Status& status, uint32_t flags,
                                            double seconds, double grad_sum_sq) {
    if (status.ok() && (flags & kDoneSkipped) == 0) {  // the whole buffer in, the update out
      RecordBytes(Transport::kShm, Direction::kIn, buffer_bytes);
      RecordBytes(Transport::kShm, Direction::kOut, buffer_bytes);
    }
    channel->Complete(seq, step, status, flags, seconds, grad_sum_sq);
  };
}

}  // namespace

void ShmServer::HandleDoorbell(const std::shared_ptr<ShmSession>& s) {
  uint64_t count = 0;
  if (read(s->doorbell, &count, sizeof(count)) != sizeof(count)) return;
  shm::Ring* ring = s->completions->ring();
  const uint64_t head = ring->header.sub_head.load(std::memory_order_acquire);
  if (absl::Status corrupt = shm_wire::CheckSubmissionHead(head, s->sub_tail); !corrupt.ok()) {
    EndSession(s->conn, std::string(corrupt.message()));
    return;
  }
  const std::string& job_id = s->job->id();
  while (s->sub_tail < head) {
    // Copy the entry out of shared memory before looking at it: the peer may change it.
    const shm::Submission sub = ring->subs[s->sub_tail % shm::kRingSlots];
    const uint64_t index = s->sub_tail++;
    ring->header.sub_tail.store(s->sub_tail, std::memory_order_release);
    const std::string where = absl::StrCat("job '", job_id, "' rank ", s->rank, " doorbell ", index,
                                           " (step ", sub.step, ")");
    const absl::Status bad = shm_wire::CheckSubmission(sub, index, s->session_id, s->buffer_bytes,
                                                       where, s->part_step, s->buffers);
    if (!bad.ok()) {
      // A malformed part of a step this session has open in parts ends that step; a malformed
      // first part refuses the step's later parts (up to its last) the same way.
      if (sub.kind == shm::kSubmitStepPart && sub.step >= 0 && sub.step != s->part_step) {
        s->part_step = sub.step;
        s->part_error = bad;
      }
      RefusePart(s, sub, bad);
      s->completions->Complete(sub.seq, sub.step, bad, false, 0);
      continue;
    }
    if (sub.kind == shm::kSubmitInitParams) {
      SubmitInitParams(s, sub.seq, where);
    } else {
      SubmitStep(s, sub, where);
    }
  }
}

void ShmServer::RefusePart(const std::shared_ptr<ShmSession>& s, const shm::Submission& sub,
                           const absl::Status& why) {
  if (s->part_step < 0 || sub.step != s->part_step) return;
  if (s->part_error.ok()) {
    s->part_error =
        s->job->RefuseSharedPart(s->rank, s->session_id, sub.step, s->regions.get(), why);
  }
  if (sub.kind == shm::kSubmitStep) {
    s->part_step = -1;  // the last part: a retry of the step starts afresh
    s->part_error = absl::OkStatus();
  }
}

absl::StatusOr<Job::SharedPart> ShmServer::PartSpans(const ShmSession& s,
                                                     const shm::Submission& sub,
                                                     const std::string& where) const {
  Job::SharedPart part;
  part.last = sub.kind == shm::kSubmitStep;
  const std::vector<common::ShardSpan>& spans = s.spans;
  const uint64_t begin = sub.offset;
  const uint64_t end = sub.offset + sub.size;  // CheckSubmission: inside the buffer
  for (size_t i = 0; i < spans.size(); ++i) {
    const uint64_t at = s.byte_offsets[i];
    const uint64_t bytes =
        spans[i].length * common::DTypeSize(s.job->spec().matrices[spans[i].matrix].dtype);
    if (at >= end || at + bytes <= begin) continue;
    if (at < begin || at + bytes > end) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": part [", begin, ", ", end, ") cuts matrix '",
          s.job->spec().matrices[spans[i].matrix].name, "' span at element ", spans[i].offset,
          " (bytes [", at, ", ", at + bytes, ") of the buffer); a part holds whole spans"));
    }
    part.spans.push_back(i);
  }
  return part;
}

// A part of a step: its spans (Job::SharedPart), or false when it was refused (the job, the step's
// later parts and the completion told).
bool ShmServer::TakePart(const std::shared_ptr<ShmSession>& s, const shm::Submission& sub,
                         const std::string& where, Job::SharedPart* part) {
  const bool first = sub.step != s->part_step;
  absl::Status refused;
  if (!first && !s->part_error.ok()) {
    // An earlier part of this step was refused, and the step with it.
    refused = absl::Status(s->part_error.code(),
                           absl::StrCat(where, ": an earlier part of the step was refused (",
                                        s->part_error.message(), ")"));
  } else if (absl::StatusOr<Job::SharedPart> spans = PartSpans(*s, sub, where); !spans.ok()) {
    refused = spans.status();
  } else {
    *part = *std::move(spans);
    part->continues = !first;
  }
  if (!refused.ok()) {
    if (first && sub.kind == shm::kSubmitStepPart) {
      // The job never saw the step's parts: the rest of them are refused here.
      s->part_step = sub.step;
      s->part_error = refused;
    }
    RefusePart(s, sub, refused);
    s->completions->Complete(sub.seq, sub.step, refused, false, 0);
    return false;
  }
  s->part_step = part->last ? -1 : sub.step;
  if (first || part->last) s->part_error = absl::OkStatus();
  return true;
}

void ShmServer::SubmitStep(const std::shared_ptr<ShmSession>& s, const shm::Submission& sub,
                           const std::string& where) {
  const bool in_parts = shm_wire::InParts(sub, s->part_step);
  Job::SharedPart part;
  if (in_parts && !TakePart(s, sub, where, &part)) return;
  const char* in_base = s->regions->in.data() + sub.buffer * s->buffer_bytes;
  char* out_base = s->regions->out.data() + sub.buffer * s->buffer_bytes;
  const bool apply = s->job->apply();
  std::vector<const char*> in;
  std::vector<char*> out;
  for (size_t i = 0; i < s->byte_offsets.size(); ++i) {
    in.push_back(in_base + s->byte_offsets[i]);
    out.push_back(out_base + (apply ? s->param_byte_offsets[i] : s->byte_offsets[i]));
  }
  std::optional<StepHyper> hyper;
  if (apply) hyper = ReadHyper(*s, in_base);
  // Update mode with max_grad_norm: the rank's share of the norm from the tensors outside the
  // job, read with its last part (copied out once; checked by the job).
  double outside_sum_sq = 0;
  if (s->job->spec().clips_outside_share() && (!in_parts || part.last)) {
    std::memcpy(&outside_sum_sq, in_base + s->hyper_byte_offset, sizeof(double));
    part.outside_sum_sq = outside_sum_sq;
  }
  const int64_t step = sub.step;
  SharedDone done = StepDone(s->completions, sub.seq, step, s->buffer_bytes);
  SharedProgress progress;
  progress.words = reinterpret_cast<int64_t*>(s->regions->out.data() + s->progress_byte_offset);
  progress.notify = [channel = s->completions] { channel->Notify(); };
  absl::Status st;
  if (!in_parts) {
    st = s->job->SubmitShared(s->rank, s->session_id, step, in, out, s->regions, std::move(done),
                              hyper ? &*hyper : nullptr, std::move(progress), outside_sum_sq);
  } else {
    st = s->job->SubmitSharedPart(s->rank, s->session_id, step, part, in, out, s->regions,
                                  std::move(done), hyper ? &*hyper : nullptr, std::move(progress));
    if (!st.ok() && !part.last) {
      s->part_error = st;  // the later parts of the step are refused with it
      s->part_step = step;
    }
    if (st.ok() && !part.last) s->completions->Complete(sub.seq, step, absl::OkStatus(), false, 0);
  }
  if (!st.ok()) s->completions->Complete(sub.seq, step, st, false, 0);
}

void ShmServer::SubmitInitParams(const std::shared_ptr<ShmSession>& s, uint64_t seq,
                                 const std::string& where) {
  if (!s->job->apply()) {
    s->completions->Complete(seq, -1,
                             absl::FailedPreconditionError(absl::StrCat(
                                 where, ": the job is in mode 'update' and holds no parameters")),
                             false, 0);
    return;
  }
  if (s->init_running->exchange(true)) {
    s->completions->Complete(seq, -1,
                             absl::FailedPreconditionError(absl::StrCat(
                                 where, ": an upload of initial parameters is already running")),
                             false, 0);
    return;
  }
  std::vector<const char*> in;
  for (uint64_t at : s->param_byte_offsets) in.push_back(s->regions->in.data() + at);
  // Off this thread (it serves every session): the conversion into the masters takes as long as
  // the rank's partition is large. The regions stay mapped while it runs.
  std::thread([job = s->job, rank = s->rank, session = s->session_id, in = std::move(in),
               regions = s->regions, channel = s->completions, running = s->init_running, seq] {
    absl::StatusOr<uint64_t> done = job->InitParams(rank, session, in, /*float32=*/false);
    running->store(false);
    channel->Complete(seq, -1, done.status(), false, 0);
  }).detach();
}

}  // namespace muond::server
