// shm_rank: a trainer rank attached over shared memory, to be killed with SIGKILL by the tests.
//
//   shm_rank ADDRESS JOB RANK STEP idle|ring     (the job token in $MUOND_JOB_TOKEN)
//
// Attaches RANK of JOB with Transport::kShm and prints "ATTACHED <session> <buffer bytes>".
// idle: waits, attached, until killed. ring: writes 0.25 into every element of its spans of step
// STEP's gradient view, prints "RINGING", rings StepInPlace (which blocks until the other ranks
// come) and, should it ever return, prints "RANG <status>" and waits. Exit 1 (one line on stderr)
// on a failure, 64 on usage.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/dtype.h"

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "shm_rank: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace muond;
  if (argc != 6) {
    std::fprintf(stderr, "usage: shm_rank ADDRESS JOB RANK STEP idle|ring\n");
    return 64;
  }
  const std::string address = argv[1], job = argv[2], mode = argv[5];
  const int rank = std::atoi(argv[3]);
  const int64_t step = std::atoll(argv[4]);
  const char* token_env = std::getenv("MUOND_JOB_TOKEN");
  const std::string token = token_env != nullptr ? token_env : "";
  if (mode != "idle" && mode != "ring") return Fail("mode must be idle or ring");

  auto client = client::Client::Connect(address);
  if (!client.ok()) return Fail(std::string(client.status().message()));
  auto session = (*client)->Attach(job, rank, token, /*takeover=*/false, client::Transport::kShm);
  if (!session.ok()) return Fail(std::string(session.status().message()));
  auto view = (*session)->GradientView(step);
  if (!view.ok()) return Fail(std::string(view.status().message()));
  std::printf("ATTACHED %llu %zu\n", static_cast<unsigned long long>((*session)->session_id()),
              view->size);
  std::fflush(stdout);
  if (mode == "ring") {
    const common::DType dtype = (*session)->spec().matrices[0].dtype;
    const size_t esize = common::DTypeSize(dtype);
    for (const common::ShardSpan& s : (*session)->spans()) {
      std::vector<float> values(s.length, 0.25f);
      common::FromFloat32(values.data(), s.length, dtype, view->data + s.rank_offset * esize);
    }
    std::printf("RINGING\n");
    std::fflush(stdout);
    auto r = (*session)->StepInPlace(step);
    std::printf("RANG %s\n", r.ok() ? "OK" : std::string(r.status().message()).c_str());
    std::fflush(stdout);
  }
  while (true) ::pause();  // until SIGKILL
}
