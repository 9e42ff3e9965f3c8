// An import or a restore the system cannot allocate memory for (issue 32, item 4: "reservations are
// released on every error and exception path, including bad_alloc in loads and imports"). The
// daemon's address space is capped (prlimit RLIMIT_AS) so that a job's own stores still fit and the
// import's read buffers do not: the import's std::bad_alloc is a clear RESOURCE_EXHAUSTED naming
// the job, the daemon keeps serving, and the job's id and bytes are free again (--max-jobs 1: a
// reservation left behind would refuse the next job).
#include <sys/resource.h>

#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

constexpr uint64_t kMiB = 1 << 20;

// A field of /proc/PID/status in bytes ("VmSize:", "VmRSS:"); 0 when unreadable.
uint64_t StatusBytes(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) != 0) continue;
    std::istringstream fields(line.substr(field.size()));
    uint64_t kib = 0;
    fields >> kib;
    return kib * 1024;
  }
  return 0;
}

// Sets the soft address-space limit of `pid` (RLIM_INFINITY lifts it); true on success.
bool LimitAddressSpace(pid_t pid, rlim_t bytes) {
  rlimit lim{};
  if (::prlimit(pid, RLIMIT_AS, nullptr, &lim) != 0) return false;
  lim.rlim_cur = bytes;
  return ::prlimit(pid, RLIMIT_AS, &lim, nullptr) == 0;
}

// One 8192 x 4096 fp32 matrix: 128 MiB of momentum, read whole by an import.
common::JobSpec BigJob(const std::string& id) {
  common::MatrixSpec m = CaseMatrix("wide_std", "w");
  m.shape = {8192, 4096};
  return WholeMatrixJob(id, "wide_std", {m});
}

// The address-space cap of the tests: what the daemon maps now, plus what a job of BigJob's spec
// maps on its own (its stores: measured by creating and deleting one), plus 48 MiB, less than
// the 128 MiB read buffer of an import or a restore. 0 when the probe job could not be made.
uint64_t CapAboveOneJob(pid_t pid, client::Client& client, uint64_t* job_alone) {
  const uint64_t base = StatusBytes(pid, "VmSize:");
  auto token = client.CreateJob(BigJob("probe"));
  if (!token.ok()) return 0;
  *job_alone = StatusBytes(pid, "VmSize:") - base;
  if (!client.DeleteJob("probe", *token).ok()) return 0;
  return StatusBytes(pid, "VmSize:") + *job_alone + 48 * kMiB;
}

TEST(HostileAllocTest, ImportThatCannotAllocateIsRefusedAndReleasesTheJob) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizer build: its shadow memory makes an address-space limit meaningless";
#else
  TempDir dir;
  TempDir exports;
  auto daemon = DaemonProcess::StartIn(dir.path(), {"--max-jobs", "1", "--metrics-address", "off"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const pid_t pid = (*daemon)->pid();
  auto client = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(client.ok()) << client.status();

  // The export to import: the state of a job of the same spec.
  {
    auto token = (*client)->CreateJob(BigJob("source"));
    ASSERT_TRUE(token.ok()) << token.status();
    auto files = client::ExportStateToDir(**client, "source", *token, 0, -1, exports.path());
    ASSERT_TRUE(files.ok()) << files.status();
    ASSERT_TRUE((*client)->DeleteJob("source", *token).ok());
  }
  uint64_t job_alone = 0;
  const uint64_t cap = CapAboveOneJob(pid, **client, &job_alone);
  ASSERT_GT(cap, 0u) << "the probe job could not be made";
  const uint64_t rss_before = StatusBytes(pid, "VmRSS:");
  ASSERT_TRUE(LimitAddressSpace(pid, cap)) << "prlimit: " << std::strerror(errno);
  auto refused = (*client)->CreateJobFromExport(BigJob("imported"), exports.path());
  const absl::Status health = (*client)->Health(5);
  ASSERT_TRUE(LimitAddressSpace(pid, RLIM_INFINITY)) << "prlimit: " << std::strerror(errno);
  std::cout << "address space capped at " << cap / kMiB << " MiB (a job alone takes "
            << job_alone / kMiB << " MiB): " << refused.status() << "\n";
  ASSERT_FALSE(refused.ok()) << "the import fit under the cap; the test proves nothing";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("job 'imported'"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find(
                "could not allocate the memory to read its initial state from import_dir"),
            std::string::npos)
      << refused.status();
  EXPECT_TRUE(health.ok()) << "the daemon stopped serving: " << health;

  // The id and the bytes are free (--max-jobs 1), and the same import now succeeds and steps.
  auto imported = (*client)->CreateJobFromExport(BigJob("imported"), exports.path());
  ASSERT_TRUE(imported.ok()) << imported.status();
  auto listed = (*client)->GetJob("imported", *imported);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_TRUE((*client)->DeleteJob("imported", *imported).ok());
  const uint64_t rss_after = StatusBytes(pid, "VmRSS:");
  std::cout << "resident MiB before the refused import " << rss_before / kMiB
            << ", after it, a good import and its delete " << rss_after / kMiB << "\n";
  EXPECT_LT(rss_after, rss_before + 64 * kMiB) << "the refused import's memory stayed";
  auto again = (*client)->CreateJob(OneMatrixJob("after"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(StepOnce(**client, "after", *again).ok());
  EXPECT_EQ((*daemon)->Stop(), 0) << (*daemon)->Log();
#endif
}

// The same for a restore from another job's checkpoint (a load): its read buffer does not fit
// under the cap; the refusal releases the new job's slot (--max-jobs 2, the source holds one).
TEST(HostileAllocTest, RestoreThatCannotAllocateIsRefusedAndReleasesTheJob) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizer build: its shadow memory makes an address-space limit meaningless";
#else
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path(), {"--max-jobs", "2", "--metrics-address", "off"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const pid_t pid = (*daemon)->pid();
  auto client = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto source = (*client)->CreateJob(BigJob("source"));
  ASSERT_TRUE(source.ok()) << source.status();
  ASSERT_TRUE((*client)->SaveCheckpoint("source", *source).ok());
  v1::RestoreFrom from;
  from.set_job_id("source");
  from.set_token(*source);

  uint64_t job_alone = 0;
  const uint64_t cap = CapAboveOneJob(pid, **client, &job_alone);
  ASSERT_GT(cap, 0u) << "the probe job could not be made";
  ASSERT_TRUE(LimitAddressSpace(pid, cap)) << "prlimit: " << std::strerror(errno);
  auto refused = (*client)->CreateJob(BigJob("restored"), &from);
  const absl::Status health = (*client)->Health(5);
  ASSERT_TRUE(LimitAddressSpace(pid, RLIM_INFINITY)) << "prlimit: " << std::strerror(errno);
  std::cout << "address space capped at " << cap / kMiB << " MiB (a job alone takes "
            << job_alone / kMiB << " MiB): " << refused.status() << "\n";
  ASSERT_FALSE(refused.ok()) << "the restore fit under the cap; the test proves nothing";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find(
                "job 'restored': the system could not allocate the memory to read its initial "
                "state from job 'source's checkpoint"),
            std::string::npos)
      << refused.status();
  EXPECT_TRUE(health.ok()) << "the daemon stopped serving: " << health;

  auto restored = (*client)->CreateJob(BigJob("restored"), &from);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ((*client)->CreateJob(OneMatrixJob("third")).status().code(),
            absl::StatusCode::kResourceExhausted)
      << "--max-jobs 2 no longer holds";
  EXPECT_EQ((*daemon)->Stop(), 0) << (*daemon)->Log();
#endif
}

}  // namespace
}  // namespace muond::integration
