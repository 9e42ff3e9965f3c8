// Shared by the backend conformance tests (tests/unit/device, tests/unit/level_zero, tests/gpu):
// DESIGN.md 3's accuracy bounds, random Muon cases of given shapes, error measures, the host
// reference update, and one Muon kernel call on a device through three streams ordered by events,
// as the step pipeline runs it. Header-only; every test binary that includes it links
// muond_server (muon_math.h, device.h).
#ifndef MUOND_TESTS_COMMON_MUON_CASES_H_
#define MUOND_TESTS_COMMON_MUON_CASES_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/device/device.h"
#include "server/optim/muon_math.h"

namespace muond::test_util {

// DESIGN.md 3 accuracy contract, rel. Frobenius error (fp16 between fp32 and bf16, as in the muon
// unit tests); bf16 2e-2 needs fp32_iterations >= 2, every iteration in bf16 5e-2.
inline double Bound(common::DType dtype, int fp32_iterations = 0) {
  switch (dtype) {
    case common::DType::kFloat32:
      return 1e-4;
    case common::DType::kBFloat16:
      return fp32_iterations >= 2 ? 2e-2 : 5e-2;
    case common::DType::kFloat16:
      return 1e-2;
  }
  return 0;
}

// n values uniform in [-scale, scale), reproducible from `seed`.
inline std::vector<float> RandomValues(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// ||got - want|| / ||want|| (Frobenius; the absolute error when want is zero).
template <typename T>
double RelativeError(const std::vector<float>& got, const std::vector<T>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    diff += d * d;
    norm += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct ShapeCase {
  const char* name;
  std::vector<int64_t> shape;
  int64_t heads;
};

// One matrix's inputs and outputs.
struct Case {
  common::MatrixSpec spec;
  std::vector<float> grad, momentum;        // inputs
  std::vector<float> update, new_momentum;  // outputs (device or host)
};

// A case per shape: gradient in [-1, 1), momentum in [-0.5, 0.5), seeds from `seed` on.
inline std::vector<Case> MakeCases(const std::vector<ShapeCase>& shapes, uint32_t seed) {
  std::vector<Case> cases;
  for (const ShapeCase& s : shapes) {
    Case c;
    c.spec.name = s.name;
    c.spec.shape = s.shape;
    c.spec.num_heads = s.heads;
    const size_t n = static_cast<size_t>(c.spec.numel());
    c.grad = RandomValues(n, seed++);
    c.momentum = RandomValues(n, seed++);
    for (float& m : c.momentum) m *= 0.5f;
    cases.push_back(std::move(c));
  }
  return cases;
}

// The host reference: MuonUpdate on copies of the inputs.
inline void HostUpdate(const common::MuonConfig& config, Case& c) {
  c.update.assign(c.grad.size(), 0.0f);
  c.new_momentum = c.momentum;
  const absl::Status s =
      server::MuonUpdate(config, c.spec, c.grad.data(), c.new_momentum.data(), c.update.data());
  ASSERT_TRUE(s.ok()) << c.spec.name << ": " << s;
}

// Runs all `cases` as one Muon kernel call on `dev` through three streams ordered by events, as
// the step pipeline does: copy-in, compute, writeback (update and momentum).
inline void DeviceUpdate(server::device::Device& dev, const common::MuonConfig& config,
                         std::vector<Case>& cases) {
  using server::device::DeviceBuffer;
  auto in = dev.CreateStream();
  auto compute = dev.CreateStream();
  auto out = dev.CreateStream();
  ASSERT_TRUE(in.ok() && compute.ok() && out.ok());
  std::vector<DeviceBuffer> grads, moms;
  for (const Case& c : cases) {
    const size_t bytes = c.grad.size() * sizeof(float);
    auto g = dev.Allocate(bytes);
    auto m = dev.Allocate(bytes);
    ASSERT_TRUE(g.ok() && m.ok());
    EXPECT_EQ(g->size(), bytes);
    grads.push_back(*std::move(g));
    moms.push_back(*std::move(m));
  }
  std::vector<server::device::MuonKernelItem> items;
  for (size_t i = 0; i < cases.size(); ++i) {
    const size_t bytes = cases[i].grad.size() * sizeof(float);
    ASSERT_TRUE((*in)->CopyToDevice(grads[i], 0, cases[i].grad.data(), bytes).ok());
    ASSERT_TRUE((*in)->CopyToDevice(moms[i], 0, cases[i].momentum.data(), bytes).ok());
    items.push_back({&cases[i].spec, &grads[i], &moms[i]});
  }
  auto copied = (*in)->Record();
  ASSERT_TRUE(copied.ok());
  ASSERT_TRUE((*compute)->WaitFor(*copied).ok());
  ASSERT_TRUE((*compute)->Muon(config, std::move(items)).ok());
  auto computed = (*compute)->Record();
  ASSERT_TRUE(computed.ok());
  ASSERT_TRUE((*out)->WaitFor(*computed).ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    Case& c = cases[i];
    c.update.assign(c.grad.size(), std::nanf(""));
    c.new_momentum.assign(c.grad.size(), std::nanf(""));
    const size_t bytes = c.grad.size() * sizeof(float);
    ASSERT_TRUE((*out)->CopyToHost(c.update.data(), grads[i], 0, bytes).ok());
    ASSERT_TRUE((*out)->CopyToHost(c.new_momentum.data(), moms[i], 0, bytes).ok());
  }
  auto written = (*out)->Record();
  ASSERT_TRUE(written.ok());
  const absl::Status s = (*written)->Wait();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE((*written)->Done());
  EXPECT_TRUE((*copied)->Done());
  EXPECT_TRUE((*computed)->Done());
}

}  // namespace muond::test_util

#endif  // MUOND_TESTS_COMMON_MUON_CASES_H_
