// The Level Zero backend itself: the embedded SPIR-V module is well formed and holds every kernel
// the driver launches; without a driver OpenLevelZeroDevice, `--backend level_zero` and `auto`
// report it cleanly; with a Level Zero GPU, the backend runs the Muon update through the Stream API
// and meets DESIGN.md 3's bounds against the cpu backend (the device conformance).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/device/device.h"
#include "tests/common/muon_cases.h"
#include "server/device/level_zero/muon_kernels_spirv.h"
#include "server/optim/muon_math.h"

namespace muond::server::device {
namespace {

using common::DType;
using common::MatrixSpec;
using common::MuonConfig;
using common::NsMethod;

uint32_t Word(size_t i) {
  uint32_t w;
  std::memcpy(&w, level_zero::kMuonKernelsSpirv + 4 * i, 4);
  return w;
}

TEST(LevelZeroSpirvTest, EmbeddedModuleIsWellFormedSpirvWithEveryKernel) {
  const size_t size = level_zero::kMuonKernelsSpirvSize;
  ASSERT_GT(size, 4096u) << "a module with seven kernels is not this small";
  ASSERT_EQ(size % 4, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(level_zero::kMuonKernelsSpirv) % 4, 0u);
  EXPECT_EQ(Word(0), 0x07230203u) << "SPIR-V magic number";
  const uint32_t version = Word(1);
  // 0 | major | minor | 0: 1.0 .. 1.6.
  EXPECT_EQ(version & 0xffff00ffu, 0x00010000u) << std::hex << version;
  EXPECT_LE((version >> 8) & 0xff, 6u) << std::hex << version;
  EXPECT_GT(Word(3), 1u) << "id bound";
  EXPECT_EQ(Word(4), 0u) << "schema";
  // Every kernel the driver launches is an entry point (OpEntryPoint, opcode 15, Kernel model 6).
  std::vector<std::string> entry_points;
  for (size_t i = 5; i < size / 4;) {
    const uint32_t w = Word(i);
    const uint32_t count = w >> 16, opcode = w & 0xffff;
    ASSERT_GE(count, 1u) << "word " << i;
    ASSERT_LE(i + count, size / 4) << "instruction overruns the module at word " << i;
    if (opcode == 15 && Word(i + 1) == 6) {
      entry_points.emplace_back(
          reinterpret_cast<const char*>(level_zero::kMuonKernelsSpirv + 4 * (i + 3)));
    }
    i += count;
  }
  for (const char* kernel : {"gemm", "convert", "sum_squares", "norm_denominator", "flag_nonfinite",
                             "fill_int", "muon_momentum"}) {
    EXPECT_NE(std::find(entry_points.begin(), entry_points.end(), kernel), entry_points.end())
        << kernel;
  }
}

using test_util::Bound;

// The Muon update of a few shapes through the Stream API on `dev` against the cpu backend's.
void Conformance(Device& dev) {
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> shapes = {
      {{24, 72}, 1},      {{72, 24}, 1}, {{64, 24}, 4}, {{3, 20, 36}, 1},
      {{16, 4, 3, 3}, 1}, {{1, 40}, 1},  {{33, 17}, 1}};
  auto cpu = OpenBackend("cpu", 2, SimulatedOptions{});
  ASSERT_TRUE(cpu.ok());
  uint32_t seed = 7;
  for (NsMethod method : {NsMethod::kStandard, NsMethod::kGram, NsMethod::kPolarExpress}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      MuonConfig config;
      config.ns_method = method;
      config.compute_dtype = dtype;
      for (const auto& [shape, heads] : shapes) {
        MatrixSpec spec;
        spec.name = "m";
        spec.shape = shape;
        spec.num_heads = heads;
        const auto n = static_cast<size_t>(spec.numel());
        std::mt19937 rng(seed++);
        std::uniform_real_distribution<float> dist(-1, 1);
        std::vector<float> grad(n), mom(n);
        for (float& v : grad) v = dist(rng);
        for (float& v : mom) v = 0.5f * dist(rng);
        std::vector<float> results[2][2];  // [device, cpu][update, momentum]
        Device* devices[2] = {&dev, cpu->device.get()};
        for (int d = 0; d < 2; ++d) {
          auto s = devices[d]->CreateStream();
          ASSERT_TRUE(s.ok()) << s.status();
          auto g = devices[d]->Allocate(n * 4);
          auto m = devices[d]->Allocate(n * 4);
          ASSERT_TRUE(g.ok() && m.ok());
          ASSERT_TRUE((*s)->CopyToDevice(*g, 0, grad.data(), n * 4).ok());
          ASSERT_TRUE((*s)->CopyToDevice(*m, 0, mom.data(), n * 4).ok());
          ASSERT_TRUE((*s)->Muon(config, {{&spec, &*g, &*m}}).ok());
          results[d][0].assign(n, std::nanf(""));
          results[d][1].assign(n, std::nanf(""));
          ASSERT_TRUE((*s)->CopyToHost(results[d][0].data(), *g, 0, n * 4).ok());
          ASSERT_TRUE((*s)->CopyToHost(results[d][1].data(), *m, 0, n * 4).ok());
          const absl::Status done = (*s)->Synchronize();
          ASSERT_TRUE(done.ok()) << done;
        }
        double diff = 0, norm = 0;
        for (size_t i = 0; i < n; ++i) {
          diff += std::pow(double{results[0][0][i]} - results[1][0][i], 2);
          norm += std::pow(double{results[1][0][i]}, 2);
        }
        EXPECT_LT(std::sqrt(diff / norm), Bound(dtype)) << shape.size() << "-D " << n;
        EXPECT_EQ(std::memcmp(results[0][1].data(), results[1][1].data(), n * 4), 0);
      }
    }
  }
}

TEST(LevelZeroBackendTest, UnavailableWithAReasonOrConformantOnAGpu) {
  SetMathThreads(2);
  auto dev = OpenLevelZeroDevice(0);
  if (dev.ok()) {
    std::printf("Level Zero device: %s: running the conformance on it\n", (*dev)->name().c_str());
    Conformance(**dev);
    return;
  }
  // No driver here: one line, saying which step found nothing.
  const std::string message(dev.status().message());
  std::printf("OpenLevelZeroDevice(0): %s\n", dev.status().ToString().c_str());
  EXPECT_EQ(dev.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(message.find('\n'), std::string::npos);
  EXPECT_TRUE(message.rfind("no Level Zero driver: zeInit: ZE_RESULT_", 0) == 0 ||
              message == "zeDriverGet found no driver" ||
              message.rfind("no Level Zero GPU", 0) == 0)
      << message;

  // --backend level_zero fails with it; auto falls back to the cpu and says why.
  auto named = OpenBackend("level_zero", 1, SimulatedOptions{});
  EXPECT_EQ(named.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(std::string(named.status().message()), "level_zero backend: " + message);
  auto automatic = OpenBackend("auto", 1, SimulatedOptions{});
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_EQ(automatic->device->name(), "cpu");
  EXPECT_NE(automatic->why.find("level_zero: " + message), std::string::npos) << automatic->why;
}

}  // namespace
}  // namespace muond::server::device
