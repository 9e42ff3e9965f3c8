// Hostile peers on the shared-memory ring (issue 4): malformed doorbells get clear errors and
// leave the session working; a corrupt ring, or a peer that talks after attaching, ends that
// session only.
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shm_channel.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "tests/integration/multirank_util.h"
#include "tests/shm/shm_hostile_fixture.h"
#include "tests/shm/shm_test_util.h"

namespace muond::shmtest {
namespace {

namespace shm = common::shm;
using client::ShmChannel;
using client::Transport;
using integration::WaitForJob;

// A malformed doorbell rung on a channel, and the error it must get.
struct BadDoorbell {
  std::string what;
  absl::StatusOr<ShmChannel::Ringing> got;
  absl::StatusCode code;
  std::string text;
};

// Rings every malformed variant of the doorbell of `step` (the session's generation `gen`, an
// earlier session's `old_generation`), in order; returns what each got and should have got.
std::vector<BadDoorbell> RingMalformedDoorbells(ShmChannel& c, int64_t step, uint64_t gen,
                                                uint64_t old_generation) {
  const uint64_t bb = c.buffer_bytes();
  const uint32_t buf = static_cast<uint32_t>(step % 2);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const auto kPrecondition = absl::StatusCode::kFailedPrecondition;
  return {
      {"short size", c.RingRaw(step, buf, 0, bb - 4, gen), kInvalid,
       absl::StrCat("region [0, +", bb - 4, ") is not the rank's ", bb, "-byte buffer")},
      {"long size", c.RingRaw(step, buf, 0, 2 * bb, gen), kInvalid, "-byte buffer at offset 0"},
      {"zero size", c.RingRaw(step, buf, 0, 0, gen), kInvalid, "-byte buffer at offset 0"},
      {"offset", c.RingRaw(step, buf, 64, bb, gen), kInvalid,
       absl::StrCat("region [64, +", bb, ")")},
      {"offset past the region", c.RingRaw(step, buf, uint64_t{1} << 62, bb, gen), kInvalid,
       "is not the rank's"},
      {"other buffer", c.RingRaw(step, 1 - buf, 0, bb, gen), kInvalid,
       absl::StrCat("buffer ", 1 - buf, " is not step % 2")},
      {"buffer out of range", c.RingRaw(step, 7, 0, bb, gen), kInvalid, "buffer 7 is not step % 2"},
      {"negative step", c.RingRaw(-1, 1, 0, bb, gen), kInvalid, "is not step % 2"},
      {"stale generation", c.RingRaw(step, buf, 0, bb, old_generation), kPrecondition,
       absl::StrCat("stale generation ", old_generation, " (the session's is ", gen, ")")},
      {"future generation", c.RingRaw(step, buf, 0, bb, gen + 1000), kPrecondition,
       "stale generation"},
      {"step ahead", c.RingRaw(step + 5, static_cast<uint32_t>((step + 5) % 2), 0, bb, gen),
       kPrecondition, absl::StrCat("step ", step + 5, " out of order: expected step ", step)},
  };
}

// Each bad doorbell got its own error, and every error names the job.
void ExpectClearErrors(const std::vector<BadDoorbell>& bad, const std::string& job_id) {
  for (const BadDoorbell& b : bad) {
    EXPECT_TRUE(IsError(b.got.status(), b.code, b.text)) << b.what;
    EXPECT_TRUE(absl::StrContains(b.got.status().message(), absl::StrCat("job '", job_id, "'")))
        << b.what << ": the error names the job: " << b.got.status();
  }
}

// A world-2 ZeRO-2 job of `matrices`, both ranks attached over shared memory, and step 0's
// gradients.
struct TwoRanks {
  common::JobSpec spec;
  std::string token;
  integration::MatrixBytes grads;
  std::unique_ptr<ShmChannel> c0, c1;
};
absl::StatusOr<TwoRanks> AttachTwoRanks(client::Client& c, const std::string& shm,
                                        const std::string& job_id,
                                        std::vector<common::MatrixSpec> matrices) {
  TwoRanks job;
  job.spec = MakeSpec(job_id, 2, 2, std::move(matrices));
  ASSIGN_OR_RETURN(job.token, c.CreateJob(job.spec));
  job.grads = integration::MakeGradients(job.spec.matrices, 1, 7);
  ASSIGN_OR_RETURN(job.c0, ShmChannel::Attach(shm, job_id, 0, job.token, false));
  ASSIGN_OR_RETURN(job.c1, ShmChannel::Attach(shm, job_id, 1, job.token, false));
  return job;
}

// Every malformed doorbell field gets its own clear error, the session is not ended, the step is
// not refused or fenced, and a correct doorbell afterwards computes the reference update.
// A replay over shared memory rings a committed step again: its gradient buffer must hold the
// bytes the step was computed from. Other bytes are refused ALREADY_EXISTS naming the step and
// the matrix, and nothing changes; the same bytes get the committed update (a replay).
TEST_F(ShmHostileTest, ReplayWithOtherGradientsIsRefused) {
  Ws1 j = NewWs1("shm-replay", 2, 17);
  ASSERT_FALSE(j.want.empty());
  auto ch = ShmChannel::Attach(ShmPath(), j.spec.job_id, 0, j.token, false);
  ASSERT_TRUE(ch.ok()) << ch.status();
  ShmChannel& c = **ch;
  const uint64_t bb = c.buffer_bytes();
  const std::string step0 = FlatRankBuffer(j.spec, 0, j.grads[0]);
  std::memcpy(c.GradientBuffer(0), step0.data(), bb);
  auto done = c.Ring(0);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(Ws1Update(j.spec, c.UpdateBuffer(0)), j.want[0]);
  // The trainer re-sends step 0 with other gradients (here: step 1's) in the same buffer.
  const std::string step1 = FlatRankBuffer(j.spec, 0, j.grads[1]);
  std::memcpy(c.GradientBuffer(0), step1.data(), bb);
  auto other = c.Ring(0);
  ASSERT_FALSE(other.ok()) << "a replay with other gradients was answered OK";
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists) << other.status();
  for (const std::string& want :
       {absl::StrCat("job '", j.spec.job_id, "' rank 0: step 0 is committed"),
        std::string("carries other gradients"), std::string("matrix 'q' elements from 0"),
        std::string("nothing changed")}) {
    EXPECT_NE(other.status().message().find(want), std::string::npos)
        << want << " in: " << other.status();
  }
  v1::JobStatus st = Status(j.spec.job_id, j.token);
  EXPECT_EQ(st.next_step(), 1);
  EXPECT_EQ(st.steps_completed(), 1);
  EXPECT_FALSE(st.fenced());
  ASSERT_TRUE(st.ranks(0).attached()) << "the session survived the refusal";
  // The same bytes again: the committed update.
  std::memcpy(c.GradientBuffer(0), step0.data(), bb);
  auto same = c.Ring(0);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(same->replayed);
  EXPECT_EQ(Ws1Update(j.spec, c.UpdateBuffer(0)), j.want[0]);
  // And the momentum was not touched: step 1 gives the reference's step 1.
  std::memcpy(c.GradientBuffer(1), step1.data(), bb);
  auto next = c.Ring(1);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(next->replayed);
  EXPECT_EQ(Ws1Update(j.spec, c.UpdateBuffer(1)), j.want[1]);
  ch->reset();
}

// A job with "step_buffers": 1 (what muon_offload asks unless delayed): each region holds one
// buffer, every step uses it, a doorbell naming buffer 1 is refused naming the job's step_buffers
// (the session and the job keep working), and every step computes the reference's update.
TEST_F(ShmHostileTest, OneBufferJobUsesBufferZeroForEveryStep) {
  Ws1 j = NewWs1("one-buffer", 3, 23, /*step_buffers=*/1);
  ASSERT_EQ(j.want.size(), 3u);
  auto ch = ShmChannel::Attach(ShmPath(), j.spec.job_id, 0, j.token, false);
  ASSERT_TRUE(ch.ok()) << ch.status();
  ShmChannel& c = **ch;
  EXPECT_EQ(c.buffers(), 1u);
  EXPECT_EQ(c.GradientBuffer(0), c.GradientBuffer(1));
  EXPECT_EQ(c.UpdateBuffer(0), c.UpdateBuffer(1));
  const uint64_t bb = c.buffer_bytes();
  auto bad = c.RingRaw(0, 1, 0, bb, c.session_id());
  EXPECT_TRUE(IsError(bad.status(), absl::StatusCode::kInvalidArgument,
                      "buffer 1 is not step % 1 (the job's step_buffers)"))
      << bad.status();
  for (int64_t t = 0; t < 3; ++t) {
    const std::string grads = FlatRankBuffer(j.spec, 0, j.grads[t]);
    std::memcpy(c.GradientBuffer(t), grads.data(), bb);
    auto done = c.Ring(t);
    ASSERT_TRUE(done.ok()) << "step " << t << ": " << done.status();
    EXPECT_EQ(Ws1Update(j.spec, c.UpdateBuffer(t)), j.want[t]) << "step " << t;
  }
  const v1::JobStatus st = Status(j.spec.job_id, j.token);
  EXPECT_EQ(st.steps_completed(), 3);
  EXPECT_FALSE(st.fenced());
  EXPECT_EQ(st.spec().step_buffers(), 1);
  ch->reset();
}

TEST_F(ShmHostileTest, MalformedDoorbellsGetClearErrorsAndTheSessionKeepsWorking) {
  Ws1 j = NewWs1("doorbell", 2, 3);
  ASSERT_FALSE(j.want.empty());
  // A generation of an earlier session of the same rank.
  uint64_t old_generation = 0;
  {
    auto first = ShmChannel::Attach(ShmPath(), j.spec.job_id, 0, j.token, false);
    ASSERT_TRUE(first.ok()) << first.status();
    old_generation = (*first)->session_id();
  }
  auto ch = ShmChannel::Attach(ShmPath(), j.spec.job_id, 0, j.token, false);
  ASSERT_TRUE(ch.ok()) << ch.status();
  ShmChannel& c = **ch;
  const uint64_t bb = c.buffer_bytes();
  const uint64_t gen = c.session_id();
  ASSERT_NE(gen, old_generation);
  for (int64_t step = 0; step < 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const std::string flat = FlatRankBuffer(j.spec, 0, j.grads[step]);
    ASSERT_EQ(flat.size(), bb);
    std::memcpy(c.GradientBuffer(step), flat.data(), bb);
    ExpectClearErrors(RingMalformedDoorbells(c, step, gen, old_generation), j.spec.job_id);
    if (step == 1) {
      // Going back one step is a replay: the committed bytes, not a second momentum update.
      auto replay = c.Ring(0);
      ASSERT_TRUE(replay.ok()) << replay.status();
      EXPECT_TRUE(replay->replayed);
      EXPECT_EQ(Ws1Update(j.spec, c.UpdateBuffer(0)), j.want[0]);
    }
    const v1::JobStatus st = Status(j.spec.job_id, j.token);
    EXPECT_EQ(st.next_step(), step);
    EXPECT_FALSE(st.fenced());
    EXPECT_EQ(st.steps_refused(), 0);
    ASSERT_TRUE(st.ranks(0).attached()) << "the session survived the bad doorbells";
    // The session still works, and nothing of the above touched the momentum.
    auto ok = c.Ring(step);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(ok->step, step);
    EXPECT_FALSE(ok->replayed);
    EXPECT_EQ(Ws1Update(j.spec, c.UpdateBuffer(step)), j.want[step]);
  }
  const v1::JobStatus st = Status(j.spec.job_id, j.token);
  EXPECT_EQ(st.steps_completed(), 2);
  EXPECT_EQ(st.steps_refused(), 0);
  EXPECT_EQ(st.steps_aborted(), 0);
  ch->reset();
  ASSERT_TRUE(client().DeleteJob(j.spec.job_id, j.token).ok());
  ExpectStillServing();
}

// One step of the job that is not attacked, over its shared-memory session: the reference update.
// A failure here does not end the test.
void StepOtherJob(client::RankSession& session, const Ws1& b, int64_t step) {
  auto u = StepWith(Api::kZeroCopy, session, step, b.grads[step]);
  ASSERT_TRUE(u.ok()) << "the other job, step " << step << ": " << u.status();
  EXPECT_EQ(*u, b.want[step]) << "the other job, step " << step;
}

// Whether rank 0 of job `a` becomes attached (`want` true) or detached within 10 s.
bool WaitRankAttached(client::Client& client, const Ws1& a, bool want) {
  return WaitForJob(
      client, a.spec.job_id, a.token,
      [&](const v1::JobStatus& st) { return st.ranks(0).attached() == want; }, 10);
}

// A raw peer of job `a` whose submission head jumps far ahead of the tail. First a slot with a
// wrong sequence number, which is only an error, and a valid step 0 that computes the reference;
// then the jump ends the session: hang-up, rank detached, the next ring UNAVAILABLE.
void EndSessionWithHeadAhead(client::Client& client, const std::string& path, const Ws1& a) {
  auto peer = RawShmPeer::Attach(path, a.spec.job_id, 0, a.token);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::string flat = FlatRankBuffer(a.spec, 0, a.grads[0]);
  std::memcpy((*peer)->grad(), flat.data(), flat.size());
  // A wrong sequence number in the slot: an error, nothing more.
  shm::Submission wrong = (*peer)->Valid(0);
  wrong.seq = 42;
  (*peer)->ring()->subs[0] = wrong;
  (*peer)->Publish(wrong, 1);  // slot 42 % 8 = 2 gets it too; slot 0 is what the daemon reads
  auto c = (*peer)->NextCompletion(10);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(absl::StrContains(c->message, "sequence 42 does not match its slot 0")) << c->message;
  // The session is still good: a valid step (sequence 1) computes the reference.
  shm::Submission sub = (*peer)->Valid(0);
  ASSERT_EQ(sub.seq, 1u);
  ASSERT_TRUE((*peer)->Ring(sub).ok());
  EXPECT_EQ(Ws1Update(a.spec, (*peer)->update()), a.want[0]);
  // Now the head jumps far ahead.
  shm::Submission junk = (*peer)->Valid(1);
  (*peer)->Publish(junk, 1000);
  EXPECT_TRUE((*peer)->WaitHangUp(10)) << "the daemon kept a session with a corrupt ring";
  EXPECT_TRUE(WaitRankAttached(client, a, false));
  EXPECT_EQ((*peer)->Ring((*peer)->Valid(1), 5).code(), absl::StatusCode::kUnavailable);
}

// A raw peer of job `a` that steps 1 correctly and then sets its submission head back to 0: the
// daemon hangs up and the rank is detached.
void EndSessionWithHeadBehind(client::Client& client, const std::string& path, const Ws1& a) {
  auto peer = RawShmPeer::Attach(path, a.spec.job_id, 0, a.token);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::string flat = FlatRankBuffer(a.spec, 0, a.grads[1]);
  std::memcpy((*peer)->grad() + (*peer)->buffer_bytes(), flat.data(), flat.size());
  ASSERT_TRUE((*peer)->Ring((*peer)->Valid(1)).ok());
  EXPECT_EQ(Ws1Update(a.spec, (*peer)->update() + (*peer)->buffer_bytes()), a.want[1]);
  (*peer)->Publish((*peer)->Valid(2), 0);
  EXPECT_TRUE((*peer)->WaitHangUp(10)) << "the daemon kept a session whose head went back";
  EXPECT_TRUE(WaitRankAttached(client, a, false));
}

// This process's sockets: "socket:[inode]" -> descriptor.
std::map<std::string, int> OpenSockets() {
  std::map<std::string, int> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && absl::StartsWith(target, "socket:")) {
      out[target] = std::stoi(e.path().filename().string());
    }
  }
  return out;
}

