// Bad input and hostile peers on the shared-memory data plane (issue 4): malformed doorbells get
// clear errors and leave the session working; a corrupt ring, or a peer that talks after
// attaching, ends that session only; non-finite gradients are refused naming matrix and rank with
// the momentum untouched; the update region cannot be written by the peer; one session's regions
// are not another's; a peer that never rings holds nobody.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/shm_channel.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"
#include "tests/shm/shm_test_util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace muond::shmtest {
namespace {

namespace shm = common::shm;
using client::ShmChannel;
using client::Transport;
using common::DType;
using integration::DaemonSuite;
using integration::MakeGradients;
using integration::Matrix;
using integration::MixedMatrices;
using integration::StepThread;
using integration::WaitForJob;

class ShmHostileTest : public DaemonSuite {
 protected:
  static std::string ShmPath() { return client::ShmSocketFor(address()); }

  // A world-size-1 float32 job with three matrices; its reference updates (a separate job over
  // gRPC) for `steps` steps.
  struct Ws1 {
    common::JobSpec spec;
    std::string token;
    MatrixBytes grads;
    std::vector<std::vector<std::string>> want;  // [step][matrix]
  };
  Ws1 NewWs1(const std::string& prefix, int steps, uint64_t seed) {
    Ws1 j;
    j.spec = MakeSpec(NewJobId(prefix), 1, 0,
                      {Matrix("q", {32, 24}), Matrix("experts", {2, 16, 8}), Matrix("o", {24, 32})});
    j.grads = MakeGradients(j.spec.matrices, steps, seed);
    auto ref = RunTrajectory(client(), MakeSpec(NewJobId(prefix + "-ref"), 1, 0, j.spec.matrices),
                             Api::kGrpcStep, j.grads);
    EXPECT_TRUE(ref.ok()) << ref.status();
    if (ref.ok()) j.want = ref->updates[0];
    auto token = client().CreateJob(j.spec);
    EXPECT_TRUE(token.ok()) << token.status();
    if (token.ok()) j.token = *token;
    return j;
  }

  // Whole-matrix update bytes (one entry per matrix) read from a world-size-1 update buffer.
  static std::vector<std::string> Ws1Update(const common::JobSpec& spec, const char* buffer) {
    std::vector<std::string> out;
    for (const common::ShardSpan& s : common::RankSpans(spec, 0)) {
      out.emplace_back(buffer + s.rank_offset * 4, s.length * 4);
    }
    return out;
  }

