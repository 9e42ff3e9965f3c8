// Fuzz target: the shared-memory attach request, one datagram from any local process
// (server/api/shm_wire.cc, as ShmServer::HandleAttach reads it: into a buffer of the configured
// limit, with the datagram's full length from MSG_TRUNC). Input: 2 bytes of limit (little endian,
// 0..65535), then the datagram. Properties: a refusal is INVALID_ARGUMENT with a message, and
// every datagram over the limit or empty is refused; an accepted request serializes to bytes that
// parse to the same request.
#include <cstdint>
#include <cstring>
#include <string>

#include "server/api/shm_wire.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t limit = data[0] | (size_t{data[1]} << 8);
  const size_t full = size - 2;
  // recv() fills at most `limit` bytes and reports the full length.
  std::string buf(limit, '\0');
  std::memcpy(buf.data(), data + 2, std::min(full, limit));
  auto req = muond::server::shm_wire::ParseAttachRequest(buf.data(), full, limit);
  if (!req.ok()) {
    FUZZ_CHECK(req.status().code() == absl::StatusCode::kInvalidArgument &&
                   !req.status().message().empty(),
               req.status().ToString());
    return 0;
  }
  FUZZ_CHECK(full > 0 && full <= limit, "accepted a datagram of " + std::to_string(full) +
                                            " bytes with limit " + std::to_string(limit));
  std::string bytes;
  FUZZ_CHECK(req->SerializeToString(&bytes), "an accepted request does not serialize");
  auto again =
      muond::server::shm_wire::ParseAttachRequest(bytes.data(), bytes.size(), bytes.size() + 1);
  if (bytes.empty()) return 0;  // all fields at their defaults: an empty datagram is refused
  FUZZ_CHECK(again.ok() && again->job_id() == req->job_id() && again->rank() == req->rank() &&
                 again->token() == req->token() && again->takeover() == req->takeover(),
             "serialized request reads back differently");
  return 0;
}
