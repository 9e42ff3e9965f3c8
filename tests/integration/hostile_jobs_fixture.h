// The fixture of the hostile job tests (hostile_jobs_*_test.cc, suite HostileJobsTest in
// integration_tests): each test starts its own muond (Start, Stop), and a victim job with one
// committed step and a checkpoint generation (MakeVictim) must come through every attack with its
// state (ExpectVictimIntact). Also the small specs and the raw CreateJob the tests share.
//
// Thread-compatible: the fixture is used from the gtest main thread; a test's own threads use
// their own clients.
#ifndef MUOND_TESTS_INTEGRATION_HOSTILE_JOBS_FIXTURE_H_
#define MUOND_TESTS_INTEGRATION_HOSTILE_JOBS_FIXTURE_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "muond/v1/muond.pb.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {

using Clock = std::chrono::steady_clock;

// Seconds since `since`.
double Seconds(Clock::time_point since);

// A job of two small matrices ("w" [16, 24], "v" [24, 8]) over `world` ranks, zero stage `stage`.
common::JobSpec SmallSpec(const std::string& id, int world = 1, int stage = 0);

// CreateJob on the raw stub (the client library checks specs itself first).
grpc::Status RawCreate(const std::string& address, const v1::JobSpec& spec);

class HostileJobsTest : public ::testing::Test {
 protected:
  // Starts muond with `flags` in dir_ (its state survives a Stop) and connects client_.
  void Start(const std::vector<std::string>& flags = {});
  // Stops muond; asserts a clean exit.
  void Stop();
  // A victim job with one committed step and a checkpoint generation.
  void MakeVictim();
  // The victim is at step 1 with its generation, and its step 1 equals the step 1 of an
  // unattacked twin.
  void ExpectVictimIntact();

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
  common::JobSpec victim_;
  std::string victim_token_;
  MatrixBytes grads_;
  std::vector<std::string> victim_update1_;
  int twins_ = 0;
};

}  // namespace muond::integration

#endif  // MUOND_TESTS_INTEGRATION_HOSTILE_JOBS_FIXTURE_H_
