// Hand-built Step streams on the raw gRPC stub, for requests the client library never sends
// (corrupt, truncated, misplaced or overlapping chunks; missing or wrong tokens).
// Thread-compatible helpers.
#ifndef MUOND_TESTS_INTEGRATION_RAW_STEP_H_
#define MUOND_TESTS_INTEGRATION_RAW_STEP_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "muond/v1/muond.grpc.pb.h"

namespace muond::integration {

std::unique_ptr<v1::Muond::Stub> RawStub(const std::string& address);

v1::StepRequest BeginRequest(const std::string& job_id, int rank, uint64_t session, int64_t step);
// A gradient chunk with the CRC32C of `data`, or `crc32c` when given.
v1::StepRequest GradientRequest(uint32_t matrix, uint64_t offset, const std::string& data,
                                std::optional<uint32_t> crc32c = std::nullopt);
v1::StepRequest EndRequest();

// The raw bytes of fp32 values.
std::string Fp32Bytes(const std::vector<float>& values);

struct RawStepResult {
  grpc::Status status;
  std::vector<v1::StepResponse> responses;
  // The update chunks' data concatenated per matrix index, placed at element offsets (fp32).
  std::vector<float> Update(uint32_t matrix, size_t numel) const;
  bool replayed() const;
};

// Opens a Step stream (with metadata x-muond-job-token = *token unless token is null), writes the
// requests (stopping at the first failed write), closes the writing side, reads every response and
// finishes the call, within `timeout_seconds` (then DEADLINE_EXCEEDED). Pauses (seconds) before
// writing the last request and before closing the writing side widen or narrow races;
// `before_last`, when given, runs after that pause (a test waits there for what it must see first).
RawStepResult RunRawStep(v1::Muond::Stub& stub, const std::string* token,
                         const std::vector<v1::StepRequest>& requests, double timeout_seconds = 30,
                         double pause_before_last = 0, double pause_before_close = 0,
                         const std::function<void()>& before_last = nullptr);

}  // namespace muond::integration

#endif  // MUOND_TESTS_INTEGRATION_RAW_STEP_H_
