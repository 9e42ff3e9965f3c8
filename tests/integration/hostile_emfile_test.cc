// Descriptor exhaustion on the gRPC Unix socket: a daemon with a low open-file limit, flooded with
// idle connections, must not spin while it has no descriptors, and must serve again once the
// connections are gone. And the bound on connections held (--max-connections).
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
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

// Connects to a Unix socket without sending anything; -1 on failure.
int IdleConnection(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Health OK through a fresh client within `timeout_seconds`; returns the seconds it took, or -1.
double SecondsUntilHealthy(const std::string& address, double timeout_seconds) {
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
         timeout_seconds) {
    auto c = client::Client::Connect(address);
    if (c.ok() && (*c)->Health(1).ok()) {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

TEST(HostileEmfileTest, OutOfDescriptorsDoesNotSpinAndRecovers) {
  TempDir dir;
  // A bound far above the limit: the descriptors run out first.
  auto daemon = DaemonProcess::StartIn(dir.path(), {"--max-connections", "100000",
                                                    "--metrics-address", "off"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const pid_t pid = (*daemon)->pid();
  // The daemon's limit: what it holds now plus 40.
  const int base = LimitDescriptors(pid, 40);
  ASSERT_GT(base, 0) << std::strerror(errno);
  const int limit = base + 40;

  std::vector<int> conns;
  for (int i = 0; i < 300; ++i) {
    const int fd = IdleConnection((*daemon)->socket_path());
    if (fd >= 0) conns.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const int held = OpenDescriptors(pid);
  ASSERT_TRUE(WaitForLog(**daemon, "out of file descriptors", 5)) << (*daemon)->Log();
  const double cpu0 = CpuSeconds(pid);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const double cpu = CpuSeconds(pid) - cpu0;
  std::cout << "descriptors: " << base << " at start, limit " << limit << ", " << held
            << " with " << conns.size() << " idle connections open; CPU over 2 s out of "
            << "descriptors: " << cpu << " s\n";
  EXPECT_GE(held, limit - 2) << "the daemon should be out of descriptors";
  EXPECT_LT(cpu, 0.5) << "the accept loop spins";
  ASSERT_TRUE((*daemon)->running());

  for (int fd : conns) ::close(fd);
  const double healthy_after = SecondsUntilHealthy((*daemon)->address(), 20);
  ASSERT_GE(healthy_after, 0) << "no SERVING after the connections closed:\n" << (*daemon)->Log();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::cout << "SERVING " << healthy_after << " s after closing; descriptors now "
            << OpenDescriptors(pid) << "\n";
  auto c = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(c.ok());
  auto token = (*c)->CreateJob(OneMatrixJob("after-emfile"));
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_TRUE(StepOnce(**c, "after-emfile", *token).ok());
  // Out of descriptors twice more: recovery is not a one-off.
  for (int round = 0; round < 2; ++round) {
    conns.clear();
    for (int i = 0; i < 100; ++i) {
      const int fd = IdleConnection((*daemon)->socket_path());
      if (fd >= 0) conns.push_back(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    for (int fd : conns) ::close(fd);
    EXPECT_GE(SecondsUntilHealthy((*daemon)->address(), 20), 0) << "round " << round;
  }
  c->reset();
  const int status = (*daemon)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

TEST(HostileEmfileTest, ConnectionsBeyondTheBoundAreClosed) {
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path(), {"--max-connections", "8",
                                                    "--metrics-address", "off"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const pid_t pid = (*daemon)->pid();
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // StartIn's health connection
  const int base = OpenDescriptors(pid);
  std::vector<int> conns;
  for (int i = 0; i < 40; ++i) {
    const int fd = IdleConnection((*daemon)->socket_path());
    if (fd >= 0) conns.push_back(fd);
  }
  ASSERT_TRUE(WaitForLog(**daemon, "connections open, the bound", 5)) << (*daemon)->Log();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int held = OpenDescriptors(pid);
  // Connections the daemon closed at once read EOF.
  const int closed = ClosedByPeer(conns);
  std::cout << "bound 8: descriptors " << base << " before, " << held << " with "
            << conns.size() << " idle connections; " << closed << " closed by the daemon\n";
  EXPECT_LE(held - base, 8 + 1);
  EXPECT_GE(closed, static_cast<int>(conns.size()) - 9);
  for (int fd : conns) ::close(fd);
  // gRPC closes its side; the listener counts them closed and accepts again.
  EXPECT_GE(SecondsUntilHealthy((*daemon)->address(), 20), 0) << (*daemon)->Log();
  const int status = (*daemon)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

}  // namespace
}  // namespace muond::integration