// A SOCK_SEQPACKET socket (by inode) that is open now and was not in `before`; -1 if none.
int NewSeqpacketSocket(const std::map<std::string, int>& before) {
  int conn = -1;
  for (const auto& [target, fd] : OpenSockets()) {
    int type = 0;
    socklen_t len = sizeof(type);
    if (before.count(target) == 0 && getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 &&
        type == SOCK_SEQPACKET) {
      conn = fd;
    }
  }
  return conn;
}

// A library peer of job `a` that sends a datagram on its socket after attaching: the daemon ends
// the session, and the channel's next Ring (step 2) is UNAVAILABLE.
void EndSessionOfChattyPeer(client::Client& client, const std::string& path, const Ws1& a) {
  // The channel's socket: the SOCK_SEQPACKET socket that was not there before.
  const std::map<std::string, int> before = OpenSockets();
  auto ch = ShmChannel::Attach(path, a.spec.job_id, 0, a.token, false);
  ASSERT_TRUE(ch.ok()) << ch.status();
  const int conn = NewSeqpacketSocket(before);
  ASSERT_GE(conn, 0) << "the channel's SOCK_SEQPACKET socket";
  ASSERT_EQ(send(conn, "hi", 2, MSG_NOSIGNAL), 2);
  EXPECT_TRUE(WaitRankAttached(client, a, false))
      << "the daemon kept a session that talked after attach";
  const std::string flat = FlatRankBuffer(a.spec, 0, a.grads[2]);
  std::memcpy((*ch)->GradientBuffer(2), flat.data(), flat.size());
  auto r = (*ch)->Ring(2);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "ended the shared-memory session"))
      << r.status();
}

