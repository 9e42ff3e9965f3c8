// What the CUDA backend does where the machine has no usable GPU (and, on a GPU machine, the
// matching positive checks): OpenCudaDevice is UNAVAILABLE with a one-line reason, `auto` picks
// the cpu and says why, and `muond --backend cuda` exits non-zero with one line on stderr.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/device/device.h"

namespace muond::server::device {
namespace {

std::string RunAndCaptureStderr(const std::string& command, int* exit_code) {
  std::string out;
  FILE* p = popen((command + " 2>&1 >/dev/null").c_str(), "r");
  if (p == nullptr) return "popen failed";
  char buf[512];
  while (std::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  const int status = pclose(p);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

TEST(CudaNoDeviceTest, OpenCudaDeviceIsUnavailableWithOneLineReasonOrWorks) {
  auto dev = OpenCudaDevice(0);
  if (dev.ok()) {
    EXPECT_EQ((*dev)->name(), "cuda:0");
    auto missing = OpenCudaDevice(1000);
    EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnavailable);
    return;
  }
  const std::string why(dev.status().message());
  EXPECT_EQ(dev.status().code(), absl::StatusCode::kUnavailable) << why;
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  EXPECT_NE(why.find("CUDA"), std::string::npos) << why;
  std::printf("OpenCudaDevice(0): %s\n", why.c_str());
}

TEST(CudaNoDeviceTest, AutoFallsBackToCpuAndSaysWhy) {
  auto cuda = OpenCudaDevice(0);
  auto chosen = OpenBackend("auto", 1, SimulatedOptions{});
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  if (cuda.ok()) {
    EXPECT_EQ(chosen->device->name(), "cuda:0");
    return;
  }
  EXPECT_EQ(chosen->device->name(), "cpu");
  EXPECT_NE(chosen->why.find(absl::StrCat("cuda: ", cuda.status().message())), std::string::npos)
      << chosen->why;
  auto named = OpenBackend("cuda", 1, SimulatedOptions{});
  EXPECT_EQ(named.status().code(), absl::StatusCode::kUnavailable);
  std::printf("auto: %s\n", chosen->why.c_str());
}

TEST(CudaNoDeviceTest, MuondBackendCudaExitsNonZeroWithOneLine) {
  if (OpenCudaDevice(0).ok()) GTEST_SKIP() << "a CUDA device is present: muond would start";
  char dir_template[] = "/tmp/muond-cuda-test-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  ASSERT_NE(dir, nullptr);
  int code = 0;
  const std::string err =
      RunAndCaptureStderr(absl::StrCat(MUOND_BINARY, " --backend cuda --threads 1 --state-dir ",
                                       dir, "/state --listen unix://", dir, "/muond.sock"),
                          &code);
  std::system(absl::StrCat("rm -rf ", dir).c_str());
  EXPECT_NE(code, 0) << err;
  ASSERT_FALSE(err.empty());
  EXPECT_EQ(err.find('\n'), err.size() - 1) << "more than one line:\n" << err;
  EXPECT_NE(err.find("--backend cuda"), std::string::npos) << err;
  EXPECT_NE(err.find("no CUDA device"), std::string::npos) << err;
  std::printf("muond --backend cuda (exit %d): %s", code, err.c_str());
}

}  // namespace
}  // namespace muond::server::device
