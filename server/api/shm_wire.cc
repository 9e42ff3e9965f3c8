#include "server/api/shm_wire.h"

#include "absl/strings/str_cat.h"

namespace muond::server::shm_wire {

namespace shm = common::shm;

absl::StatusOr<v1::ShmAttachRequest> ParseAttachRequest(const char* data, size_t full,
                                                        size_t limit) {
  if (full > limit) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory attach request of ", full,
                                                   " bytes is larger than the limit of ", limit,
                                                   " bytes"));
  }
  if (full == 0) return absl::InvalidArgumentError("empty shared-memory attach request");
  v1::ShmAttachRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(full))) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed shared-memory attach request (", full, " bytes)"));
  }
  return req;
}

absl::Status CheckSubmissionHead(uint64_t head, uint64_t tail) {
  if (head < tail || head - tail > shm::kRingSlots) {
    return absl::FailedPreconditionError(
        absl::StrCat("corrupt submission ring (head ", head, ", tail ", tail, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckSubmission(const shm::Submission& sub, uint64_t index, uint64_t session_id,
                             uint64_t buffer_bytes, const std::string& where, int64_t part_step,
                             uint32_t buffers) {
  if (sub.seq != index) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": sequence ", sub.seq, " does not match its slot ", index));
  }
  if (sub.generation != session_id) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": stale generation ", sub.generation,
                                                      " (the session's is ", session_id, ")"));
  }
  const bool step_kind = sub.kind == shm::kSubmitStep || sub.kind == shm::kSubmitStepPart;
  if (!step_kind && sub.kind != shm::kSubmitInitParams) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": unknown submission kind ", sub.kind));
  }
  if (sub.kind == shm::kSubmitInitParams && (sub.step != -1 || sub.buffer != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": an initial-parameter submission has step -1 and buffer 0"));
  }
  if (step_kind &&
      (sub.step < 0 || buffers == 0 || sub.buffer != static_cast<uint32_t>(sub.step % buffers))) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": buffer ", sub.buffer, " is not step % ", buffers, " (the job's step_buffers)"));
  }
  // A part, or the last part of a step sent in parts: any range inside the buffer. A step in one
  // submission is the whole buffer.
  if (InParts(sub, part_step)) {
    if (sub.offset > buffer_bytes || sub.size > buffer_bytes - sub.offset) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": part [", sub.offset, ", +",
                                                     sub.size, ") lies outside the rank's ",
                                                     buffer_bytes, "-byte buffer"));
    }
    return absl::OkStatus();
  }
  if (sub.offset != 0 || sub.size != buffer_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": region [", sub.offset, ", +", sub.size,
                                                   ") is not the rank's ", buffer_bytes,
                                                   "-byte buffer at offset 0"));
  }
  return absl::OkStatus();
}

}  // namespace muond::server::shm_wire