// A peer whose ring is corrupt (submission head far ahead of, or behind, what the daemon read)
// gets its session ended: the daemon hangs up, the rank is detached, its next Ring is
// UNAVAILABLE. A slot whose sequence number is wrong is only an error. A ShmChannel peer that
// sends anything on its socket after attaching is ended likewise. Another job's session steps
// correctly before, during and after; the rank can attach again and go on.
TEST_F(ShmHostileTest, CorruptRingOrChattyPeerEndsOnlyThatSession) {
  Ws1 a = NewWs1("ring-a", 3, 5);
  Ws1 b = NewWs1("ring-b", 3, 6);
  ASSERT_FALSE(a.want.empty());
  ASSERT_FALSE(b.want.empty());
  auto other = client().Attach(b.spec.job_id, 0, b.token, false, Transport::kShm);
  ASSERT_TRUE(other.ok()) << other.status();
  StepOtherJob(**other, b, 0);

  // 1. The head far ahead of the tail.
  ASSERT_NO_FATAL_FAILURE(EndSessionWithHeadAhead(client(), ShmPath(), a));
  StepOtherJob(**other, b, 1);
  // 2. The head behind the tail (after one good step, the head goes back to 0).
  ASSERT_NO_FATAL_FAILURE(EndSessionWithHeadBehind(client(), ShmPath(), a));
  // 3. A library peer that sends a datagram on its socket after attaching.
  ASSERT_NO_FATAL_FAILURE(EndSessionOfChattyPeer(client(), ShmPath(), a));
  StepOtherJob(**other, b, 2);

  // The job itself is fine: the rank attaches again and steps 2 (steps 0 and 1 committed).
  const v1::JobStatus st = Status(a.spec.job_id, a.token);
  EXPECT_EQ(st.next_step(), 2);
  EXPECT_FALSE(st.fenced()) << st.fence_reason();
  auto again = client().Attach(a.spec.job_id, 0, a.token, false, Transport::kShm);
  ASSERT_TRUE(again.ok()) << again.status();
  auto u = StepWith(Api::kShmStep, **again, 2, a.grads[2]);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(*u, a.want[2]);
  again->reset();
  other->reset();
  ASSERT_TRUE(client().DeleteJob(a.spec.job_id, a.token).ok());
  ASSERT_TRUE(client().DeleteJob(b.spec.job_id, b.token).ok());
  ExpectStillServing();
}