  static v1::JobStatus Status(const std::string& id, const std::string& token) {
    auto st = client().GetJob(id, token);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? *st : v1::JobStatus();
  }
};

::testing::AssertionResult IsError(const absl::Status& s, absl::StatusCode code,
                                   const std::string& text) {
  if (s.code() == code && absl::StrContains(s.message(), text)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "got " << s << "; want " << absl::StatusCodeToString(code)
                                       << " containing '" << text << "'";
}

// Every malformed doorbell field gets its own clear error, the session is not ended, the step is
// not refused or fenced, and a correct doorbell afterwards computes the reference update.
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
    const uint32_t buf = static_cast<uint32_t>(step % 2);
    const auto kInvalid = absl::StatusCode::kInvalidArgument;
    const auto kPrecondition = absl::StatusCode::kFailedPrecondition;
    struct Bad {
      std::string what;
      absl::StatusOr<ShmChannel::Ringing> got;
      absl::StatusCode code;
      std::string text;
    };
    const std::vector<Bad> bad = {
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
        {"buffer out of range", c.RingRaw(step, 7, 0, bb, gen), kInvalid,
         "buffer 7 is not step % 2"},
        {"negative step", c.RingRaw(-1, 1, 0, bb, gen), kInvalid, "is not step % 2"},
        {"stale generation", c.RingRaw(step, buf, 0, bb, old_generation), kPrecondition,
         absl::StrCat("stale generation ", old_generation, " (the session's is ", gen, ")")},
        {"future generation", c.RingRaw(step, buf, 0, bb, gen + 1000), kPrecondition,
         "stale generation"},
        {"step ahead", c.RingRaw(step + 5, static_cast<uint32_t>((step + 5) % 2), 0, bb, gen),
         kPrecondition,
         absl::StrCat("step ", step + 5, " out of order: expected step ", step)},
    };
    for (const Bad& b : bad) {
      EXPECT_TRUE(IsError(b.got.status(), b.code, b.text)) << b.what;
      EXPECT_TRUE(absl::StrContains(b.got.status().message(),
                                    absl::StrCat("job '", j.spec.job_id, "'")))
          << b.what << ": the error names the job: " << b.got.status();
    }
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
  auto other_step = [&](int64_t step) {
    auto u = StepWith(Api::kZeroCopy, **other, step, b.grads[step]);
    ASSERT_TRUE(u.ok()) << "the other job, step " << step << ": " << u.status();
    EXPECT_EQ(*u, b.want[step]) << "the other job, step " << step;
  };
  auto rank_attached = [&](bool want) {
    return WaitForJob(client(), a.spec.job_id, a.token,
                      [&](const v1::JobStatus& st) { return st.ranks(0).attached() == want; }, 10);
  };
  other_step(0);

  // 1. The head far ahead of the tail.
  {
    auto peer = RawShmPeer::Attach(ShmPath(), a.spec.job_id, 0, a.token);
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
    EXPECT_TRUE(rank_attached(false));
    EXPECT_EQ((*peer)->Ring((*peer)->Valid(1), 5).code(), absl::StatusCode::kUnavailable);
  }
  other_step(1);

  // 2. The head behind the tail (after one good step, the head goes back to 0).
  {
    auto peer = RawShmPeer::Attach(ShmPath(), a.spec.job_id, 0, a.token);
    ASSERT_TRUE(peer.ok()) << peer.status();
    const std::string flat = FlatRankBuffer(a.spec, 0, a.grads[1]);
    std::memcpy((*peer)->grad() + (*peer)->buffer_bytes(), flat.data(), flat.size());
    ASSERT_TRUE((*peer)->Ring((*peer)->Valid(1)).ok());
    EXPECT_EQ(Ws1Update(a.spec, (*peer)->update() + (*peer)->buffer_bytes()), a.want[1]);
    (*peer)->Publish((*peer)->Valid(2), 0);
    EXPECT_TRUE((*peer)->WaitHangUp(10)) << "the daemon kept a session whose head went back";
    EXPECT_TRUE(rank_attached(false));
  }

  // 3. A library peer that sends a datagram on its socket after attaching.
  {
    // The channel's socket: the SOCK_SEQPACKET socket (by inode) that was not there before.
    auto sockets = [] {
      std::map<std::string, int> out;  // "socket:[inode]" -> fd
      for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
        std::error_code ec;
        const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
        if (!ec && absl::StartsWith(target, "socket:")) {
          out[target] = std::stoi(e.path().filename().string());
        }
      }
      return out;
    };
    const std::map<std::string, int> before = sockets();
    auto ch = ShmChannel::Attach(ShmPath(), a.spec.job_id, 0, a.token, false);
    ASSERT_TRUE(ch.ok()) << ch.status();
    int conn = -1;
    for (const auto& [target, fd] : sockets()) {
      int type = 0;
      socklen_t len = sizeof(type);
      if (before.count(target) == 0 && getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 &&
          type == SOCK_SEQPACKET) {
        conn = fd;
      }
    }
    ASSERT_GE(conn, 0) << "the channel's SOCK_SEQPACKET socket";
    ASSERT_EQ(send(conn, "hi", 2, MSG_NOSIGNAL), 2);
    EXPECT_TRUE(rank_attached(false)) << "the daemon kept a session that talked after attach";
    const std::string flat = FlatRankBuffer(a.spec, 0, a.grads[2]);
    std::memcpy((*ch)->GradientBuffer(2), flat.data(), flat.size());
    auto r = (*ch)->Ring(2);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "ended the shared-memory session"))
        << r.status();
  }
  other_step(2);

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

