// Token files: muonctl reads them without following symbolic links and only when no one but the
// owner can read or write them; job create writes them 0600, replacing the path atomically.
#include <sys/stat.h>
#include <unistd.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"

namespace muond::integration {
namespace {

class HostileTokenFileTest : public DaemonSuite {
 protected:
  // Creates a job through muonctl with --token-file `token_file`.
  void CreateJob(const std::string& id, const std::string& token_file) {
    WriteWholeFile(files_.File(id + ".json"), common::JobSpecToJson(OneMatrixJob(id)));
    const ProcessResult r = RunMuonctl(
        address(), {"job", "create", "--spec", files_.File(id + ".json"), "--token-file",
                    token_file});
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  }
  ProcessResult Show(const std::string& id, const std::string& token_file) {
    return RunMuonctl(address(), {"job", "show", "--job", id, "--token-file", token_file});
  }
  // Exit code 7 (PERMISSION_DENIED), one line naming the path and each of `reasons`.
  static void ExpectRefused(const ProcessResult& r, const std::string& path,
                            const std::vector<std::string>& reasons) {
    EXPECT_EQ(r.exit_code, 7) << r.out << r.err;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(path), std::string::npos) << r.err;
    for (const std::string& reason : reasons) {
      EXPECT_NE(r.err.find(reason), std::string::npos) << "wanted '" << reason << "' in " << r.err;
    }
    std::cout << r.err;
  }
  TempDir files_;
};

TEST_F(HostileTokenFileTest, ReadingRefusesLinksSharedFilesAndNonFiles) {
  const std::string id = NewJobId("tok");
  const std::string token_file = files_.File("job.token");
  CreateJob(id, token_file);
  struct stat st {};
  ASSERT_EQ(::lstat(token_file.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const std::string token = ReadWholeFile(token_file);
  EXPECT_EQ(Show(id, token_file).exit_code, 0);

  // A symbolic link to the (good) token file.
  const std::string link = files_.File("link.token");
  ASSERT_EQ(::symlink(token_file.c_str(), link.c_str()), 0);
  ExpectRefused(Show(id, link), link, {"symbolic link"});
  // The same token, readable by others.
  const std::string shared = files_.File("shared.token");
  WriteWholeFile(shared, token);
  ASSERT_EQ(::chmod(shared.c_str(), 0644), 0);
  ExpectRefused(Show(id, shared), shared, {"mode 0644", "group or others"});
  ASSERT_EQ(::chmod(shared.c_str(), 0620), 0);  // group-writable
  ExpectRefused(Show(id, shared), shared, {"mode 0620"});
  ASSERT_EQ(::chmod(shared.c_str(), 0400), 0);  // owner read-only is fine
  EXPECT_EQ(Show(id, shared).exit_code, 0) << Show(id, shared).err;
  // A directory, and a FIFO (must not block the open).
  const std::string directory = files_.File("dir.token");
  ASSERT_EQ(::mkdir(directory.c_str(), 0700), 0);
  ExpectRefused(Show(id, directory), directory, {"not a regular file", "directory"});
  const std::string fifo = files_.File("fifo.token");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ExpectRefused(Show(id, fifo), fifo, {"not a regular file"});
  // The --restore-token-file of job create goes through the same check.
  WriteWholeFile(files_.File("r.json"), common::JobSpecToJson(OneMatrixJob(id + "-r")));
  const ProcessResult restore = RunMuonctl(
      address(), {"job", "create", "--spec", files_.File("r.json"), "--restore-from", id,
                  "--restore-token-file", link});
  ExpectRefused(restore, link, {"symbolic link"});
}

TEST_F(HostileTokenFileTest, WritingDoesNotFollowLinks) {
  // A link planted where the token is to go, pointing at a file of someone else's.
  const std::string victim = files_.File("victim");
  WriteWholeFile(victim, "do not overwrite\n");
  ASSERT_EQ(::chmod(victim.c_str(), 0644), 0);
  const std::string token_file = files_.File("planted.token");
  ASSERT_EQ(::symlink(victim.c_str(), token_file.c_str()), 0);
  const std::string id = NewJobId("tok");
  CreateJob(id, token_file);
  EXPECT_EQ(ReadWholeFile(victim), "do not overwrite\n");
  struct stat st {};
  ASSERT_EQ(::lstat(token_file.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the link is replaced by the token file";
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(victim.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  EXPECT_EQ(Show(id, token_file).exit_code, 0);
  // An existing token file (e.g. 0644 from an older tool) is replaced by a 0600 one.
  const std::string old_file = files_.File("old.token");
  WriteWholeFile(old_file, "stale\n");
  ASSERT_EQ(::chmod(old_file.c_str(), 0644), 0);
  const std::string id2 = NewJobId("tok");
  CreateJob(id2, old_file);
  ASSERT_EQ(::lstat(old_file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(Show(id2, old_file).exit_code, 0);
  // No temporary file is left behind.
  const ProcessResult ls = RunProcess({"/bin/ls", "-a", files_.path()});
  EXPECT_EQ(ls.out.find(".tmp."), std::string::npos) << ls.out;
}

}  // namespace
}  // namespace muond::integration