// A part that reaches the daemon after the rank's last part of a step still in flight (a peer
// that bypasses the client library's check) refuses the step: INVALID_ARGUMENT, nothing
// committed, not fenced; the part's own completion says why.
TEST_F(ShmHostileTest, APartAfterTheRanksLastPartRefusesTheStepUncommitted) {
  auto job = AttachTwoRanks(client(), ShmPath(), NewJobId("late-part"),
                            {integration::Matrix("q", {32, 24}), integration::Matrix("o", {24, 32})});
  ASSERT_TRUE(job.ok()) << job.status();
  const common::JobSpec& spec = job->spec;
  const integration::MatrixBytes& grads = job->grads;
  ShmChannel& c = *job->c0;
  const std::string flat = FlatRankBuffer(spec, 0, grads[0]);
  std::memcpy(c.GradientBuffer(0), flat.data(), flat.size());
  // Rank 0's whole step, in one last part; rank 1 has not sent: the step stays in flight.
  // The daemon serves a session's submissions in order: the late part comes after it.
  ASSERT_TRUE(c.Post(0, 0, c.buffer_bytes(), /*last=*/true).ok());
  const client::ShmSpan& first = c.spans()[0];
  auto late = c.RingRaw(0, 0, first.byte_offset, first.length * 4, c.session_id(),
                        shm::kSubmitStepPart);
  EXPECT_TRUE(IsError(late.status(), absl::StatusCode::kInvalidArgument,
                      "a part after the rank's last part of the step"))
      << late.status();
  const v1::JobStatus st = Status(spec.job_id, job->token);
  EXPECT_EQ(st.next_step(), 0);
  EXPECT_EQ(st.steps_refused(), 1);
  EXPECT_FALSE(st.fenced());
  ExpectStillServing();
}