// A NaN written into the gradient region is refused with INVALID_ARGUMENT naming the matrix and
// the rank, for every rank of the step, and leaves the momentum bit-identical: the clean retry of
// the step and the step after it equal a fresh job's steps bit for bit.
TEST_F(ShmHostileTest, NonFiniteGradientIsRefusedNamingMatrixAndRankMomentumUntouched) {
  const std::vector<common::MatrixSpec> matrices = MixedMatrices(DType::kBFloat16, DType::kBFloat16);
  const MatrixBytes grads = MakeGradients(matrices, 2, /*seed=*/11);
  auto ref = RunTrajectory(client(), MakeSpec(NewJobId("nan-ref"), 2, 2, matrices), Api::kGrpcStep,
                           grads);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const common::JobSpec spec = MakeSpec(NewJobId("nan"), 2, 2, matrices);
  auto token = client().CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  std::unique_ptr<client::RankSession> s[2];
  for (int r = 0; r < 2; ++r) {
    auto a = client().Attach(spec.job_id, r, *token, false, Transport::kShm);
    ASSERT_TRUE(a.ok()) << a.status();
    s[r] = *std::move(a);
  }
  // Rank 1's span of "experts" (matrix 2) gets a NaN in its middle.
  const common::ShardSpan* experts = nullptr;
  for (const common::ShardSpan& span : s[1]->spans()) {
    if (span.matrix == 2) experts = &span;
  }
  ASSERT_NE(experts, nullptr) << "rank 1 owns part of 'experts'";
  const uint64_t nan_at = experts->offset + experts->length / 2;

  // Rank 0 rings a clean step 0 and waits; rank 1 rings one with the NaN.
  absl::StatusOr<std::vector<std::string>> rank0;
  {
    StepThread t([&] { rank0 = StepWith(Api::kZeroCopy, *s[0], 0, grads[0]); },
                 [&] { (void)client().DeleteJob(spec.job_id, *token); });
    ASSERT_TRUE(WaitForJob(client(), spec.job_id, *token, [](const v1::JobStatus& st) {
      return st.ranks(0).finished_pushing();
    }));
    ASSERT_TRUE(FillGradientView(*s[1], 0, grads[0]).ok());
    auto view = s[1]->GradientView(0);
    ASSERT_TRUE(view.ok());
    const std::string nan = NanBytes(DType::kBFloat16);
    std::memcpy(view->data + (experts->rank_offset + (nan_at - experts->offset)) * 2, nan.data(),
                nan.size());
    auto r1 = s[1]->StepInPlace(0);
    EXPECT_TRUE(IsError(r1.status(), absl::StatusCode::kInvalidArgument,
                        absl::StrCat("rank 1: matrix 'experts' has a non-finite gradient value at "
                                     "element ", nan_at)));
    t.Join();
  }
  EXPECT_TRUE(IsError(rank0.status(), absl::StatusCode::kInvalidArgument, "matrix 'experts'"))
      << "the waiting rank learns why";
  EXPECT_TRUE(absl::StrContains(rank0.status().message(), "rank 1")) << rank0.status();
  v1::JobStatus st = Status(spec.job_id, *token);
  EXPECT_EQ(st.steps_refused(), 1);
  EXPECT_EQ(st.next_step(), 0);
  EXPECT_FALSE(st.fenced());
  EXPECT_EQ(st.steps_completed(), 0);

  // Rank 0 alone sends a NaN first (no step in flight yet): refused at once.
  {
    ASSERT_TRUE(FillGradientView(*s[0], 0, grads[0]).ok());
    auto view = s[0]->GradientView(0);
    const std::string nan = NanBytes(DType::kBFloat16);
    std::memcpy(view->data, nan.data(), nan.size());  // element 0 of "big"
    auto r0 = s[0]->StepInPlace(0);
    EXPECT_TRUE(IsError(r0.status(), absl::StatusCode::kInvalidArgument,
                        "rank 0: matrix 'big' has a non-finite gradient value at element 0"));
  }
  // Rank 1 had not begun that step: it is owed the refusal, once (it must not begin a step rank 0
  // has already left, nor mix its gradients into rank 0's retry).
  {
    ASSERT_TRUE(FillGradientView(*s[1], 0, grads[0]).ok());
    auto r1 = s[1]->StepInPlace(0);
    EXPECT_TRUE(IsError(r1.status(), absl::StatusCode::kInvalidArgument,
                        "rank 0: matrix 'big' has a non-finite gradient value at element 0"));
  }
  // The clean steps equal the fresh job's, bit for bit.
  for (int64_t step = 0; step < 2; ++step) {
    auto got = StepAllRanks(client(), spec.job_id, *token, {s[0].get(), s[1].get()},
                            {Api::kShmStep, Api::kZeroCopy}, step, grads[step]);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(got[r].ok()) << "rank " << r << " step " << step << ": " << got[r].status();
      EXPECT_EQ(*got[r], ref->updates[r][step]) << "rank " << r << " step " << step;
    }
  }
  st = Status(spec.job_id, *token);
  EXPECT_EQ(st.steps_refused(), 2);
  EXPECT_EQ(st.steps_completed(), 2);
  EXPECT_FALSE(st.fenced());
  for (auto& x : s) x.reset();
  ASSERT_TRUE(client().DeleteJob(spec.job_id, *token).ok());
}

