// Hostile peers and the shared-memory regions (issue 4): non-finite gradients are refused naming
// matrix and rank with the momentum untouched; the update region cannot be written by the peer;
// one session's regions are not another's.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/integration/multirank_util.h"
#include "tests/shm/shm_hostile_fixture.h"
#include "tests/shm/shm_test_util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace muond::shmtest {
namespace {

namespace shm = common::shm;
using client::Transport;
using common::DType;
using integration::MakeGradients;
using integration::MixedMatrices;
using integration::StepThread;
using integration::WaitForJob;

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

}  // namespace
}  // namespace muond::shmtest
