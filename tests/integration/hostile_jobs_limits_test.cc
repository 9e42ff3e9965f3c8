// Hostile and careless requests against jobs (label `hostile`): names that would escape the state
// directory and sizes beyond the daemon's limits are refused before anything is allocated, and a
// deleted job's memory is returned. After each attack the daemon still serves and a victim job
// keeps its state.
#include <sys/types.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec_proto.h"
#include "gtest/gtest.h"
#include "tests/integration/hostile_jobs_fixture.h"

namespace muond::integration {
namespace {

// Resident memory of a process in bytes (VmRSS).
uint64_t ResidentBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmRSS:")) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

TEST_F(HostileJobsTest, NamesThatWouldEscapeAreRefusedAndNothingIsRemoved) {
  Start();
  MakeVictim();
  const std::string nul("a\0b", 3);
  for (const std::string& id : {std::string("."), std::string(".."), std::string(".deleted-x"),
                                std::string("a/b"), std::string("../x"), std::string(10000, 'a'),
                                nul, std::string(""), std::string(".hidden")}) {
    v1::JobSpec spec = common::JobSpecToProto(SmallSpec("x"));
    spec.set_job_id(id);
    const grpc::Status s = RawCreate(daemon_->address(), spec);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << id.substr(0, 20);
    EXPECT_LT(s.error_message().size(), 400u) << "the message repeats the whole id";
    std::printf("job_id %s (%zu bytes): %d %s\n", id.substr(0, 12).c_str(), id.size(),
                s.error_code(), s.error_message().substr(0, 120).c_str());
  }
  for (const std::string& name : {nul, std::string(300, 'm'), std::string("a\nb")}) {
    v1::JobSpec spec = common::JobSpecToProto(SmallSpec("names"));
    spec.mutable_matrices(0)->set_name(name);
    const grpc::Status s = RawCreate(daemon_->address(), spec);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  // A GetJob with a huge id: a short INVALID_ARGUMENT (no metadata-size failure).
  auto huge = client_->GetJob(std::string(10000, 'z'), "t");
  EXPECT_TRUE(absl::IsInvalidArgument(huge.status())) << huge.status();
  EXPECT_LT(huge.status().message().size(), 400u);
  ExpectVictimIntact();
  // Nothing outside the victim's directory moved; a restart brings it back.
  Stop();
  Start();
  auto st = client_->GetJob("victim", victim_token_);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 1);
  Stop();
}

TEST_F(HostileJobsTest, SizesBeyondTheLimitsAreRefusedBeforeAllocating) {
#if defined(__SANITIZE_ADDRESS__)
  // ASan's shadow memory and allocator metadata move the daemon's RSS by tens of MiB on their own.
  GTEST_SKIP() << "AddressSanitizer build: the daemon's RSS is not its allocations";
#endif
  Start({"--max-jobs", "3", "--max-state-bytes", "268435456"});
  MakeVictim();
  const uint64_t rss_before = ResidentBytes(daemon_->pid());
  struct Case {
    std::string what;
    common::JobSpec spec;
    std::string limit;
  };
  std::vector<Case> cases;
  {
    common::JobSpec s = SmallSpec("wide", 65536, 3);
    s.matrices.clear();
    for (int i = 0; i < 1500; ++i) s.matrices.push_back(Matrix(absl::StrCat("m", i), {2, 2}));
    cases.push_back({"world size 65536, stage 3, 1500 x [2, 2]", s, "--max-world-size 4096"});
  }
  {
    common::JobSpec s = SmallSpec("huge");
    s.matrices = {Matrix("h", {131072, 131072})};
    cases.push_back({"one [131072, 131072] matrix", s, "--max-state-bytes 268435456"});
  }
  {
    common::JobSpec s = SmallSpec("spans", 4096, 3);
    s.matrices.clear();
    for (int i = 0; i < 300; ++i) s.matrices.push_back(Matrix(absl::StrCat("m", i), {64, 64}));
    cases.push_back({"4096 ranks x 300 tensors of 4096 elements", s, "--max-spans-per-job"});
  }
  {
    common::JobSpec s = SmallSpec("many");
    s.matrices.clear();
    for (int i = 0; i < 70000; ++i) s.matrices.push_back(Matrix(absl::StrCat("t", i), {1, 1}));
    cases.push_back({"70000 tensors", s, "--max-tensors-per-job 65536"});
  }
  {
    common::JobSpec s = SmallSpec("budget");
    s.gather_budget_bytes = uint64_t{1} << 40;
    cases.push_back({"gather budget 1 TiB", s, "--gather-budget-bytes"});
  }
  for (const Case& c : cases) {
    const grpc::Status s = RawCreate(daemon_->address(), common::JobSpecToProto(c.spec));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << c.what << ": "
                                                                   << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), c.limit)) << s.error_message();
    std::printf("%s: code %d: %s\n", c.what.c_str(), s.error_code(), s.error_message().c_str());
  }
  // Jobs: the victim plus two more fit under --max-jobs 3; the fourth is refused.
  auto j2 = client_->CreateJob(SmallSpec("j2"));
  auto j3 = client_->CreateJob(SmallSpec("j3"));
  ASSERT_TRUE(j2.ok() && j3.ok());
  const grpc::Status fourth = RawCreate(daemon_->address(), common::JobSpecToProto(SmallSpec("j4")));
  EXPECT_EQ(fourth.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << fourth.error_message();
  EXPECT_TRUE(absl::StrContains(fourth.error_message(), "--max-jobs 3")) << fourth.error_message();
  const uint64_t rss_after = ResidentBytes(daemon_->pid());
  std::printf("resident memory before %.1f MiB, after the refusals %.1f MiB\n",
              rss_before / 1048576.0, rss_after / 1048576.0);
  EXPECT_LT(rss_after, rss_before + (24u << 20)) << "a refusal allocated";
  ASSERT_TRUE(client_->DeleteJob("j2", *j2).ok());
  ASSERT_TRUE(client_->DeleteJob("j3", *j3).ok());
  ExpectVictimIntact();
  Stop();
}