// The peer cannot write its update region: it is sealed F_SEAL_FUTURE_WRITE, so a writable shared
// mapping, a write(), and turning the read-only mapping writable all fail (also through a fresh
// open of the descriptor); neither region can be resized. A private (copy-on-write) mapping is
// allowed but changes nothing the daemon or the peer's shared view sees. Everything a peer does
// to its own regions leaves another session's data intact.
TEST_F(ShmHostileTest, UpdateRegionIsReadOnlyForThePeerAndSessionsAreSeparate) {
  Ws1 a = NewWs1("seal-a", 1, 21);
  Ws1 b = NewWs1("seal-b", 1, 22);
  ASSERT_FALSE(a.want.empty());
  ASSERT_FALSE(b.want.empty());
  auto pa = RawShmPeer::Attach(ShmPath(), a.spec.job_id, 0, a.token);
  ASSERT_TRUE(pa.ok()) << pa.status();
  auto pb = RawShmPeer::Attach(ShmPath(), b.spec.job_id, 0, b.token);
  ASSERT_TRUE(pb.ok()) << pb.status();
  RawShmPeer& peer = **pa;
  const size_t region = 2 * peer.buffer_bytes();

  // Peer B's step 0 is in its gradient region before peer A starts misbehaving.
  const std::string flat_b = FlatRankBuffer(b.spec, 0, b.grads[0]);
  std::memcpy((*pb)->grad(), flat_b.data(), flat_b.size());

  const int seals = fcntl(peer.update_fd(), F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_FUTURE_WRITE) << "seals " << seals;
  EXPECT_TRUE(seals & F_SEAL_SEAL) << "seals " << seals;
  EXPECT_EQ(fcntl(peer.update_fd(), F_ADD_SEALS, F_SEAL_WRITE), -1) << "seals are sealed";
  errno = 0;
  void* w = mmap(nullptr, region, PROT_READ | PROT_WRITE, MAP_SHARED, peer.update_fd(), 0);
  EXPECT_EQ(w, MAP_FAILED);
  EXPECT_EQ(errno, EPERM) << strerror(errno);
  if (w != MAP_FAILED) munmap(w, region);
  errno = 0;
  EXPECT_EQ(pwrite(peer.update_fd(), "x", 1, 0), -1);
  EXPECT_EQ(errno, EPERM) << strerror(errno);
  errno = 0;
  EXPECT_NE(mprotect(const_cast<char*>(peer.update()), region, PROT_READ | PROT_WRITE), 0)
      << "the read-only mapping of the update region became writable";
  EXPECT_TRUE(errno == EACCES || errno == EPERM) << strerror(errno);
  {
    const int reopened =
        open(absl::StrCat("/proc/self/fd/", peer.update_fd()).c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(reopened, 0) << strerror(errno);
    errno = 0;
    void* w2 = mmap(nullptr, region, PROT_READ | PROT_WRITE, MAP_SHARED, reopened, 0);
    EXPECT_EQ(w2, MAP_FAILED) << "a fresh open of the update region mapped writable";
    EXPECT_EQ(errno, EPERM) << strerror(errno);
    if (w2 != MAP_FAILED) munmap(w2, region);
    close(reopened);
  }
  for (int fd : {peer.grad_fd(), peer.update_fd()}) {
    errno = 0;
    EXPECT_EQ(ftruncate(fd, 4096), -1) << "a region shrank";
    EXPECT_EQ(errno, EPERM) << strerror(errno);
    EXPECT_EQ(ftruncate(fd, 64 << 20), -1) << "a region grew";
  }
  struct stat sa, sb;
  ASSERT_EQ(fstat(peer.grad_fd(), &sa), 0);
  ASSERT_EQ(fstat((*pb)->grad_fd(), &sb), 0);
  EXPECT_NE(sa.st_ino, sb.st_ino) << "two sessions share a gradient region";
  ASSERT_EQ(fstat(peer.update_fd(), &sa), 0);
  ASSERT_EQ(fstat((*pb)->update_fd(), &sb), 0);
  EXPECT_NE(sa.st_ino, sb.st_ino) << "two sessions share an update region";

  // A private writable mapping: the peer's scribbles stay private.
  void* priv = mmap(nullptr, region, PROT_READ | PROT_WRITE, MAP_PRIVATE, peer.update_fd(), 0);
  ASSERT_NE(priv, MAP_FAILED) << strerror(errno);
  std::memset(priv, 0x7f, region);

  // Peer A fills everything it can write with garbage: its whole gradient region (NaN bytes) and
  // its ring's submission slots; then rings a garbage doorbell and a valid one.
  std::memset(peer.grad(), 0xff, region);
  for (auto& sub : peer.ring()->subs) std::memset(&sub, 0xab, sizeof(sub));
  shm::Submission garbage = peer.Valid(0);
  garbage.size = region;  // both buffers: outside the rank's buffer
  EXPECT_TRUE(IsError(peer.Ring(garbage), absl::StatusCode::kInvalidArgument, "is not the rank's"));
  EXPECT_TRUE(IsError(peer.Ring(peer.Valid(0)), absl::StatusCode::kInvalidArgument,
                      "non-finite gradient value"));
  // Peer B steps: the reference update, read through its read-only shared mapping.
  ASSERT_TRUE((*pb)->Ring((*pb)->Valid(0)).ok());
  EXPECT_EQ(Ws1Update(b.spec, (*pb)->update()), b.want[0]);
  // Peer A cleans up and steps: its shared view holds the daemon's update, not the private bytes.
  const std::string flat_a = FlatRankBuffer(a.spec, 0, a.grads[0]);
  std::memcpy(peer.grad(), flat_a.data(), flat_a.size());
  ASSERT_TRUE(peer.Ring(peer.Valid(0)).ok());
  EXPECT_EQ(Ws1Update(a.spec, peer.update()), a.want[0]);
  EXPECT_EQ(static_cast<unsigned char*>(priv)[0], 0x7f);
  munmap(priv, region);
  pa->reset();
  pb->reset();
  ASSERT_TRUE(client().DeleteJob(a.spec.job_id, a.token).ok());
  ASSERT_TRUE(client().DeleteJob(b.spec.job_id, b.token).ok());
}

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
