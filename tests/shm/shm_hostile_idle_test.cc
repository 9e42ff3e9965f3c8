// Idle peers on the shared-memory data plane (issue 4): a peer that never rings holds nobody.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "client/shm_channel.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/integration/multirank_util.h"
#include "tests/shm/shm_hostile_fixture.h"
#include "tests/shm/shm_test_util.h"

namespace muond::shmtest {
namespace {

namespace shm = common::shm;
using client::ShmChannel;
using client::Transport;
using common::DType;
using integration::Matrix;
using integration::MixedMatrices;
using integration::WaitForJob;

// Peers that never ring hold nobody: a library session attached and idle, a raw connection that
// never sends its attach request, a 2-rank job whose rank 0 rang and waits for a rank 1 that never
// comes, and a peer flooding its doorbell without reading completions. Meanwhile another job's
// steps complete, each correct.
TEST_F(ShmHostileTest, PeersThatNeverRingDoNotHoldOtherJobs) {
  Ws1 idle = NewWs1("idle", 1, 31);
  Ws1 busy = NewWs1("busy", 4, 32);
  ASSERT_FALSE(busy.want.empty());
  const common::JobSpec stuck_spec =
      MakeSpec(NewJobId("stuck"), 2, 2, MixedMatrices(DType::kFloat32, DType::kFloat32));
  auto stuck_token = client().CreateJob(stuck_spec);
  ASSERT_TRUE(stuck_token.ok()) << stuck_token.status();

  auto idle_channel = ShmChannel::Attach(ShmPath(), idle.spec.job_id, 0, idle.token, false);
  ASSERT_TRUE(idle_channel.ok()) << idle_channel.status();
  // A connection that never says anything.
  const int silent = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, ShmPath().c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(connect(silent, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // Rank 0 of the 2-rank job rings and waits for rank 1 forever.
  auto stuck_peer = RawShmPeer::Attach(ShmPath(), stuck_spec.job_id, 0, *stuck_token);
  ASSERT_TRUE(stuck_peer.ok()) << stuck_peer.status();
  (*stuck_peer)->Publish((*stuck_peer)->Valid(0), 1);
  ASSERT_TRUE(WaitForJob(client(), stuck_spec.job_id, *stuck_token, [](const v1::JobStatus& st) {
    return st.has_step_in_flight() && st.ranks(0).finished_pushing();
  }));
  // A flood on a third job: rounds of 8 doorbells (a full ring) of a step out of order, never
  // reading a completion (the completion ring fills after 8; the daemon drops the rest).
  const common::JobSpec flood_spec = MakeSpec(NewJobId("flood"), 1, 0, {Matrix("w", {16, 16})});
  auto flood_token = client().CreateJob(flood_spec);
  ASSERT_TRUE(flood_token.ok()) << flood_token.status();
  auto flooder = RawShmPeer::Attach(ShmPath(), flood_spec.job_id, 0, *flood_token);
  ASSERT_TRUE(flooder.ok()) << flooder.status();
  for (int round = 0; round < 6; ++round) {
    shm::Submission s{};
    for (int i = 0; i < static_cast<int>(shm::kRingSlots); ++i) {
      s = (*flooder)->Valid(1000);
      s.seq += i;
      (*flooder)->ring()->subs[s.seq % shm::kRingSlots] = s;
    }
    (*flooder)->Publish(s, s.seq + 1);
    const uint64_t head = s.seq + 1;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((*flooder)->ring()->header.sub_tail.load() != head &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ((*flooder)->ring()->header.sub_tail.load(), head) << "round " << round;
  }
  EXPECT_EQ((*flooder)->ring()->header.comp_head.load(), shm::kRingSlots)
      << "completions beyond the ring's slots are dropped, not written over unread ones";
  EXPECT_TRUE(Status(flood_spec.job_id, *flood_token).ranks(0).attached());
  auto busy_session = client().Attach(busy.spec.job_id, 0, busy.token, false, Transport::kShm);
  ASSERT_TRUE(busy_session.ok()) << busy_session.status();
  for (int64_t step = 0; step < 4; ++step) {
    const auto start = std::chrono::steady_clock::now();
    auto u = StepWith(Api::kZeroCopy, **busy_session, step, busy.grads[step]);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(u.ok()) << "step " << step << ": " << u.status();
    EXPECT_EQ(*u, busy.want[step]) << "step " << step;
    EXPECT_LT(seconds, 5.0) << "step " << step;
  }
  // The idle ones are still there, untouched.
  EXPECT_TRUE(Status(idle.spec.job_id, idle.token).ranks(0).attached());
  const v1::JobStatus stuck = Status(stuck_spec.job_id, *stuck_token);
  EXPECT_TRUE(stuck.has_step_in_flight());
  EXPECT_FALSE(stuck.fenced());
  // Deleting the stuck job releases its waiting rank with NOT_FOUND.
  ASSERT_TRUE(client().DeleteJob(stuck_spec.job_id, *stuck_token).ok());
  auto released = (*stuck_peer)->NextCompletion(10);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(released->code, static_cast<int>(absl::StatusCode::kNotFound)) << released->message;
  EXPECT_TRUE(absl::StrContains(released->message, "deleted")) << released->message;
  close(silent);
  idle_channel->reset();
  busy_session->reset();
  flooder->reset();
  stuck_peer->reset();
  ASSERT_TRUE(client().DeleteJob(flood_spec.job_id, *flood_token).ok());
  ASSERT_TRUE(client().DeleteJob(idle.spec.job_id, idle.token).ok());
  ASSERT_TRUE(client().DeleteJob(busy.spec.job_id, busy.token).ok());
  ExpectStillServing();
}

}  // namespace
}  // namespace muond::shmtest
