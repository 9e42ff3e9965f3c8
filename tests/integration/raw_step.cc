#include "tests/integration/raw_step.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "common/crc32c.h"

namespace muond::integration {

std::unique_ptr<v1::Muond::Stub> RawStub(const std::string& address) {
  return v1::Muond::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

v1::StepRequest BeginRequest(const std::string& job_id, int rank, uint64_t session, int64_t step) {
  v1::StepRequest req;
  v1::StepBegin* b = req.mutable_begin();
  b->set_job_id(job_id);
  b->set_rank(rank);
  b->set_session_id(session);
  b->set_step(step);
  return req;
}

v1::StepRequest GradientRequest(uint32_t matrix, uint64_t offset, const std::string& data,
                                std::optional<uint32_t> crc32c) {
  v1::StepRequest req;
  v1::DataChunk* c = req.mutable_gradient();
  c->set_matrix_index(matrix);
  c->set_element_offset(offset);
  c->set_data(data);
  c->set_crc32c(crc32c.has_value() ? *crc32c : common::Crc32c(data.data(), data.size()));
  return req;
}

v1::StepRequest EndRequest() {
  v1::StepRequest req;
  req.mutable_end();
  return req;
}

std::string Fp32Bytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

std::vector<float> RawStepResult::Update(uint32_t matrix, size_t numel) const {
  std::vector<float> out(numel, 0.0f);
  for (const v1::StepResponse& r : responses) {
    if (r.kind_case() != v1::StepResponse::kUpdate || r.update().matrix_index() != matrix) continue;
    const size_t n = r.update().data().size() / sizeof(float);
    if (r.update().element_offset() + n > numel) continue;
    std::memcpy(out.data() + r.update().element_offset(), r.update().data().data(),
                n * sizeof(float));
  }
  return out;
}

bool RawStepResult::replayed() const {
  for (const v1::StepResponse& r : responses) {
    if (r.kind_case() == v1::StepResponse::kDone) return r.done().replayed();
  }
  return false;
}

RawStepResult RunRawStep(v1::Muond::Stub& stub, const std::string* token,
                         const std::vector<v1::StepRequest>& requests, double timeout_seconds,
                         double pause_before_last, double pause_before_close,
                         const std::function<void()>& before_last) {
  auto pause = [](double seconds) {
    if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  };
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)));
  if (token != nullptr) ctx.AddMetadata("x-muond-job-token", *token);
  // As the client library does: the job id in the metadata too (printable ids only), so the
  // daemon checks the token before reading and names the job when it refuses.
  if (!requests.empty() && requests[0].has_begin()) {
    const std::string& id = requests[0].begin().job_id();
    bool printable = !id.empty() && id.size() <= 1024;
    for (char c : id) printable = printable && c >= 0x20 && c <= 0x7e;
    if (printable) ctx.AddMetadata("x-muond-job-id", id);
  }
  auto stream = stub.Step(&ctx);
  for (size_t i = 0; i < requests.size(); ++i) {
    if (i + 1 == requests.size()) {
      pause(pause_before_last);
      if (before_last) before_last();
    }
    if (!stream->Write(requests[i])) break;
  }
  pause(pause_before_close);
  stream->WritesDone();
  RawStepResult result;
  v1::StepResponse resp;
  while (stream->Read(&resp)) result.responses.push_back(resp);
  result.status = stream->Finish();
  return result;
}

}  // namespace muond::integration