// Rank 0 sends its step in parts; before its last part, rank 1's part is refused (a NaN) and
// the step with it. Rank 0's later parts belong to a try that ended: each is refused with why it
// ended (INVALID_ARGUMENT, non-finite), none opens a new try of the step. Before, they opened one
// holding half of rank 0's gradients, its last part refused it as "missing" spans, rank 1's retry
// was refused with that, and rank 0's retry waited for rank 1 forever. Now both retries commit.
TEST_F(ShmHostileTest, PartsOfATryThatEndedOpenNoNewTry) {
  auto job = AttachTwoRanks(client(), ShmPath(), NewJobId("cut-short"),
                            {integration::Matrix("q", {16, 24}), integration::Matrix("o", {24, 32})});
  ASSERT_TRUE(job.ok()) << job.status();
  const common::JobSpec& spec = job->spec;
  const integration::MatrixBytes& grads = job->grads;
  ShmChannel& r0 = *job->c0;
  ShmChannel& r1 = *job->c1;
  ASSERT_GE(r0.spans().size(), 2u) << "the test needs rank 0 to have two spans";
  const std::string flat0 = FlatRankBuffer(spec, 0, grads[0]);
  const std::string flat1 = FlatRankBuffer(spec, 1, grads[0]);
  std::memcpy(r0.GradientBuffer(0), flat0.data(), flat0.size());
  // Rank 0's first span goes out; the step is in flight with rank 0 begun.
  const client::ShmSpan& first = r0.spans()[0];
  ASSERT_TRUE(r0.Post(0, first.byte_offset, first.length * 4, /*last=*/false).ok());
  // Rank 1's whole step, with a NaN: refused, and the step with it.
  std::memcpy(r1.GradientBuffer(0), flat1.data(), flat1.size());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(r1.GradientBuffer(0), &nan, sizeof(nan));
  ASSERT_TRUE(r1.Post(0, 0, r1.buffer_bytes(), /*last=*/true).ok());
  auto refused1 = r1.WaitStep(0);
  EXPECT_TRUE(IsError(refused1.status(), absl::StatusCode::kInvalidArgument, "non-finite"))
      << refused1.status();
  // Rank 0's other spans, the last one as its last part: the try they belong to ended.
  for (size_t i = 1; i < r0.spans().size(); ++i) {
    const client::ShmSpan& span = r0.spans()[i];
    ASSERT_TRUE(r0.Post(0, span.byte_offset, span.length * 4, i + 1 == r0.spans().size()).ok());
  }
  auto refused0 = r0.WaitStep(0);
  EXPECT_TRUE(IsError(refused0.status(), absl::StatusCode::kInvalidArgument,
                      "the step ended before this part arrived"))
      << refused0.status();
  EXPECT_TRUE(absl::StrContains(refused0.status().message(), "non-finite")) << refused0.status();
  EXPECT_FALSE(absl::StrContains(refused0.status().message(), "is in no part of the step"))
      << refused0.status();
  // Both ranks retry with good gradients, in parts and whole: the step commits.
  std::memcpy(r1.GradientBuffer(0), flat1.data(), flat1.size());
  for (size_t i = 0; i < r0.spans().size(); ++i) {
    const client::ShmSpan& span = r0.spans()[i];
    ASSERT_TRUE(r0.Post(0, span.byte_offset, span.length * 4, i + 1 == r0.spans().size()).ok());
  }
  auto retry1 = r1.Ring(0);
  EXPECT_TRUE(retry1.ok()) << retry1.status();
  auto retry0 = r0.WaitStep(0);
  EXPECT_TRUE(retry0.ok()) << retry0.status();
  const v1::JobStatus st = Status(spec.job_id, job->token);
  EXPECT_EQ(st.next_step(), 1);
  EXPECT_EQ(st.steps_refused(), 1);
  EXPECT_FALSE(st.fenced());
  ExpectStillServing();
}

