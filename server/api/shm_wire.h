// The checks of what a peer sends on the shared-memory data plane (common/shm_protocol.h): the
// attach request datagram and the doorbell records of the submission ring. Pure functions over
// copies the caller made of the peer's bytes; thread-safe. Used by ShmServer (shm_admission.cc,
// shm_server.cc) and fuzzed by tests/fuzz/shm_attach.cc and tests/fuzz/shm_doorbell.cc.
#ifndef MUOND_SERVER_API_SHM_WIRE_H_
#define MUOND_SERVER_API_SHM_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/shm_protocol.h"
#include "muond/v1/muond.pb.h"

namespace muond::server::shm_wire {

// The attach request in one datagram of `full` bytes at `data`. INVALID_ARGUMENT for an empty,
// oversized (`full` > `limit`) or malformed request.
absl::StatusOr<v1::ShmAttachRequest> ParseAttachRequest(const char* data, size_t full,
                                                        size_t limit);

// The submission ring's head as the peer published it, against the daemon's tail:
// FAILED_PRECONDITION "corrupt submission ring" when it went backwards or runs more than kRingSlots
// ahead.
absl::Status CheckSubmissionHead(uint64_t head, uint64_t tail);

// What a doorbell record must be to be served (see shm_protocol.h): its sequence is its ring index,
// its generation the session's, a known kind, step and buffer consistent with the kind, and the
// session's whole buffer, or for a part (and the last part of a step whose parts are open on the
// session: `part_step`, -1 when none) a range inside it. `sub` is the daemon's copy; `where` names the job, rank and doorbell.
// A step submission that is a part (or the last part of the step open in parts on the session:
// `part_step`, -1 when none): any range inside the buffer, checked span by span.
inline bool InParts(const common::shm::Submission& sub, int64_t part_step) {
  return sub.kind == common::shm::kSubmitStepPart ||
         (sub.kind == common::shm::kSubmitStep && sub.step == part_step);
}

// `buffers`: the session's buffers per region (JobSpec::step_buffers); step t uses t % buffers.
absl::Status CheckSubmission(const common::shm::Submission& sub, uint64_t index,
                             uint64_t session_id, uint64_t buffer_bytes, const std::string& where,
                             int64_t part_step = -1, uint32_t buffers = 2);

}  // namespace muond::server::shm_wire

#endif  // MUOND_SERVER_API_SHM_WIRE_H_