// --max-state-bytes bounds everything a job can hold, not only its momentum: a job whose momentum
// fits but whose shared-memory regions, step buffers, save copy and gathered matrices do not is
// refused at creation, naming the limit; one that fits whole is accepted.
TEST_F(HostileJobsTest, StateLimitCountsBuffersRegionsAndCopies) {
  Start({"--max-state-bytes", "67108864"});  // 64 MiB
  // 4 Mi fp32 elements: 32 MiB of momentum (both buffers) fits; with the regions (2B + 3U =
  // 80 MiB), a save's copy (16 MiB) and the gathered matrix (32 MiB) it does not.
  common::JobSpec big = SmallSpec("momentum-fits");
  big.matrices = {Matrix("w", {2048, 2048})};
  const grpc::Status s = RawCreate(daemon_->address(), common::JobSpecToProto(big));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  for (const std::string& want :
       {std::string("--max-state-bytes 67108864"), std::string("shared-memory regions")}) {
    EXPECT_TRUE(absl::StrContains(s.error_message(), want)) << want << " in " << s.error_message();
  }
  std::printf("4 Mi-element job under --max-state-bytes 64 MiB: %s\n", s.error_message().c_str());
  // A quarter of it fits whole (8 MiB momentum, 20 MiB regions and buffers, 4 + 8 MiB copies).
  common::JobSpec small = SmallSpec("fits-whole");
  small.matrices = {Matrix("w", {1024, 1024})};
  auto token = client_->CreateJob(small);
  ASSERT_TRUE(token.ok()) << token.status();
  ASSERT_TRUE(client_->DeleteJob("fits-whole", *token).ok());
  Stop();
}

TEST_F(HostileJobsTest, MemoryOfADeletedJobIsReturned) {
  Start();
  MakeVictim();
  const uint64_t before = ResidentBytes(daemon_->pid());
  // The shape that took 2.3 GiB before (at the largest world size allowed now), and 64 MiB of
  // momentum.
  common::JobSpec wide = SmallSpec("wide", 4096, 3);
  wide.matrices.clear();
  for (int i = 0; i < 1500; ++i) wide.matrices.push_back(Matrix(absl::StrCat("m", i), {2, 2}));
  auto wide_token = client_->CreateJob(wide);
  ASSERT_TRUE(wide_token.ok()) << wide_token.status();
  const uint64_t with_wide = ResidentBytes(daemon_->pid());
  common::JobSpec big = SmallSpec("big");
  big.matrices = {Matrix("b", {4096, 4096})};
  auto big_token = client_->CreateJob(big);
  ASSERT_TRUE(big_token.ok()) << big_token.status();
  const uint64_t with_big = ResidentBytes(daemon_->pid());
  ASSERT_TRUE(client_->DeleteJob("wide", *wide_token).ok());
  ASSERT_TRUE(client_->DeleteJob("big", *big_token).ok());
  const uint64_t after = ResidentBytes(daemon_->pid());
  std::printf("resident MiB: before %.1f, + world 4096 x 1500 tensors %.1f, + 64 MiB job %.1f, "
              "after deleting both %.1f\n",
              before / 1048576.0, with_wide / 1048576.0, with_big / 1048576.0,
              after / 1048576.0);
  EXPECT_LT(with_wide, before + (64u << 20)) << "a world-4096 job of 24 KB momentum";
  EXPECT_GT(with_big, with_wide + (48u << 20)) << "the 64 MiB momentum is resident";
  EXPECT_LT(after, before + (8u << 20)) << "memory stayed after the jobs were deleted";
  ExpectVictimIntact();
  Stop();
}

}  // namespace
}  // namespace muond::integration