// Step 0 of a two-rank job: rank 1 sends it whole, rank 0 every span as a part but not its last
// part; returns once each of rank 0's spans is announced (every matrix is computed).
void AnnounceRankZeroWithoutItsLastPart(TwoRanks& job) {
  ShmChannel& r0 = *job.c0;
  ShmChannel& r1 = *job.c1;
  const std::string flat0 = FlatRankBuffer(job.spec, 0, job.grads[0]);
  const std::string flat1 = FlatRankBuffer(job.spec, 1, job.grads[0]);
  std::memcpy(r0.GradientBuffer(0), flat0.data(), flat0.size());
  std::memcpy(r1.GradientBuffer(0), flat1.data(), flat1.size());
  ASSERT_TRUE(r1.Post(0, 0, r1.buffer_bytes(), /*last=*/true).ok());
  for (const client::ShmSpan& span : r0.spans()) {
    ASSERT_TRUE(r0.Post(0, span.byte_offset, span.length * 4, /*last=*/false).ok());
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  auto all_ready = [&] {
    for (size_t i = 0; i < r0.spans().size(); ++i) {
      if (!r0.SpanReady(i, 0)) return false;
    }
    return true;
  };
  while (!all_ready() && std::chrono::steady_clock::now() < deadline) {
    ASSERT_TRUE(r0.WaitProgress(100).ok());
  }
  ASSERT_TRUE(all_ready()) << "rank 0's results were never announced";
}

// Every span of rank 0 is in and computed (its results announced) but its last part is not:
// the step does not commit before it. A last part that then refuses the step (a span sent twice,
// what the client library sends to drop a step it streamed) refuses it for both ranks, nothing
// committed. Before, such a step committed as soon as its data was in, and the refusing part was
// answered as part of a committed step: the trainer believed the step dropped while it had run.
TEST_F(ShmHostileTest, AStepCommitsOnlyWithEveryRanksLastPart) {
  auto job = AttachTwoRanks(client(), ShmPath(), NewJobId("last-part"),
                            {integration::Matrix("q", {16, 24}), integration::Matrix("o", {24, 32})});
  ASSERT_TRUE(job.ok()) << job.status();
  ShmChannel& r0 = *job->c0;
  ShmChannel& r1 = *job->c1;
  AnnounceRankZeroWithoutItsLastPart(*job);
  if (HasFatalFailure()) return;
  EXPECT_EQ(Status(job->spec.job_id, job->token).next_step(), 0) << "committed without rank 0's "
                                                                     "last part";
  // The last part repeats the first span: the step is refused for both ranks.
  const client::ShmSpan& first = r0.spans()[0];
  ASSERT_TRUE(r0.Post(0, first.byte_offset, first.length * 4, /*last=*/true).ok());
  auto refused0 = r0.WaitStep(0);
  EXPECT_TRUE(IsError(refused0.status(), absl::StatusCode::kInvalidArgument, "in two parts"))
      << refused0.status();
  auto refused1 = r1.WaitStep(0);
  EXPECT_TRUE(IsError(refused1.status(), absl::StatusCode::kInvalidArgument, "in two parts"))
      << refused1.status();
  EXPECT_EQ(Status(job->spec.job_id, job->token).next_step(), 0);
  // Both send it again, whole: it commits.
  std::thread other([&] { EXPECT_TRUE(r1.Ring(0).ok()); });
  auto again = r0.Ring(0);
  other.join();
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Status(job->spec.job_id, job->token).next_step(), 1);
  ExpectStillServing();
}

