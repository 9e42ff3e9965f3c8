// Who may create jobs: the allow-list decision on fabricated identities, and end to end over the
// Unix socket with the daemon reading the peer's credentials (SO_PEERCRED). As root the client
// runs as uid 65534 (nobody) in a forked child.
#include <sys/stat.h>
#include <unistd.h>

#include <iostream>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/api/peer_identity.h"
#include "server/api/tls_config.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"

namespace muond::integration {
namespace {

using server::AccessPolicy;
using server::PeerIdentity;
using server::UnixCredentials;

constexpr uid_t kNobody = 65534;
constexpr gid_t kNogroup = 65534;

PeerIdentity UnixPeer(uid_t uid, gid_t gid, pid_t pid = 77) {
  PeerIdentity p;
  p.unix_credentials = UnixCredentials{uid, gid, pid};
  p.peer = "fd:9";
  return p;
}

TEST(HostileAccessTest, DecisionOnFabricatedIdentities) {
  // The user 3001's supplementary groups are {1, 50}; 3002's are {7}.
  auto groups = [](uid_t uid) {
    return uid == 3001 ? std::vector<gid_t>{1, 50} : std::vector<gid_t>{7};
  };
  auto policy = AccessPolicy::Create("1000, root", "50", /*mutual_tls=*/false,
                                     /*daemon_uid=*/4242, groups);
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_TRUE((*policy)->restricted());
  EXPECT_TRUE((*policy)->MayCreateJob(UnixPeer(0, 0)).ok()) << "root";
  EXPECT_TRUE((*policy)->MayCreateJob(UnixPeer(4242, 9)).ok()) << "the daemon's own uid";
  EXPECT_TRUE((*policy)->MayCreateJob(UnixPeer(1000, 1000)).ok()) << "listed uid";
  EXPECT_TRUE((*policy)->MayCreateJob(UnixPeer(3000, 50)).ok()) << "listed primary gid";
  EXPECT_TRUE((*policy)->MayCreateJob(UnixPeer(3001, 1)).ok()) << "listed supplementary group";
  const absl::Status denied = (*policy)->MayCreateJob(UnixPeer(3002, 1, 4711));
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied) << denied;
  for (const char* want : {"uid 3002", "pid 4711", "--allow-uids", "--allow-groups"}) {
    EXPECT_NE(denied.message().find(want), absl::string_view::npos) << want << ": " << denied;
  }
  // A TCP peer: no Unix credentials; a client certificate counts only with mutual TLS.
  PeerIdentity tcp;
  tcp.peer = "ipv4:127.0.0.1:40000";
  const absl::Status tcp_denied = (*policy)->MayCreateJob(tcp);
  EXPECT_EQ(tcp_denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(tcp_denied.message().find("ipv4:127.0.0.1:40000"), absl::string_view::npos);
  tcp.tls_client_verified = true;
  tcp.tls_identity = "client.example";
  EXPECT_EQ((*policy)->MayCreateJob(tcp).code(), absl::StatusCode::kPermissionDenied)
      << "no mutual TLS configured: a certificate is not verified";
  auto mtls = AccessPolicy::Create("1000", "", /*mutual_tls=*/true, 4242, groups);
  ASSERT_TRUE(mtls.ok());
  EXPECT_TRUE((*mtls)->MayCreateJob(tcp).ok());
  EXPECT_EQ((*mtls)->MayCreateJob(UnixPeer(3001, 1)).code(), absl::StatusCode::kPermissionDenied)
      << "no --allow-groups: groups do not count";

  // No list: everyone, with or without credentials.
  auto open = AccessPolicy::Create("", "", false, 4242, groups);
  ASSERT_TRUE(open.ok());
  EXPECT_FALSE((*open)->restricted());
  EXPECT_TRUE((*open)->MayCreateJob(UnixPeer(3002, 1)).ok());
  EXPECT_TRUE((*open)->MayCreateJob(PeerIdentity{}).ok());

  // Names resolve; unknown names and garbage are refused naming the flag and the entry.
  auto named = AccessPolicy::Create("nobody", "nogroup", false, 4242, groups);
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_TRUE((*named)->MayCreateJob(UnixPeer(kNobody, 1)).ok());
  EXPECT_TRUE((*named)->MayCreateJob(UnixPeer(3002, kNogroup)).ok());
  auto unknown = AccessPolicy::Create("no-such-user-xq", "", false, 4242, groups);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("--allow-uids: 'no-such-user-xq'"),
            absl::string_view::npos)
      << unknown.status();
  auto bad_group = AccessPolicy::Create("", "-5", false, 4242, groups);
  EXPECT_NE(bad_group.status().message().find("--allow-groups"), absl::string_view::npos);
  // The real group lookup: root's groups include gid 0.
  const std::vector<gid_t> root_groups = server::GroupsOfUser(0);
  EXPECT_NE(std::find(root_groups.begin(), root_groups.end(), 0u), root_groups.end());
}

TEST(HostileAccessTest, LoopbackAddresses) {
  for (const char* a : {"127.0.0.1:1", "127.1.2.3:0", "localhost:5", "[::1]:7", "LOCALHOST:1",
                        "[::ffff:127.0.0.1]:3"}) {
    EXPECT_TRUE(server::IsLoopbackAddress(a)) << a;
  }
  for (const char* a : {"0.0.0.0:1", "[::]:1", "10.0.0.1:5", "example.com:5", "128.0.0.1:1",
                        "localhost.example.com:1"}) {
    EXPECT_FALSE(server::IsLoopbackAddress(a)) << a;
  }
}

// muonctl job create as another user; returns the result and that process's pid.
ProcessResult CreateAs(uid_t uid, gid_t gid, const std::string& address, const std::string& spec,
                       pid_t* pid) {
  return RunAs(uid, gid, {MUONCTL_BIN, "--address", address, "job", "create", "--spec", spec},
               pid);
}

TEST(HostileAccessTest, UnixPeerCredentialsDecideCreateJob) {
  TempDir dir;
  const uid_t me = ::geteuid();
  if (me != 0) {
    // Not root: this test's own uid is the excluded one.
    auto daemon = DaemonProcess::StartIn(dir.path(), {"--allow-uids", "65534",
                                                      "--metrics-address", "off"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    auto client = client::Client::Connect((*daemon)->address());
    ASSERT_TRUE(client.ok());
    auto token = (*client)->CreateJob(OneMatrixJob("denied"));
    ASSERT_EQ(token.status().code(), absl::StatusCode::kPermissionDenied) << token.status();
    EXPECT_NE(token.status().message().find(absl::StrCat("uid ", me)), absl::string_view::npos)
        << token.status();
    EXPECT_NE(token.status().message().find(absl::StrCat("pid ", ::getpid())),
              absl::string_view::npos)
        << token.status();
    EXPECT_TRUE(WIFEXITED((*daemon)->Stop()));
    return;
  }
  // Root: the client runs as nobody. The test directory and the socket are opened up for it (the
  // daemon creates the socket 0660, owned by root).
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  WriteWholeFile(dir.File("job.json"), common::JobSpecToJson(OneMatrixJob("as-nobody")));
  ASSERT_EQ(::chmod(dir.File("job.json").c_str(), 0644), 0);
  const std::string spec = dir.File("job.json");
  WriteWholeFile(dir.File("job2.json"), common::JobSpecToJson(OneMatrixJob("as-nobody-2")));
  ASSERT_EQ(::chmod(dir.File("job2.json").c_str(), 0644), 0);
  const std::string spec2 = dir.File("job2.json");
  {
    SCOPED_TRACE("--allow-uids 1234: nobody is refused, root is not");
    auto daemon = DaemonProcess::StartIn(dir.path(), {"--allow-uids", "1234",
                                                      "--metrics-address", "off"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    struct stat st {};
    ASSERT_EQ(::stat((*daemon)->socket_path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0660u) << "the daemon's socket mode";
    ASSERT_EQ(::chmod((*daemon)->socket_path().c_str(), 0666), 0);
    pid_t pid = 0;
    const ProcessResult r = CreateAs(kNobody, kNogroup, (*daemon)->address(), spec, &pid);
    std::cout << "refused CreateJob as uid 65534 (pid " << pid << "): " << r.err;
    EXPECT_EQ(r.exit_code, 7) << r.out << r.err;  // PERMISSION_DENIED
    for (const std::string& want : {std::string("uid 65534"), absl::StrCat("pid ", pid),
                                    std::string("--allow-uids"), std::string("1234")}) {
      EXPECT_NE(r.err.find(want), std::string::npos) << want << " in: " << r.err;
    }
    auto client = client::Client::Connect((*daemon)->address());
    ASSERT_TRUE(client.ok());
    auto token = (*client)->CreateJob(OneMatrixJob("as-root"));
    EXPECT_TRUE(token.ok()) << "root is always allowed: " << token.status();
    // Other RPCs are not restricted by the list (the job token guards them).
    auto jobs = (*client)->ListJobs();
    ASSERT_TRUE(jobs.ok());
    EXPECT_EQ(jobs->size(), 1u);
    const int status = (*daemon)->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
  }
  {
    SCOPED_TRACE("--allow-groups nogroup: nobody (gid 65534) may");
    TempDir dir2;
    ASSERT_EQ(::chmod(dir2.path().c_str(), 0755), 0);
    auto daemon = DaemonProcess::StartIn(dir2.path(), {"--allow-uids", "1234", "--allow-groups",
                                                       "nogroup", "--metrics-address", "off"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    ASSERT_EQ(::chmod((*daemon)->socket_path().c_str(), 0666), 0);
    pid_t pid = 0;
    const ProcessResult r = CreateAs(kNobody, kNogroup, (*daemon)->address(), spec, &pid);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_EQ(r.out.size(), 65u) << "the token and a newline: " << r.out;
    // The same user running with another gid: its user's groups (getgrouplist) still match.
    const ProcessResult other = CreateAs(kNobody, 4321, (*daemon)->address(), spec2, &pid);
    EXPECT_EQ(other.exit_code, 0) << other.out << other.err;
    // Another uid with that gid: no match.
    const ProcessResult stranger = CreateAs(4322, 4321, (*daemon)->address(), spec2, &pid);
    EXPECT_EQ(stranger.exit_code, 7) << stranger.out << stranger.err;
    EXPECT_NE(stranger.err.find("uid 4322 (gid 4321"), std::string::npos) << stranger.err;
    const int status = (*daemon)->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
  }
}

}  // namespace
}  // namespace muond::integration
