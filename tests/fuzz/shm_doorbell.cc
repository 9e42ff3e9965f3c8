// Fuzz target: the doorbell records of the shared-memory submission ring, which a rank writes
// into memory the daemon reads (common/shm_protocol.h; checked by server/api/shm_wire.cc as
// ShmServer::HandleDoorbell does: the head against the daemon's tail, then each record copied out
// and checked). A structured harness: the input sets the session (id, buffer bytes) and then, per
// doorbell, a published head and the ring's slots. Properties: a head behind the tail or more than
// kRingSlots ahead ends the session; a record that passes names buffer step % 2 (step records) or
// 0 (initial parameters) and exactly the session's buffer, so the daemon's reads stay inside the
// 2-buffer region; a refusal names the doorbell.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "common/shm_protocol.h"
#include "server/api/shm_wire.h"
#include "tests/fuzz/fuzz_check.h"

namespace shm = muond::common::shm;
using muond::server::shm_wire::CheckSubmission;
using muond::server::shm_wire::CheckSubmissionHead;

namespace {

// A record: mostly well-formed ones with one field changed, so the checks after the first are
// reached; else raw bytes.
shm::Submission NextRecord(FuzzedDataProvider& in, uint64_t index, uint64_t session,
                           uint64_t buffer_bytes) {
  shm::Submission sub{};
  if (in.ConsumeBool()) {
    const std::string raw = in.ConsumeBytesAsString(sizeof(sub));
    std::memcpy(&sub, raw.data(), raw.size());
    return sub;
  }
  const int64_t step = in.ConsumeIntegralInRange<int64_t>(-2, 1000);
  const bool init = in.ConsumeBool();
  const bool part = !init && in.ConsumeBool();  // a part of a step: a range inside the buffer
  const uint64_t offset = part ? in.ConsumeIntegralInRange<uint64_t>(0, buffer_bytes) : 0;
  const uint64_t size =
      part ? in.ConsumeIntegralInRange<uint64_t>(0, buffer_bytes - offset) : buffer_bytes;
  sub = {index,
         init ? -1 : step,
         session,
         init ? 0u : static_cast<uint32_t>(step & 1),
         init ? shm::kSubmitInitParams : part ? shm::kSubmitStepPart : shm::kSubmitStep,
         offset,
         size};
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 0:
      sub.seq = in.ConsumeIntegral<uint64_t>();
      break;
    case 1:
      sub.generation = in.ConsumeIntegral<uint64_t>();
      break;
    case 2:
      sub.kind = in.ConsumeIntegral<uint32_t>();
      break;
    case 3:
      sub.buffer = in.ConsumeIntegral<uint32_t>();
      break;
    case 4:
      sub.step = in.ConsumeIntegral<int64_t>();
      break;
    case 5:
      sub.offset = in.ConsumeIntegral<uint64_t>();
      break;
    case 6:
      sub.size = in.ConsumeIntegral<uint64_t>();
      break;
    default:
      break;  // well-formed
  }
  return sub;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const uint64_t session = in.ConsumeIntegral<uint64_t>();
  const uint64_t buffer_bytes = in.ConsumeIntegralInRange<uint64_t>(1, uint64_t{1} << 40);
  uint64_t tail = in.ConsumeIntegralInRange<uint64_t>(0, 1 << 20);
  shm::Submission slots[shm::kRingSlots] = {};
  while (in.remaining_bytes() > 0) {
    const uint64_t head = in.ConsumeBool() ? tail + in.ConsumeIntegralInRange<uint64_t>(0, 10)
                                           : in.ConsumeIntegral<uint64_t>();
    for (uint64_t i = tail; i < head && i < tail + shm::kRingSlots; ++i) {
      slots[i % shm::kRingSlots] = NextRecord(in, i, session, buffer_bytes);
    }
    const absl::Status corrupt = CheckSubmissionHead(head, tail);
    FUZZ_CHECK(corrupt.ok() == (head >= tail && head - tail <= shm::kRingSlots),
               "head " + std::to_string(head) + " tail " + std::to_string(tail) + ": " +
                   corrupt.ToString());
    if (!corrupt.ok()) return 0;  // the session ends
    while (tail < head) {
      const shm::Submission sub = slots[tail % shm::kRingSlots];
      const uint64_t index = tail++;
      const std::string where = "job 'j' rank 0 doorbell " + std::to_string(index);
      // The step this session has open in parts (its last part may be any range), or none.
      const int64_t part_step =
          in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(-1, 1000) : -1;
      const absl::Status bad =
          CheckSubmission(sub, index, session, buffer_bytes, where, part_step);
      if (!bad.ok()) {
        FUZZ_CHECK(bad.message().rfind(where + ": ", 0) == 0, bad.ToString());
        continue;
      }
      FUZZ_CHECK(sub.seq == index && sub.generation == session, "served a stale record");
      const bool step_kind = sub.kind == shm::kSubmitStep || sub.kind == shm::kSubmitStepPart;
      FUZZ_CHECK(step_kind
                     ? sub.step >= 0 && sub.buffer == (sub.step & 1)
                     : sub.kind == shm::kSubmitInitParams && sub.step == -1 && sub.buffer == 0,
                 "served a record of kind " + std::to_string(sub.kind));
      // The daemon reads [buffer * buffer_bytes + offset, + size) of a 2 * buffer_bytes region:
      // a part (or the last part of a step open in parts) anywhere inside the buffer, anything
      // else the whole buffer.
      const bool in_parts = sub.kind == shm::kSubmitStepPart ||
                            (sub.kind == shm::kSubmitStep && sub.step == part_step);
      FUZZ_CHECK(sub.buffer < 2 && (in_parts ? sub.offset <= buffer_bytes &&
                                                   sub.size <= buffer_bytes - sub.offset
                                             : sub.offset == 0 && sub.size == buffer_bytes),
                 "served a record outside the region");
    }
  }
  return 0;
}
