// Descriptor exhaustion on TCP, plaintext and TLS (issue 32, item 13), as hostile_emfile_test.cc
// does it on the Unix socket: a daemon on 127.0.0.1 with a low open-file limit, flooded with idle
// TCP connections, must not spin while it has no descriptors and must serve again once they are
// gone (gRPC 1.51's own TCP accept loop gives the port up on EMFILE; the daemon accepts itself).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"

namespace muond::integration {
namespace {

// Connects to 127.0.0.1:port without sending anything; -1 on failure.
int IdleTcpConnection(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

double SecondsUntilHealthy(const std::string& address, const client::TlsOptions& tls,
                           double timeout_seconds) {
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
         timeout_seconds) {
    auto c = client::Client::Connect(address, tls);
    if (c.ok() && (*c)->Health(1).ok()) {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

// A CA and a server certificate for 127.0.0.1 in `dir` (ca.pem, server.pem, server.key).
void MakeServerCertificate(const TempDir& dir) {
  const std::string script = absl::StrCat(
      "set -e; cd ", dir.path(), "\n",
      "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out $1 "
      "2>/dev/null; }\n"
      "key ca.key; key server.key\n"
      "openssl req -x509 -new -key ca.key -out ca.pem -days 2 -subj /CN=muond-test-ca "
      "-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign\n"
      "printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' > server.ext\n"
      "openssl req -new -key server.key -out server.csr -subj /CN=localhost\n"
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
      "-extfile server.ext -out server.pem 2>/dev/null\n");
  const ProcessResult r = RunProcess({"/bin/sh", "-c", script});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
}

// Starts muond on 127.0.0.1:0 with `extra` flags; *port gets the port it logged.
std::unique_ptr<DaemonProcess> StartOnTcp(const TempDir& dir, std::vector<std::string> extra,
                                          int* port) {
  std::vector<std::string> args = {"--listen",          "127.0.0.1:0", "--state-dir",
                                   dir.File("state"),   "--threads",   "1",
                                   "--metrics-address", "off"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto spawned = DaemonProcess::Spawn(args, dir.File("muond.log"));
  EXPECT_TRUE(spawned.ok()) << spawned.status();
  if (!spawned.ok()) return nullptr;
  *port = 0;
  for (int i = 0; i < 1000 && (*port = LoggedPort((*spawned)->Log())) == 0; ++i) {
    if ((*spawned)->WaitExit(0)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_GT(*port, 0) << (*spawned)->Log();
  return *port > 0 ? *std::move(spawned) : nullptr;
}

// Exhausts the daemon's descriptors with idle TCP connections (plaintext or TLS: the accept loop
// is the daemon's either way), checks that it does not spin, that it serves again once they are
// closed, and that recovery is not a one-off.
void ExhaustAndRecover(bool tls) {
  TempDir dir;
  std::vector<std::string> extra = {"--max-connections", "100000"};
  client::TlsOptions tls_options;
  if (tls) {
    ASSERT_NO_FATAL_FAILURE(MakeServerCertificate(dir));
    extra.insert(extra.end(),
                 {"--tls-cert", dir.File("server.pem"), "--tls-key", dir.File("server.key")});
    tls_options.ca_file = dir.File("ca.pem");
  }
  int port = 0;
  std::unique_ptr<DaemonProcess> started = StartOnTcp(dir, extra, &port);
  ASSERT_NE(started, nullptr);
  DaemonProcess& daemon = *started;
  const std::string address = absl::StrCat(tls ? "tls://" : "", "127.0.0.1:", port);
  const char* what = tls ? "TLS" : "TCP";
  ASSERT_GE(SecondsUntilHealthy(address, tls_options, 20), 0) << daemon.Log();
  const pid_t pid = daemon.pid();
  const int base = LimitDescriptors(pid, 40);
  ASSERT_GT(base, 0) << std::strerror(errno);
  const int limit = base + 40;

  std::vector<int> conns;
  for (int i = 0; i < 300; ++i) {
    const int fd = IdleTcpConnection(port);
    if (fd >= 0) conns.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const int held = OpenDescriptors(pid);
  ASSERT_TRUE(WaitForLog(daemon, "out of file descriptors", 5)) << daemon.Log();
  const double cpu0 = CpuSeconds(pid);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const double cpu = CpuSeconds(pid) - cpu0;
  std::cout << what << ": descriptors " << base << " at start, limit " << limit << ", " << held
            << " with " << conns.size() << " idle connections open; CPU over 2 s out of "
            << "descriptors: " << cpu << " s\n";
  EXPECT_GE(held, limit - 2) << "the daemon should be out of descriptors";
  EXPECT_LT(cpu, 0.5) << "the accept loop spins";
  ASSERT_TRUE(daemon.running());

  for (int fd : conns) ::close(fd);
  const double healthy_after = SecondsUntilHealthy(address, tls_options, 20);
  ASSERT_GE(healthy_after, 0) << "no SERVING over " << what << " after the connections closed:\n"
                              << daemon.Log();
  std::cout << what << " SERVING " << healthy_after << " s after closing\n";
  auto c = client::Client::Connect(address, tls_options);
  ASSERT_TRUE(c.ok());
  auto token = (*c)->CreateJob(OneMatrixJob("after-emfile"));
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_TRUE(StepOnce(**c, "after-emfile", *token).ok());
  // Out of descriptors twice more: recovery is not a one-off.
  for (int round = 0; round < 2; ++round) {
    conns.clear();
    for (int i = 0; i < 100; ++i) {
      const int fd = IdleTcpConnection(port);
      if (fd >= 0) conns.push_back(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    for (int fd : conns) ::close(fd);
    EXPECT_GE(SecondsUntilHealthy(address, tls_options, 20), 0) << "round " << round;
  }
  c->reset();
  const int status = daemon.Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

TEST(HostileGrpcTcpEmfileTest, OutOfDescriptorsOnTcpDoesNotSpinAndRecovers) {
  ExhaustAndRecover(/*tls=*/false);
}

TEST(HostileGrpcTcpEmfileTest, OutOfDescriptorsOnTlsDoesNotSpinAndRecovers) {
  ExhaustAndRecover(/*tls=*/true);
}

// The bound on connections held (--max-connections) holds on TCP too.
TEST(HostileGrpcTcpEmfileTest, TcpConnectionsBeyondTheBoundAreClosed) {
  TempDir dir;
  int port = 0;
  std::unique_ptr<DaemonProcess> started = StartOnTcp(dir, {"--max-connections", "8"}, &port);
  ASSERT_NE(started, nullptr);
  DaemonProcess& daemon = *started;
  const std::string address = absl::StrCat("127.0.0.1:", port);
  ASSERT_GE(SecondsUntilHealthy(address, {}, 20), 0) << daemon.Log();
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  const pid_t pid = daemon.pid();
  const int base = OpenDescriptors(pid);
  std::vector<int> conns;
  for (int i = 0; i < 40; ++i) {
    const int fd = IdleTcpConnection(port);
    if (fd >= 0) conns.push_back(fd);
  }
  ASSERT_TRUE(WaitForLog(daemon, "connections open, the bound", 5)) << daemon.Log();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int held = OpenDescriptors(pid);
  const int closed = ClosedByPeer(conns);
  std::cout << "TCP bound 8: descriptors " << base << " before, " << held << " with "
            << conns.size() << " idle connections; " << closed << " closed by the daemon\n";
  EXPECT_LE(held - base, 8 + 1);
  EXPECT_GE(closed, static_cast<int>(conns.size()) - 9);
  for (int fd : conns) ::close(fd);
  EXPECT_GE(SecondsUntilHealthy(address, {}, 20), 0) << daemon.Log();
  const int status = daemon.Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

}  // namespace
}  // namespace muond::integration
