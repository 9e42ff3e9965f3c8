// The CUDA backend's streams, events, copies and memory (issue 6): cross-stream ordering by
// events, pinned and pageable copies (through the bounce buffer, across registration chunks), a
// non-finite input failing its step and naming the matrix (on the compute stream and on the
// stream that waited for it) while the streams stay usable, refused bad calls, the bounded
// memory pool, busy time. Every test skips, with the reason, where there is no CUDA device.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/device/device.h"
#include "server/optim/muon_math.h"
#include "tests/gpu/cuda_test_util.h"

namespace muond::server::device {
namespace {

using common::MatrixSpec;
using common::MuonConfig;
using testing_cuda::RandomValues;
using testing_cuda::RelativeError;
using testing_cuda::SameBits;

std::vector<char> Pattern(size_t n, uint32_t seed) {
  std::vector<char> v(n);
  uint32_t x = seed;
  for (char& c : v) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return v;
}

// A device buffer written on one stream is read by another only after the event: 64 MiB, so
// that a read that did not wait would see the old contents.
TEST(CudaStreamTest, EventsOrderWorkAcrossStreams) {
  MUOND_REQUIRE_CUDA_DEVICE(dev);
  constexpr size_t kBytes = size_t{64} << 20;
  auto writer = dev->CreateStream();
  auto reader = dev->CreateStream();
  ASSERT_TRUE(writer.ok() && reader.ok());
  auto buffer = dev->Allocate(kBytes);
  ASSERT_TRUE(buffer.ok());
  const std::vector<char> first = Pattern(kBytes, 1), second = Pattern(kBytes, 2);
  const bool pinned = dev->RegisterHost(const_cast<char*>(first.data()), kBytes);
  std::printf("first source pinned: %d\n", pinned);
  for (const std::vector<char>* src : {&first, &second}) {
    std::vector<char> got(kBytes, 0);
    ASSERT_TRUE((*writer)->CopyToDevice(*buffer, 0, src->data(), kBytes).ok());
    auto written = (*writer)->Record();
    ASSERT_TRUE(written.ok());
    ASSERT_TRUE((*reader)->WaitFor(*written).ok());
    ASSERT_TRUE((*reader)->CopyToHost(got.data(), *buffer, 0, kBytes).ok());
    auto read = (*reader)->Record();
    ASSERT_TRUE(read.ok());
    ASSERT_TRUE((*read)->Wait().ok());
    EXPECT_TRUE((*written)->Done());
    EXPECT_TRUE(std::memcmp(got.data(), src->data(), kBytes) == 0);
    // The next write must not overtake this read.
    ASSERT_TRUE((*writer)->WaitFor(*read).ok());
  }
  dev->UnregisterHost(const_cast<char*>(first.data()), kBytes);
}

// Copies from and to host memory that is registered, not registered, and partly registered,
// at odd offsets and over several bounce-buffer lengths.
TEST(CudaStreamTest, PinnedPageableAndMixedCopiesRoundTrip) {
  MUOND_REQUIRE_CUDA_DEVICE(dev);
  constexpr size_t kBytes = (size_t{40} << 20) + 123;
  auto s = dev->CreateStream();
  ASSERT_TRUE(s.ok());
  auto buffer = dev->Allocate(kBytes + 64);
  ASSERT_TRUE(buffer.ok());
  std::vector<char> src = Pattern(kBytes, 7);
  std::vector<char> pinned_dst(kBytes, 0), pageable_dst(kBytes, 0);
  // The middle of src registered: a copy of the whole range is pageable, pinned, pageable.
  char* middle = src.data() + (size_t{8} << 20) + 5;
  const size_t middle_bytes = size_t{20} << 20;
  const bool src_pinned = dev->RegisterHost(middle, middle_bytes);
  const bool dst_pinned = dev->RegisterHost(pinned_dst.data(), kBytes);
  std::printf("registered: src middle %d, destination %d\n", src_pinned, dst_pinned);
  ASSERT_TRUE((*s)->CopyToDevice(*buffer, 3, src.data(), kBytes).ok());
  ASSERT_TRUE((*s)->CopyToHost(pinned_dst.data(), *buffer, 3, kBytes).ok());
  ASSERT_TRUE((*s)->CopyToHost(pageable_dst.data(), *buffer, 3, kBytes).ok());
  const absl::Status synced = (*s)->Synchronize();
  ASSERT_TRUE(synced.ok()) << synced;
  EXPECT_TRUE(std::memcmp(pinned_dst.data(), src.data(), kBytes) == 0);
  EXPECT_TRUE(std::memcmp(pageable_dst.data(), src.data(), kBytes) == 0);
  // Small copies at the edges of the registered range.
  std::vector<char> small(64, 0);
  ASSERT_TRUE((*s)->CopyToHost(small.data(), *buffer, 3 + (middle - src.data()) - 32, 64).ok());
  ASSERT_TRUE((*s)->Synchronize().ok());
  EXPECT_TRUE(std::memcmp(small.data(), middle - 32, 64) == 0);
  dev->UnregisterHost(middle, middle_bytes);
  dev->UnregisterHost(pinned_dst.data(), kBytes);
}

struct Matrix {
  MatrixSpec spec;
  std::vector<float> grad, momentum;
  DeviceBuffer g, m;
};

Matrix MakeMatrix(Device& dev, const char* name, std::vector<int64_t> shape, uint32_t seed) {
  Matrix x;
  x.spec.name = name;
  x.spec.shape = std::move(shape);
  const size_t n = static_cast<size_t>(x.spec.numel());
  x.grad = RandomValues(n, seed);
  x.momentum = RandomValues(n, seed + 1, 0.5f);
  x.g = *dev.Allocate(n * sizeof(float));
  x.m = *dev.Allocate(n * sizeof(float));
  return x;
}

// A NaN in a gradient: the compute stream's next event and the writeback stream's event after
// it fail with INVALID_ARGUMENT naming the matrix; the streams work again afterwards.
TEST(CudaStreamTest, NonFiniteInputFailsTheStepNamesTheMatrixAndStreamsRecover) {
  MUOND_REQUIRE_CUDA_DEVICE(dev);
  auto compute = dev->CreateStream();
  auto out = dev->CreateStream();
  ASSERT_TRUE(compute.ok() && out.ok());
  MuonConfig config;
  Matrix good = MakeMatrix(*dev, "good", {32, 48}, 10);
  Matrix bad = MakeMatrix(*dev, "poisoned", {32, 48}, 20);
  bad.grad[17] = std::nanf("");
  const size_t bytes = good.grad.size() * sizeof(float);
  for (Matrix* x : {&good, &bad}) {
    ASSERT_TRUE((*compute)->CopyToDevice(x->g, 0, x->grad.data(), bytes).ok());
    ASSERT_TRUE((*compute)->CopyToDevice(x->m, 0, x->momentum.data(), bytes).ok());
  }
  ASSERT_TRUE(
      (*compute)->Muon(config, {{&good.spec, &good.g, &good.m}, {&bad.spec, &bad.g, &bad.m}}).ok());
  auto computed = (*compute)->Record();
  ASSERT_TRUE(computed.ok());
  ASSERT_TRUE((*out)->WaitFor(*computed).ok());
  std::vector<float> update(good.grad.size());
  ASSERT_TRUE((*out)->CopyToHost(update.data(), good.g, 0, bytes).ok());
  auto written = (*out)->Record();
  ASSERT_TRUE(written.ok());
  for (const auto& event : {*computed, *written}) {
    const absl::Status s = event->Wait();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find("'poisoned'"), std::string::npos) << s;
  }
  // Reported once: the next events are clean, and the good matrix computes right again.
  EXPECT_TRUE((*compute)->Synchronize().ok());
  EXPECT_TRUE((*out)->Synchronize().ok());
  std::vector<float> want(good.grad.size()), want_m = good.momentum;
  ASSERT_TRUE(MuonUpdate(config, good.spec, good.grad.data(), want_m.data(), want.data()).ok());
  ASSERT_TRUE((*compute)->CopyToDevice(good.g, 0, good.grad.data(), bytes).ok());
  ASSERT_TRUE((*compute)->CopyToDevice(good.m, 0, good.momentum.data(), bytes).ok());
  ASSERT_TRUE((*compute)->Muon(config, {{&good.spec, &good.g, &good.m}}).ok());
  std::vector<float> got_m(good.grad.size());
  ASSERT_TRUE((*compute)->CopyToHost(update.data(), good.g, 0, bytes).ok());
  ASSERT_TRUE((*compute)->CopyToHost(got_m.data(), good.m, 0, bytes).ok());
  const absl::Status s = (*compute)->Synchronize();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_LT(RelativeError(update, want), 1e-4);
  EXPECT_TRUE(SameBits(got_m, want_m));
  // An infinite momentum is refused the same way.
  bad.momentum[3] = INFINITY;
  bad.grad[17] = 0.5f;
  ASSERT_TRUE((*compute)->CopyToDevice(bad.g, 0, bad.grad.data(), bytes).ok());
  ASSERT_TRUE((*compute)->CopyToDevice(bad.m, 0, bad.momentum.data(), bytes).ok());
  ASSERT_TRUE((*compute)->Muon(config, {{&bad.spec, &bad.g, &bad.m}}).ok());
  EXPECT_EQ((*compute)->Synchronize().code(), absl::StatusCode::kInvalidArgument);
}

// Bad calls are refused at once with the right code, and the stream stays usable.
TEST(CudaStreamTest, BadCallsAreRefused) {
  MUOND_REQUIRE_CUDA_DEVICE(dev);
  auto s = dev->CreateStream();
  ASSERT_TRUE(s.ok());
  auto small = dev->Allocate(64);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->size(), 64u);
  std::vector<float> host(32, 1.0f);
  EXPECT_EQ((*s)->CopyToDevice(*small, 8, host.data(), 64).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*s)->CopyToHost(host.data(), *small, 65, 0).code(), absl::StatusCode::kOutOfRange);
  MatrixSpec spec{"too_big", {8, 8}, 1};
  auto m = dev->Allocate(8 * 8 * sizeof(float));
  ASSERT_TRUE(m.ok());
  MuonConfig config;
  absl::Status st = (*s)->Muon(config, {{&spec, &*small, &*m}});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("too_big"), std::string::npos);
  MatrixSpec heads{"bad_heads", {6, 8}, 4};  // 4 heads do not divide 6 rows
  auto g6 = dev->Allocate(6 * 8 * sizeof(float));
  auto m6 = dev->Allocate(6 * 8 * sizeof(float));
  ASSERT_TRUE(g6.ok() && m6.ok());
  EXPECT_EQ((*s)->Muon(config, {{&heads, &*g6, &*m6}}).code(), absl::StatusCode::kInvalidArgument);
  MuonConfig no_steps;
  no_steps.ns_steps = 0;
  MatrixSpec fine{"fine", {6, 8}, 1};
  EXPECT_EQ((*s)->Muon(no_steps, {{&fine, &*g6, &*m6}}).code(), absl::StatusCode::kInvalidArgument);
  // An event of another device.
  auto cpu = OpenBackend("cpu", 1, SimulatedOptions{});
  ASSERT_TRUE(cpu.ok());
  auto cpu_stream = cpu->device->CreateStream();
  ASSERT_TRUE(cpu_stream.ok());
  auto cpu_event = (*cpu_stream)->Record();
  ASSERT_TRUE(cpu_event.ok());
  EXPECT_EQ((*s)->WaitFor(*cpu_event).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*s)->Synchronize().ok());
}

