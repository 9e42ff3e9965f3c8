// The shared-memory data plane against junk on the socket and peers that go away before reading
// their attach reply (ShmLimits in server/api/shm_server.h): each case asserts the exact code and
// message the offending connection gets, and that a victim job attached before still steps over
// shared memory with the reference results, that a new attach works afterwards, and that the
// daemon's descriptors come back to where they were. Every test starts its own muond.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "client/shm_channel.h"
#include "gtest/gtest.h"
#include "tests/integration/multirank_util.h"
#include "tests/shm/shm_limits_util.h"

namespace muond::shmtest {
namespace {

using client::ShmChannel;

// Junk instead of an attach request ends that connection with INVALID_ARGUMENT; a valid attach
// followed by junk gets its session and then loses it (the rank is detached, the job not fenced).
// The victim steps correctly after each.
TEST_F(ShmLimitsTest, JunkOnTheSocketEndsOnlyThatConnection) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({}));
  std::unique_ptr<Victim> victim = NewVictim("victim", 6, 14);
  std::unique_ptr<Victim> target = NewVictim("target", 1, 15);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*victim));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "before the junk"));
  const int fds_before = DaemonFds(pid());
  std::mt19937 rng(42);
  int bad_requests = 0;

  struct Junk {
    std::string what;
    std::string bytes;
    absl::StatusCode code;
    std::string text;
  };
  std::string random(4096, '\0');
  for (char& c : random) c = static_cast<char>(rng());
  random[0] = '\x07';  // field 0, wire type 7: never a valid protobuf
  const std::vector<Junk> junk = {
      {"random bytes", random, absl::StatusCode::kInvalidArgument,
       "malformed shared-memory attach request (4096 bytes)"},
      {"1 MiB datagram", std::string(1 << 20, 'x'), absl::StatusCode::kInvalidArgument,
       "shared-memory attach request of 1048576 bytes is larger than the limit of 65536 bytes"},
      {"empty datagram", "", absl::StatusCode::kInvalidArgument,
       "empty shared-memory attach request"},
      {"attach request for no job", AttachRequest("no-such-job", 0, "x"),
       absl::StatusCode::kNotFound, "no-such-job"},
  };
  for (const Junk& j : junk) {
    SCOPED_TRACE(j.what);
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0);
    // A datagram larger than the default socket buffer needs a larger one (root may force it).
    const int sndbuf = static_cast<int>(j.bytes.size()) + (1 << 16);
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &sndbuf, sizeof(sndbuf)) != 0) {
      setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
    }
    const ssize_t sent = send(fd, j.bytes.data(), j.bytes.size(), MSG_NOSIGNAL);
    if (sent < 0 && errno == EMSGSIZE) {
      std::cout << j.what << ": the kernel refuses a datagram this large (not root?): skipped"
                << std::endl;
      close(fd);
      continue;
    }
    ASSERT_EQ(sent, static_cast<ssize_t>(j.bytes.size())) << std::strerror(errno);
    const Outcome answer = Receive(fd, 5);
    EXPECT_TRUE(IsReply(answer, j.code, j.text));
    bad_requests += j.code == absl::StatusCode::kInvalidArgument;
    std::cout << "junk: " << j.what << " (" << j.bytes.size() << " bytes) -> " << answer.ToString()
              << std::endl;
    EXPECT_EQ(Receive(fd, 5).kind, Outcome::kClosed) << "the daemon kept the connection";
    close(fd);
    ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, j.what));
  }

  // A valid attach, then garbage: the session is set up, then ended as a failure.
  {
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0);
    const std::string req = AttachRequest(target->spec.job_id, 0, target->token);
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    ASSERT_EQ(send(fd, random.data(), 100, MSG_NOSIGNAL), 100);
    const Outcome answer = Receive(fd, 5);
    EXPECT_TRUE(IsReply(answer, absl::StatusCode::kOk, "")) << answer.ToString();
    EXPECT_EQ(answer.nfds, 5);
    EXPECT_EQ(Receive(fd, 5).kind, Outcome::kClosed) << "the daemon kept the session";
    close(fd);
    EXPECT_TRUE(integration::WaitForJob(
        *client_, target->spec.job_id, target->token,
        [](const v1::JobStatus& st) { return !st.ranks(0).attached() && !st.fenced(); }, 5))
        << "the rank stayed attached, or the job was fenced";
    EXPECT_TRUE(absl::StrContains(daemon_->Log(), "ended: unexpected message of 100 bytes after "
                                                  "attach"));
    ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "attach + garbage"));
  }
  EXPECT_EQ(WaitForFds(pid(), fds_before, 5), fds_before);
  EXPECT_EQ(Refused("bad_request"), bad_requests);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*target));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*target, "attached after the garbage"));
  target->session.reset();
  ASSERT_NO_FATAL_FAILURE(ExpectHealthy("fresh-after-junk"));
}

// A peer that sends its attach request and goes away (closes, or shuts down its receiving side so
// that the reply cannot be delivered) leaves the rank detached: the same rank attaches again
// without takeover. The victim is unaffected.
TEST_F(ShmLimitsTest, PeerGoneBeforeTheReplyLeavesTheRankDetached) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({}));
  std::unique_ptr<Victim> victim = NewVictim("victim", 3, 16);
  std::unique_ptr<Victim> target = NewVictim("target", 1, 17);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*victim));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "before"));
  const int fds_before = DaemonFds(pid());
  const std::string req = AttachRequest(target->spec.job_id, 0, target->token);

  // 1. Send and close at once, many times (the daemon sees the hang-up before or after it
  // answered).
  for (int i = 0; i < 20; ++i) {
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    close(fd);
  }
  EXPECT_EQ(WaitForFds(pid(), fds_before, 5), fds_before);
  {
    auto again = ShmChannel::Attach(ShmPath(), target->spec.job_id, 0, target->token, false);
    ASSERT_TRUE(again.ok()) << "the rank stayed attached: " << again.status();
  }
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "after send-and-close"));

  // 2. The reply cannot be delivered (the peer shut down its receiving side): sendmsg fails.
  {
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(shutdown(fd, SHUT_RD), 0);
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    // The daemon closes the connection: both directions are then shut.
    pollfd p{fd, POLLHUP, 0};
    const auto start = Clock::now();
    while (Since(start) < 5 && !(poll(&p, 1, 20) > 0 && (p.revents & POLLHUP))) {
    }
    EXPECT_TRUE(p.revents & POLLHUP) << "the daemon kept the connection";
    close(fd);
  }
  EXPECT_EQ(WaitForFds(pid(), fds_before, 5), fds_before);
  EXPECT_FALSE(RankAttached(*target));
  EXPECT_EQ(Refused("reply_failed"), 1);
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "shared-memory attach abandoned: sendmsg of the "
                                                "shared-memory attach reply: Broken pipe"));
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*target));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*target, "attached after the failed reply"));
  target->session.reset();
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "after the failed reply"));
  ASSERT_NO_FATAL_FAILURE(ExpectHealthy("fresh-after-hangups"));
}

}  // namespace
}  // namespace muond::shmtest
