// The fixture of the shared-memory hostile-peer tests (shm_hostile_*_test.cc, suite
// ShmHostileTest in shm_tests): one daemon for the suite (DaemonSuite), world-size-1 jobs (Ws1)
// with their reference updates computed by a separate job over gRPC, and the job status and update
// buffers read back. Ws1 and Ws1Update stand outside the fixture so that a test file's own helper
// functions can take them.
//
// Thread-compatible: each object is used by one thread at a time.
#ifndef MUOND_TESTS_SHM_SHM_HOSTILE_FIXTURE_H_
#define MUOND_TESTS_SHM_SHM_HOSTILE_FIXTURE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "client/shm_channel.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "muond/v1/muond.pb.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"
#include "tests/shm/shm_test_util.h"

namespace muond::shmtest {

// A world-size-1 job created for a test: its spec and token, its gradients and its reference
// updates (the same gradients through a separate job over gRPC).
struct Ws1 {
  common::JobSpec spec;
  std::string token;
  MatrixBytes grads;
  std::vector<std::vector<std::string>> want;  // [step][matrix]
};

// Whole-matrix update bytes (one entry per matrix) read from a world-size-1 update buffer.
inline std::vector<std::string> Ws1Update(const common::JobSpec& spec, const char* buffer) {
  std::vector<std::string> out;
  for (const common::ShardSpan& s : common::RankSpans(spec, 0)) {
    out.emplace_back(buffer + s.rank_offset * 4, s.length * 4);
  }
  return out;
}

class ShmHostileTest : public integration::DaemonSuite {
 protected:
  static std::string ShmPath() { return client::ShmSocketFor(address()); }

  // A world-size-1 float32 job with three matrices; its reference updates (a separate job over
  // gRPC) for `steps` steps.
  Ws1 NewWs1(const std::string& prefix, int steps, uint64_t seed, int step_buffers = 2) {
    Ws1 j;
    j.spec =
        MakeSpec(NewJobId(prefix), 1, 0,
                 {integration::Matrix("q", {32, 24}), integration::Matrix("experts", {2, 16, 8}),
                  integration::Matrix("o", {24, 32})});
    j.spec.step_buffers = step_buffers;
    j.grads = integration::MakeGradients(j.spec.matrices, steps, seed);
    auto ref = RunTrajectory(client(), MakeSpec(NewJobId(prefix + "-ref"), 1, 0, j.spec.matrices),
                             Api::kGrpcStep, j.grads);
    EXPECT_TRUE(ref.ok()) << ref.status();
    if (ref.ok()) j.want = ref->updates[0];
    auto token = client().CreateJob(j.spec);
    EXPECT_TRUE(token.ok()) << token.status();
    if (token.ok()) j.token = *token;
    return j;
  }

  static v1::JobStatus Status(const std::string& id, const std::string& token) {
    auto st = client().GetJob(id, token);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? *st : v1::JobStatus();
  }
};

}  // namespace muond::shmtest

#endif  // MUOND_TESTS_SHM_SHM_HOSTILE_FIXTURE_H_