// The pool's bound: allocations above it fail with RESOURCE_EXHAUSTED (as does a kernel whose
// scratch space does not fit, reported by its event); freed buffers are reused; the default
// limit comes back with 0.
TEST(CudaStreamTest, MemoryLimitBoundsThePool) {
  MUOND_REQUIRE_CUDA_DEVICE(dev);
  constexpr size_t kMiB = size_t{1} << 20;
  dev->SetMemoryLimit(64 * kMiB);
  {
    auto a = dev->Allocate(32 * kMiB);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = dev->Allocate(48 * kMiB);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
  }
  {
    auto b = dev->Allocate(48 * kMiB);  // the 32 MiB block was given back
    ASSERT_TRUE(b.ok()) << b.status();
  }
  auto s = dev->CreateStream();
  ASSERT_TRUE(s.ok());
  Matrix big = MakeMatrix(*dev, "big", {2048, 2048}, 5);  // 2 x 16 MiB, scratch > 100 MiB
  const size_t bytes = big.grad.size() * sizeof(float);
  ASSERT_TRUE((*s)->CopyToDevice(big.g, 0, big.grad.data(), bytes).ok());
  ASSERT_TRUE((*s)->CopyToDevice(big.m, 0, big.momentum.data(), bytes).ok());
  ASSERT_TRUE((*s)->Muon(MuonConfig{}, {{&big.spec, &big.g, &big.m}}).ok());
  const absl::Status refused = (*s)->Synchronize();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  dev->SetMemoryLimit(0);
  ASSERT_TRUE((*s)->CopyToDevice(big.g, 0, big.grad.data(), bytes).ok());
  ASSERT_TRUE((*s)->CopyToDevice(big.m, 0, big.momentum.data(), bytes).ok());
  ASSERT_TRUE((*s)->Muon(MuonConfig{}, {{&big.spec, &big.g, &big.m}}).ok());
  const absl::Status done = (*s)->Synchronize();
  EXPECT_TRUE(done.ok()) << done;
}

