// muond's flags and config file: precedence, defaults and every rejection with its message.
#include "server/record/daemon_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

namespace muond::server {
namespace {

absl::StatusOr<DaemonConfig> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "muond");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return ParseDaemonConfig(static_cast<int>(argv.size()), argv.data());
}

std::string WriteConfig(const std::string& text) {
  std::string path = ::testing::TempDir() + "/muond_config_" + std::to_string(getpid());
  std::ofstream(path) << text;
  return path;
}

TEST(DaemonConfigTest, DefaultsNeedNoConfiguration) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.rfind("unix:///", 0), 0u) << c->listen;
  EXPECT_FALSE(c->state_dir.empty());
  EXPECT_EQ(c->backend, "auto");
}

TEST(DaemonConfigTest, FlagsOverrideConfigFile) {
  const std::string path = WriteConfig(
      "# comment\nlisten = unix:///tmp/a.sock\nbackend = cpu  # trailing\nthreads = 3\n");
  auto c = Parse({"--config", path, "--listen=127.0.0.1:0"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "127.0.0.1:0");
  EXPECT_EQ(c->backend, "cpu");
  EXPECT_EQ(c->threads, 3);
}

TEST(DaemonConfigTest, MetricsAddress) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->metrics_address, "");  // the default, 127.0.0.1:9464, best effort
  EXPECT_EQ(std::string(kDefaultMetricsAddress), "127.0.0.1:9464");
  c = Parse({"--metrics-address", "off"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->metrics_address, "off");
  c = Parse({"--config", WriteConfig("metrics-address = 0.0.0.0:9100\n")});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->metrics_address, "0.0.0.0:9100");
  for (const char* bad : {"9464", "unix:///tmp/m.sock", "127.0.0.1:http", "127.0.0.1:70000"}) {
    auto r = Parse({"--metrics-address", bad});
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("--metrics-address"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("expected HOST:PORT or off"), std::string::npos)
        << r.status();
  }
}

TEST(DaemonConfigTest, CpuIsa) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->cpu_isa, "auto");
  for (const char* isa : {"auto", "avx2", "avx512", "amx"}) {
    c = Parse({"--cpu-isa", isa});
    ASSERT_TRUE(c.ok()) << isa << ": " << c.status();
    EXPECT_EQ(c->cpu_isa, isa);
  }
  c = Parse({"--config", WriteConfig("cpu-isa = avx2\n"), "--cpu-isa=avx512"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->cpu_isa, "avx512");  // the flag wins over the file
  // Whether the CPU has the ISA is checked at start (server/optim/cpu_isa.h), not here; names are.
  for (const char* bad : {"", "AVX2", "avx", "sse4", "avx512bf16", "auto "}) {
    auto r = Parse({"--cpu-isa", bad});
    ASSERT_FALSE(r.ok()) << "'" << bad << "'";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("--cpu-isa"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("expected auto, avx2, avx512 or amx"), std::string::npos)
        << r.status();
  }
}

TEST(DaemonConfigTest, StreamIdleSeconds) {
  auto defaults = Parse({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->stream_idle_seconds, 60);
  auto flag = Parse({"--stream-idle-seconds", "2.5"});
  ASSERT_TRUE(flag.ok()) << flag.status();
  EXPECT_EQ(flag->stream_idle_seconds, 2.5);
  auto file = Parse({"--config", WriteConfig("stream-idle-seconds = 7\n")});
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->stream_idle_seconds, 7);
  for (const char* bad : {"0", "-1", "nan", "86401", "soon"}) {
    auto r = Parse({"--stream-idle-seconds", bad});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("--stream-idle-seconds"), std::string::npos)
        << r.status();
  }
  EXPECT_NE(DaemonUsage().find("--stream-idle-seconds S"), std::string::npos);
}

TEST(DaemonConfigTest, OrthogonalityEvery) {
  auto defaults = Parse({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->orthogonality_every, 100);
  auto off = Parse({"--orthogonality-every", "0"});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->orthogonality_every, 0);  // never measured
  auto file = Parse({"--config", WriteConfig("orthogonality-every = 7\n")});
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->orthogonality_every, 7);
  // Refused, naming the flag and the range: negative, not a count, past the cap, empty.
  for (const char* bad : {"-1", "1.5", "ten", "1000000001", ""}) {
    auto r = Parse({"--orthogonality-every", bad});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(r.status().message().find("--orthogonality-every"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("[0, 1000000000]"), std::string::npos) << r.status();
  }
  EXPECT_NE(DaemonUsage().find("--orthogonality-every N"), std::string::npos);
}

TEST(DaemonConfigTest, RejectsBadInputNamingIt) {
  auto unknown = Parse({"--frobnicate", "1"});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("unknown option 'frobnicate'"), std::string::npos);
  auto relative = Parse({"--listen", "unix://relative.sock"});
  EXPECT_EQ(relative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(relative.status().message().find("--listen"), std::string::npos);
  EXPECT_FALSE(Parse({"--listen", "localhost:http"}).ok());
  EXPECT_FALSE(Parse({"--listen", "localhost:70000"}).ok());
  EXPECT_FALSE(Parse({"--threads", "-1"}).ok());
  EXPECT_FALSE(Parse({"--state-dir", "relative/dir"}).ok());
  EXPECT_FALSE(Parse({"--listen"}).ok());
  auto line = Parse({"--config", WriteConfig("listen = unix:///tmp/x.sock\nbogus = 1\n")});
  EXPECT_EQ(line.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(line.status().message().find(":2: unknown option 'bogus'"), std::string::npos)
      << line.status();
  auto missing = Parse({"--config", "/nonexistent/muond.conf"});
  EXPECT_NE(missing.status().message().find("/nonexistent/muond.conf"), std::string::npos);
}

}  // namespace
}  // namespace muond::server
