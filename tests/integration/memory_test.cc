// The daemon's resident memory does not grow with the number of steps and stays within the gather
// budget plus the momentum (plus the gradient and update buffers of the steps in flight): a job
// with 4 MiB of momentum stepped 200 times by 2 concurrent ranks (issue 3, "Memory").
#include <algorithm>
#include <cstdio>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// VmRSS of `pid` in bytes (0 when it cannot be read).
// A "<field>: N kB" line of /proc/<pid>/status in bytes (0 when absent). VmRSS: all resident
// memory; RssShmem: its shared-memory part (the sessions' memfd regions, whose double buffers are
// first touched whenever a rank first rings while its other buffer is still in use, so they can
// appear after any warm-up).
uint64_t StatusBytes(pid_t pid, absl::string_view field) {
  const std::string status = ReadWholeFile(absl::StrCat("/proc/", pid, "/status"));
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, field) || !absl::ConsumePrefix(&line, ":")) continue;
    line = absl::StripAsciiWhitespace(line);
    uint64_t kib = 0;
    if (absl::ConsumeSuffix(&line, "kB") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib)) {
      return kib * 1024;
    }
  }
  return 0;
}

uint64_t ResidentBytes(pid_t pid) { return StatusBytes(pid, "VmRSS"); }
// Resident memory other than shared memory: what a leak on the daemon's heap would grow.
uint64_t PrivateResidentBytes(pid_t pid) {
  return StatusBytes(pid, "VmRSS") - StatusBytes(pid, "RssShmem");
}

double MiB(uint64_t bytes) { return static_cast<double>(bytes) / kMiB; }

class MemoryTest : public DaemonSuite {};

// Steps [first, last) of the job with every rank in its own thread and Client (StepBuffer),
// cycling through `grads`. Returns the first error.
absl::Status StepRange(const std::string& address, const common::JobSpec& spec,
                       const std::string& token, const MatrixBytes& grads, int64_t first,
                       int64_t last) {
  std::vector<absl::Status> status(spec.world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < spec.world_size; ++r) {
    threads.emplace_back([&, r] {
      auto c = client::Client::Connect(address);
      if (!c.ok()) {
        status[r] = c.status();
        return;
      }
      auto s = (*c)->Attach(spec.job_id, r, token);
      if (!s.ok()) {
        status[r] = s.status();
        return;
      }
      for (int64_t t = first; t < last && status[r].ok(); ++t) {
        status[r] = StepFlatBuffer(**s, t, grads[t % grads.size()]).status();
        if (!status[r].ok())
          status[r] = absl::Status(
              status[r].code(),
              absl::StrCat("rank ", r, " step ", t, ": ", std::string(status[r].message())));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

TEST_F(MemoryTest, ResidentMemoryIsBoundedOver200Steps) {
  // Warm the daemon's compute path (LibTorch's first use) before the baseline.
  ExpectStillServing();
  const pid_t pid = daemon_pid();
  const uint64_t before = ResidentBytes(pid);
  ASSERT_GT(before, 0u);

  common::JobSpec spec;
  spec.job_id = NewJobId("memory");
  spec.world_size = 2;
  spec.zero_stage = 2;
  // 4 MiB of momentum; "a" is larger than one 2.5 MiB partition.
  spec.matrices = {Matrix("a", {16, 40960}), Matrix("b", {32, 12288})};
  spec.gather_budget_bytes = 8 * kMiB;
  uint64_t elements = 0, largest = 0;
  for (const common::MatrixSpec& m : spec.matrices) {
    elements += m.numel();
    largest = std::max<uint64_t>(largest, m.numel());
  }
  const uint64_t momentum = elements * sizeof(float);
  const uint64_t gradient = elements * sizeof(float);  // float32 gradients, all ranks together
  ASSERT_GE(spec.gather_budget_bytes, 8 * largest) << "the budget must hold the largest matrix";
  auto token = client().CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  const MatrixBytes grads = MakeGradients(spec.matrices, 4, /*seed=*/61);

  ASSERT_TRUE(StepRange(address(), spec, *token, grads, 0, 20).ok());
  const uint64_t after20 = ResidentBytes(pid);
  const uint64_t private20 = PrivateResidentBytes(pid);
  const absl::Status rest = StepRange(address(), spec, *token, grads, 20, 200);
  ASSERT_TRUE(rest.ok()) << rest;
  const uint64_t after200 = ResidentBytes(pid);
  const uint64_t private200 = PrivateResidentBytes(pid);

  auto st = client().GetJob(spec.job_id, *token);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->steps_completed(), 200);
  EXPECT_EQ(st->next_step(), 200);
  EXPECT_EQ(st->momentum_bytes(), momentum);
  EXPECT_EQ(st->gather_budget_bytes(), spec.gather_budget_bytes);
  EXPECT_LE(st->gather_peak_bytes(), spec.gather_budget_bytes);

  // The momentum twice: the committed front and the back buffer the step's new momentum is
  // written into (the commit flips them, momentum_store.h). The 16 MiB of slack hold what the
  // budget does not count: each compute thread's Newton-Schulz scratch for the largest group
  // (README, backends) and the allocator's own.
  const uint64_t bound = spec.gather_budget_bytes + 2 * momentum + 2 * gradient + 16 * kMiB;
  // Growth of the daemon's own (non-shared) memory; the total below includes the shared regions.
  const int64_t growth = static_cast<int64_t>(private200) - static_cast<int64_t>(private20);
  const int64_t total = static_cast<int64_t>(after200) - static_cast<int64_t>(before);
  std::printf(
      "memory: muond VmRSS before job %.1f MiB, after step 20 %.1f MiB, after step 200 %.1f MiB; "
      "private (non-shared) growth 20->200 %.2f MiB (limit 8); job total %.2f MiB (bound %.1f MiB "
      "= budget %.1f + "
      "2 x momentum %.1f + 2 x gradients %.1f + 16 slack); gather peak %.1f MiB\n",
      MiB(before), MiB(after20), MiB(after200), growth / double(kMiB), total / double(kMiB),
      MiB(bound), MiB(spec.gather_budget_bytes), MiB(momentum), MiB(2 * gradient),
      MiB(st->gather_peak_bytes()));
  std::fflush(stdout);
  EXPECT_LT(growth, static_cast<int64_t>(8 * kMiB)) << "resident memory grows with steps";
  EXPECT_TRUE(client().DeleteJob(spec.job_id, *token).ok());
#if defined(__SANITIZE_ADDRESS__)
  // The growth above is checked; the total is not the daemon's: ASan's shadow (an eighth of the
  // memory it maps), redzones and allocator caches move it by several MiB (43.9 MiB of a 40 MiB
  // bound measured, against 31.9 MiB for the same steps without ASan).
  GTEST_SKIP() << "AddressSanitizer build: the job's total RSS against its bound is not checked";
#endif
  EXPECT_LE(total, static_cast<int64_t>(bound));
}

}  // namespace
}  // namespace muond::integration
