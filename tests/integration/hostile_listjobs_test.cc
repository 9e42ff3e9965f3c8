// ListJobs shows a job's details (spec tensors and paths, checkpoint directory, owner, session
// ids, fence reason) to its owner, the daemon's own user (and root) and whoever sends its token;
// any other local user sees ids, sizes and state only (JobStatus.details_withheld).
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/job_spec_json.h"
#include "gtest/gtest.h"
#include "tests/integration/hostile_util.h"

namespace muond::integration {
namespace {

constexpr uid_t kNobody = 65534;
constexpr gid_t kNogroup = 65534;
constexpr uid_t kStranger = 4323;

// `muonctl job list` as uid/gid, with a token in $MUOND_JOB_TOKEN when given.
ProcessResult ListAs(uid_t uid, gid_t gid, const std::string& address, const std::string& token) {
  pid_t pid = 0;
  if (!token.empty()) ::setenv("MUOND_JOB_TOKEN", token.c_str(), 1);
  ProcessResult r = RunAs(uid, gid, {MUONCTL_BIN, "--address", address, "job", "list"}, &pid);
  ::unsetenv("MUOND_JOB_TOKEN");
  return r;
}

// The line of `job` in `muonctl job list` output ("" when absent).
std::string LineOf(const std::string& out, const std::string& job) {
  size_t at = 0;
  while ((at = out.find(job + " ", at)) != std::string::npos) {
    if (at == 0 || out[at - 1] == '\n') {
      return out.substr(at, out.find('\n', at) - at);
    }
    ++at;
  }
  return "";
}

TEST(HostileListJobsTest, OtherUsersSeeIdsSizesAndStateOnly) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run clients as other users";
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  auto daemon = DaemonProcess::StartIn(dir.path(), {"--metrics-address", "off"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_EQ(::chmod((*daemon)->socket_path().c_str(), 0666), 0);

  // A job of nobody's (created as nobody) and one of root's.
  WriteWholeFile(dir.File("job.json"), common::JobSpecToJson(OneMatrixJob("nobodys")));
  ASSERT_EQ(::chmod(dir.File("job.json").c_str(), 0644), 0);
  pid_t pid = 0;
  const ProcessResult created =
      RunAs(kNobody, kNogroup,
            {MUONCTL_BIN, "--address", (*daemon)->address(), "job", "create", "--spec",
             dir.File("job.json")},
            &pid);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err;
  const std::string nobody_token = created.out.substr(0, created.out.find('\n'));
  auto root = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(root.ok());
  auto root_token = (*root)->CreateJob(OneMatrixJob("roots"));
  ASSERT_TRUE(root_token.ok()) << root_token.status();

  // Root (the daemon's user here) sees every job in full.
  auto listed = (*root)->ListJobsWithBroken();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->jobs_size(), 2);
  for (const auto& j : listed->jobs()) {
    EXPECT_FALSE(j.details_withheld()) << j.spec().job_id();
    EXPECT_EQ(j.spec().matrices_size(), 1) << j.spec().job_id();
    EXPECT_FALSE(j.checkpoint_dir().empty()) << j.spec().job_id();
  }

  // nobody: its own job in full, root's withheld.
  ProcessResult r = ListAs(kNobody, kNogroup, (*daemon)->address(), "");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::cout << "muonctl job list as uid 65534:\n" << r.out;
  EXPECT_NE(LineOf(r.out, "nobodys").find("        1 "), std::string::npos) << r.out;
  EXPECT_NE(LineOf(r.out, "roots").find("        - "), std::string::npos) << r.out;

  // A stranger sees both withheld (ids, world size, stage, steps, state); with root's token, that
  // job in full.
  r = ListAs(kStranger, kStranger, (*daemon)->address(), "");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(LineOf(r.out, "nobodys").find("        - "), std::string::npos) << r.out;
  EXPECT_NE(LineOf(r.out, "roots").find("        - "), std::string::npos) << r.out;
  r = ListAs(kStranger, kStranger, (*daemon)->address(), *root_token);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(LineOf(r.out, "roots").find("        1 "), std::string::npos) << r.out;
  EXPECT_NE(LineOf(r.out, "nobodys").find("        - "), std::string::npos) << r.out;
  // A wrong token changes nothing and is not an error for a listing.
  r = ListAs(kStranger, kStranger, (*daemon)->address(), std::string(64, 'a'));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(LineOf(r.out, "roots").find("        - "), std::string::npos) << r.out;

  EXPECT_TRUE((*root)->DeleteJob("roots", *root_token).ok());
  EXPECT_TRUE((*root)->DeleteJob("nobodys", nobody_token).ok());
  const int status = (*daemon)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

}  // namespace
}  // namespace muond::integration
