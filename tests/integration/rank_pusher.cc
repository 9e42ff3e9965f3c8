// rank_pusher: a stand-in for a trainer rank that dies in the middle of a step (for the fault
// tests, which SIGKILL it).
//
//   rank_pusher ADDRESS JOB RANK STEP      (the job token in $MUOND_JOB_TOKEN)
//
// STEP -1: attaches RANK over gRPC, prints "ATTACHED <session>" and waits to be killed (a rank
// that dies between steps).
//
// Attaches RANK of JOB with takeover, begins STEP on a raw Step stream, pushes the first half of
// the rank's first span (values 0.25), prints "PUSHED <elements>" and then waits, with the stream
// open, until it is killed. Exits 1 (with one line on stderr) when any of that fails, 64 on usage.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "muond/v1/muond.grpc.pb.h"

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "rank_pusher: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace muond;
  if (argc != 5) {
    std::fprintf(stderr, "usage: rank_pusher ADDRESS JOB RANK STEP\n");
    return 64;
  }
  const std::string address = argv[1], job = argv[2];
  const int rank = std::atoi(argv[3]);
  const int64_t step = std::atoll(argv[4]);
  const char* token_env = std::getenv("MUOND_JOB_TOKEN");
  const std::string token = token_env != nullptr ? token_env : "";

  auto client = client::Client::Connect(address);
  if (!client.ok()) return Fail(std::string(client.status().message()));
  if (step < 0) {
    auto idle = (*client)->Attach(job, rank, token, /*takeover=*/true, client::Transport::kGrpc);
    if (!idle.ok()) return Fail(std::string(idle.status().message()));
    std::printf("ATTACHED %llu\n", static_cast<unsigned long long>((*idle)->session_id()));
    std::fflush(stdout);
    while (true) ::pause();  // until SIGKILL
  }
  auto session = (*client)->Attach(job, rank, token, /*takeover=*/true);
  if (!session.ok()) return Fail(std::string(session.status().message()));
  if ((*session)->spans().empty()) return Fail("the rank owns no elements");
  const common::ShardSpan span = (*session)->spans()[0];
  const common::MatrixSpec& ms = (*session)->spec().matrices[span.matrix];
  const uint64_t n = span.length / 2;
  if (n == 0) return Fail("the rank's first span is too short to push half of it");
  std::vector<float> values(n, 0.25f);
  std::string data(n * common::DTypeSize(ms.dtype), '\0');
  common::FromFloat32(values.data(), n, ms.dtype, data.data());

  auto stub = v1::Muond::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-muond-job-token", token);
  auto stream = stub->Step(&ctx);
  v1::StepRequest req;
  v1::StepBegin* begin = req.mutable_begin();
  begin->set_job_id(job);
  begin->set_rank(rank);
  begin->set_session_id((*session)->session_id());
  begin->set_step(step);
  if (!stream->Write(req)) return Fail("writing StepBegin failed");
  v1::DataChunk* chunk = req.mutable_gradient();
  chunk->set_matrix_index(span.matrix);
  chunk->set_element_offset(span.offset);
  chunk->set_data(data);
  chunk->set_crc32c(common::Crc32c(data.data(), data.size()));
  if (!stream->Write(req)) return Fail("writing the gradient chunk failed");
  std::printf("PUSHED %llu\n", static_cast<unsigned long long>(n));
  std::fflush(stdout);
  while (true) ::pause();  // until SIGKILL
}