// Many kernel calls in flight on one stream, each followed by its copies back; then the device's
// busy time has grown for each kind of work.
TEST(CudaStreamTest, ManyCallsInFlightOnOneStreamAndBusyTime) {
  MUOND_REQUIRE_CUDA_DEVICE(dev);
  const Device::BusySeconds before = dev->Busy();
  auto s = dev->CreateStream();
  ASSERT_TRUE(s.ok());
  MuonConfig config;
  config.compute_dtype = common::DType::kBFloat16;
  std::vector<Matrix> mats;
  for (int i = 0; i < 12; ++i) {
    mats.push_back(MakeMatrix(*dev, "m", {64 + 16 * i, 96}, 100 + 2 * i));
  }
  std::vector<std::vector<float>> updates(mats.size()), moms(mats.size());
  for (size_t i = 0; i < mats.size(); ++i) {
    Matrix& x = mats[i];
    const size_t bytes = x.grad.size() * sizeof(float);
    updates[i].assign(x.grad.size(), 0.0f);
    moms[i].assign(x.grad.size(), 0.0f);
    ASSERT_TRUE((*s)->CopyToDevice(x.g, 0, x.grad.data(), bytes).ok());
    ASSERT_TRUE((*s)->CopyToDevice(x.m, 0, x.momentum.data(), bytes).ok());
    ASSERT_TRUE((*s)->Muon(config, {{&x.spec, &x.g, &x.m}}).ok());
    ASSERT_TRUE((*s)->CopyToHost(updates[i].data(), x.g, 0, bytes).ok());
    ASSERT_TRUE((*s)->CopyToHost(moms[i].data(), x.m, 0, bytes).ok());
  }
  const absl::Status st = (*s)->Synchronize();
  ASSERT_TRUE(st.ok()) << st;
  for (size_t i = 0; i < mats.size(); ++i) {
    Matrix& x = mats[i];
    std::vector<float> want(x.grad.size()), want_m = x.momentum;
    ASSERT_TRUE(MuonUpdate(config, x.spec, x.grad.data(), want_m.data(), want.data()).ok());
    EXPECT_LT(RelativeError(updates[i], want), 2e-2) << i;
    EXPECT_TRUE(SameBits(moms[i], want_m)) << i;
  }
  const Device::BusySeconds after = dev->Busy();
  EXPECT_GT(after.copy_in, before.copy_in);
  EXPECT_GT(after.compute, before.compute);
  EXPECT_GT(after.writeback, before.writeback);
}

}  // namespace
}  // namespace muond::server::device