// A try owns its progress words: rank 0's spans were all announced in a try that its last part
// then refused; in the retry, before any matrix can be computed (rank 1 has sent nothing of it),
// none of them reads as ready, once the daemon answered the retry's first part as well as
// before. Before, the refused try's words said "step 0 ready" and the retry used its results.
TEST_F(ShmHostileTest, ARetryDoesNotReadTheRefusedTrysProgress) {
  auto job = AttachTwoRanks(client(), ShmPath(), NewJobId("retry-words"),
                            {integration::Matrix("q", {16, 24}), integration::Matrix("o", {24, 32})});
  ASSERT_TRUE(job.ok()) << job.status();
  ShmChannel& r0 = *job->c0;
  ShmChannel& r1 = *job->c1;
  ASSERT_GE(r0.spans().size(), 2u) << "the test needs rank 0 to have two spans";
  AnnounceRankZeroWithoutItsLastPart(*job);
  if (HasFatalFailure()) return;
  auto ready = [&](size_t i) { return r0.SpanReady(i, 0); };
  auto all_ready = [&] {
    for (size_t i = 0; i < r0.spans().size(); ++i) {
      if (!ready(i)) return false;
    }
    return true;
  };
  const client::ShmSpan& first = r0.spans()[0];
  ASSERT_TRUE(r0.Post(0, first.byte_offset, first.length * 4, /*last=*/true).ok());
  ASSERT_FALSE(r0.WaitStep(0).ok());
  ASSERT_FALSE(r1.WaitStep(0).ok());
  // The retry's first part: rank 0's last span, of a matrix rank 1 holds a part of too, so
  // nothing of the step can be computed before rank 1 sends again (rank 0's other spans are not
  // in this try yet).
  const size_t n = r0.spans().size();
  const client::ShmSpan& last = r0.spans()[n - 1];
  ASSERT_TRUE(std::any_of(r1.spans().begin(), r1.spans().end(),
                          [&](const client::ShmSpan& s) { return s.matrix == last.matrix; }))
      << "the test needs rank 0's last span in a matrix rank 1 holds a part of";
  ASSERT_TRUE(r0.Post(0, last.byte_offset, last.length * 4, /*last=*/false).ok());
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(r0.WaitProgress(10).ok());
    for (size_t k = 0; k < r0.spans().size(); ++k) {
      EXPECT_FALSE(ready(k)) << "span " << k << " reads as ready in the retry (the refused try's "
                                "word)";
    }
  }
  for (size_t k = 0; k + 1 < n; ++k) {
    const client::ShmSpan& span = r0.spans()[k];
    ASSERT_TRUE(r0.Post(0, span.byte_offset, span.length * 4, k + 2 == n).ok());
  }
  std::thread other([&] { EXPECT_TRUE(r1.Ring(0).ok()); });
  auto again = r0.WaitStep(0);
  other.join();
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(all_ready());
  EXPECT_EQ(Status(job->spec.job_id, job->token).next_step(), 1);
  ExpectStillServing();
}

}  // namespace
}  // namespace muond::shmtest
