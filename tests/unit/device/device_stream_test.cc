// Streams, events and the simulated device's clock (DESIGN.md 6; device.h):
//  - a stream runs its operations in order; WaitFor makes another stream wait for an event;
//    Synchronize drains; copies outside a buffer are OUT_OF_RANGE and enqueue nothing;
//  - the simulated clock: a copy of B bytes costs latency + B / bandwidth, a kernel flops / rate;
//    streams joined by WaitFor serialize, independent streams overlap (the clock is the max, not
//    the sum); work the host enqueues after waiting for an event starts no earlier than it;
//  - an injected kernel failure is reported to the next event with INTERNAL, skips the work
//    between them, reaches a stream that waits for that event, and the streams work again after.
// No sleeps: every check waits on an event or Synchronize.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/device/device.h"
#include "server/optim/muon_math.h"

namespace muond::server::device {
namespace {

constexpr int kThreads = 2;

std::unique_ptr<Device> Open(const std::string& backend, const SimulatedOptions& sim = {}) {
  auto b = OpenBackend(backend, kThreads, sim);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(b->device) : nullptr;
}

std::unique_ptr<Stream> NewStream(Device& dev) {
  auto s = dev.CreateStream();
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

std::vector<float> Iota(size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

common::MatrixSpec Spec(int64_t r, int64_t c) {
  common::MatrixSpec s;
  s.name = "m";
  s.shape = {r, c};
  return s;
}

class StreamTest : public testing::TestWithParam<const char*> {};

INSTANTIATE_TEST_SUITE_P(Backends, StreamTest, testing::Values("cpu", "simulated"));

// Copy in, copy out, overwrite, copy out again, many rounds, one stream: every copy-out sees the
// copy-in enqueued just before it, never a later one.
TEST_P(StreamTest, OperationsOnOneStreamRunInOrder) {
  auto dev = Open(GetParam());
  ASSERT_NE(dev, nullptr);
  auto s = NewStream(*dev);
  constexpr size_t kN = 4096;
  constexpr int kRounds = 64;
  auto buf = dev->Allocate(kN * sizeof(float));
  ASSERT_TRUE(buf.ok());
  std::vector<std::vector<float>> in, out(kRounds, std::vector<float>(kN, -1.0f));
  for (int r = 0; r < kRounds; ++r) in.push_back(Iota(kN, static_cast<float>(r * kN)));
  for (int r = 0; r < kRounds; ++r) {
    ASSERT_TRUE(s->CopyToDevice(*buf, 0, in[r].data(), kN * sizeof(float)).ok());
    // A partial copy-out of the second half first, then the whole: offsets honoured.
    ASSERT_TRUE(
        s->CopyToHost(out[r].data() + kN / 2, *buf, kN / 2 * sizeof(float), kN / 2 * sizeof(float))
            .ok());
    ASSERT_TRUE(s->CopyToHost(out[r].data(), *buf, 0, kN / 2 * sizeof(float)).ok());
  }
  ASSERT_TRUE(s->Synchronize().ok());
  for (int r = 0; r < kRounds; ++r) EXPECT_EQ(out[r], in[r]) << "round " << r;
}

// Stream A runs a Muon kernel (milliseconds of real work) that overwrites its buffer; stream B
// waits for A's event and copies the buffer out: B sees the kernel's result, not the input.
TEST_P(StreamTest, WaitForMakesAnotherStreamSeeTheFirstStreamsResult) {
  auto dev = Open(GetParam());
  ASSERT_NE(dev, nullptr);
  auto a = NewStream(*dev);
  auto b = NewStream(*dev);
  const common::MatrixSpec spec = Spec(192, 256);
  const size_t n = static_cast<size_t>(spec.numel()), bytes = n * sizeof(float);
  std::vector<float> grad(n), mom(n, 0.0f);
  for (size_t i = 0; i < n; ++i) grad[i] = static_cast<float>((i * 7919) % 1000) / 1000.0f - 0.5f;
  common::MuonConfig config;
  std::vector<float> want(n), want_mom = mom;
  ASSERT_TRUE(MuonUpdate(config, spec, grad.data(), want_mom.data(), want.data()).ok());

  for (int round = 0; round < 3; ++round) {
    auto g = dev->Allocate(bytes);
    auto m = dev->Allocate(bytes);
    ASSERT_TRUE(g.ok() && m.ok());
    ASSERT_TRUE(a->CopyToDevice(*g, 0, grad.data(), bytes).ok());
    ASSERT_TRUE(a->CopyToDevice(*m, 0, mom.data(), bytes).ok());
    ASSERT_TRUE(a->Muon(config, {{&spec, &*g, &*m}}).ok());
    auto done = a->Record();
    ASSERT_TRUE(done.ok());
    ASSERT_TRUE(b->WaitFor(*done).ok());
    std::vector<float> got(n, 0.0f);
    ASSERT_TRUE(b->CopyToHost(got.data(), *g, 0, bytes).ok());
    ASSERT_TRUE(b->Synchronize().ok());
    EXPECT_TRUE((*done)->Done());  // B got past its wait, so A reached the event
    EXPECT_EQ(std::memcmp(got.data(), want.data(), bytes), 0) << "round " << round;
  }
}

TEST_P(StreamTest, SynchronizeDrainsAndEventsReportDone) {
  auto dev = Open(GetParam());
  ASSERT_NE(dev, nullptr);
  auto s = NewStream(*dev);
  auto buf = dev->Allocate(1 << 20);
  ASSERT_TRUE(buf.ok());
  std::vector<char> src(1 << 20, 'x'), dst(1 << 20, 0);
  std::vector<std::shared_ptr<Event>> events;
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(s->CopyToDevice(*buf, 0, src.data(), src.size()).ok());
    ASSERT_TRUE(s->CopyToHost(dst.data(), *buf, 0, dst.size()).ok());
    auto e = s->Record();
    ASSERT_TRUE(e.ok());
    events.push_back(*e);
  }
  ASSERT_TRUE(s->Synchronize().ok());
  for (const auto& e : events) {
    EXPECT_TRUE(e->Done());
    EXPECT_TRUE(e->Wait().ok());  // waiting again returns at once with the same status
  }
  EXPECT_EQ(dst, src);
  ASSERT_TRUE(s->Synchronize().ok());  // an empty stream synchronizes too
}

TEST_P(StreamTest, CopiesOutsideTheBufferAreOutOfRangeAndEnqueueNothing) {
  auto dev = Open(GetParam());
  ASSERT_NE(dev, nullptr);
  auto s = NewStream(*dev);
  auto buf = dev->Allocate(64);
  ASSERT_TRUE(buf.ok());
  std::vector<char> host(128, 'h');
  const size_t kHuge = std::numeric_limits<size_t>::max();
  const absl::StatusCode kOut = absl::StatusCode::kOutOfRange;
  EXPECT_EQ(s->CopyToDevice(*buf, 0, host.data(), 65).code(), kOut);
  EXPECT_EQ(s->CopyToDevice(*buf, 60, host.data(), 8).code(), kOut);
  EXPECT_EQ(s->CopyToDevice(*buf, 65, host.data(), 0).code(), kOut);
  EXPECT_EQ(s->CopyToDevice(*buf, 1, host.data(), kHuge).code(), kOut);  // no wrap-around
  EXPECT_EQ(s->CopyToHost(host.data(), *buf, 0, 65).code(), kOut);
  EXPECT_EQ(s->CopyToHost(host.data(), *buf, 64, 1).code(), kOut);
  EXPECT_EQ(s->CopyToHost(host.data(), *buf, kHuge, 2).code(), kOut);
  // Edges that fit are fine, and the stream is unharmed.
  std::vector<char> in(64, 'a'), out(64, 0);
  EXPECT_TRUE(s->CopyToDevice(*buf, 0, in.data(), 64).ok());
  EXPECT_TRUE(s->CopyToDevice(*buf, 64, in.data(), 0).ok());
  EXPECT_TRUE(s->CopyToHost(out.data(), *buf, 0, 64).ok());
  EXPECT_TRUE(s->Synchronize().ok());
  EXPECT_EQ(out, in);
}

// Host views and a separate momentum output (how the cpu device runs a step in place): the kernel
// reads the momentum buffer, writes the new momentum into momentum_out and the update over the
// gradient (the bits of a plain call); views are never freed by the device. A buffer smaller than
// its matrix is INVALID_ARGUMENT and enqueues nothing.
TEST_P(StreamTest, MuonWithASeparateMomentumOutputOnHostViews) {
  auto dev = Open(GetParam());
  ASSERT_NE(dev, nullptr);
  EXPECT_EQ(dev->ComputesInHostMemory(), std::string(GetParam()) == "cpu");
  auto s = NewStream(*dev);
  const common::MatrixSpec spec = Spec(24, 40);
  const size_t n = 24 * 40, bytes = n * sizeof(float);
  std::vector<float> grad(n), committed(n), next(n, -1.0f);
  for (size_t i = 0; i < n; ++i) {
    grad[i] = std::sin(0.37f * static_cast<float>(i));
    committed[i] = std::cos(0.11f * static_cast<float>(i));
  }
  std::vector<float> want_update = grad, want_momentum = committed;
  ASSERT_TRUE(MuonUpdate(common::MuonConfig{}, spec, want_update.data(), want_momentum.data(),
                         want_update.data())
                  .ok());
  const std::vector<float> committed_before = committed;
  DeviceBuffer g = DeviceBuffer::HostView(grad.data(), bytes);
  DeviceBuffer m = DeviceBuffer::HostView(committed.data(), bytes);
  DeviceBuffer out = DeviceBuffer::HostView(next.data(), bytes);
  EXPECT_FALSE(g.owned());
  ASSERT_TRUE(s->Muon(common::MuonConfig{}, {{&spec, &g, &m, &out}}).ok());
  ASSERT_TRUE(s->Synchronize().ok());
  EXPECT_EQ(committed, committed_before);
  EXPECT_EQ(next, want_momentum);
  EXPECT_EQ(grad, want_update);

  DeviceBuffer small = DeviceBuffer::HostView(next.data(), bytes - sizeof(float));
  const absl::Status refused = s->Muon(common::MuonConfig{}, {{&spec, &g, &m, &small}});
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(std::string(refused.message()).find("'m'"), std::string::npos) << refused;
  EXPECT_TRUE(s->Synchronize().ok());
  EXPECT_EQ(committed, committed_before);
}

// ---- The simulated clock ----

constexpr double kTol = 1e-12;

SimulatedOptions Sim() {
  SimulatedOptions o;
  o.copy_gbps = 2;  // 2e9 bytes/s
  o.copy_latency_us = 5;
  o.compute_gflops = 100;
  return o;
}
double CopyCost(size_t bytes) { return 5e-6 + static_cast<double>(bytes) / 2e9; }

TEST(SimulatedClockTest, CpuBackendHasNoClock) {
  auto dev = Open("cpu");
  ASSERT_NE(dev, nullptr);
  auto s = NewStream(*dev);
  auto buf = dev->Allocate(1 << 16);
  std::vector<char> host(1 << 16);
  ASSERT_TRUE(s->CopyToDevice(*buf, 0, host.data(), host.size()).ok());
  ASSERT_TRUE(s->Synchronize().ok());
  EXPECT_EQ(dev->SimulatedSeconds(), 0.0);
}

TEST(SimulatedClockTest, CopyCostsLatencyPlusBytesOverBandwidth) {
  auto dev = Open("simulated", Sim());
  ASSERT_NE(dev, nullptr);
  auto s = NewStream(*dev);
  EXPECT_EQ(dev->SimulatedSeconds(), 0.0);
  auto buf = dev->Allocate(3 << 20);
  std::vector<char> host(3 << 20);
  double expected = 0;
  for (size_t bytes : {size_t{1} << 20, size_t{3} << 20, size_t{0}, size_t{12345}}) {
    ASSERT_TRUE(s->CopyToDevice(*buf, 0, host.data(), bytes).ok());
    ASSERT_TRUE(s->Synchronize().ok());
    expected += CopyCost(bytes);
    EXPECT_NEAR(dev->SimulatedSeconds(), expected, kTol) << bytes << " bytes in";
    ASSERT_TRUE(s->CopyToHost(host.data(), *buf, 0, bytes).ok());
    ASSERT_TRUE(s->Synchronize().ok());
    expected += CopyCost(bytes);
    EXPECT_NEAR(dev->SimulatedSeconds(), expected, kTol) << bytes << " bytes out";
  }
  // Records, waits and Synchronize cost nothing.
  auto e = s->Record();
  ASSERT_TRUE(e.ok() && (*e)->Wait().ok());
  EXPECT_NEAR(dev->SimulatedSeconds(), expected, kTol);
}

TEST(SimulatedClockTest, KernelCostsFlopsOverRate) {
  auto dev = Open("simulated", Sim());
  ASSERT_NE(dev, nullptr);
  auto s = NewStream(*dev);
  // 3 experts of 32 x 96 (m = 32, n = 96) and one tall 80 x 20 (m = 20, n = 80); 5 iterations.
  common::MatrixSpec a = Spec(32, 96), b = Spec(80, 20);
  a.shape = {3, 32, 96};
  auto flops = [](double m, double n, double batch) {
    return batch * 5 * (4 * m * m * n + 2 * m * m * m);
  };
  const double want = (flops(32, 96, 3) + flops(20, 80, 1)) / 100e9;
  auto ga = dev->Allocate(a.numel() * 4), ma = dev->Allocate(a.numel() * 4);
  auto gb = dev->Allocate(b.numel() * 4), mb = dev->Allocate(b.numel() * 4);
  std::vector<float> za(a.numel(), 0.25f), zb(b.numel(), -0.5f);
  std::memcpy(ga->data(), za.data(), za.size() * 4);  // host-memory device: direct init
  std::memcpy(ma->data(), za.data(), za.size() * 4);
  std::memcpy(gb->data(), zb.data(), zb.size() * 4);
  std::memcpy(mb->data(), zb.data(), zb.size() * 4);
  ASSERT_TRUE(s->Muon(common::MuonConfig{}, {{&a, &*ga, &*ma}, {&b, &*gb, &*mb}}).ok());
  ASSERT_TRUE(s->Synchronize().ok());
  EXPECT_NEAR(dev->SimulatedSeconds(), want, kTol);
}

TEST(SimulatedClockTest, DependentStreamsSerializeIndependentStreamsOverlap) {
  auto dev = Open("simulated", Sim());
  ASSERT_NE(dev, nullptr);
  auto a = NewStream(*dev);
  auto b = NewStream(*dev);
  const size_t kA = 4 << 20, kB = 2 << 20;
  auto buf_a = dev->Allocate(kA), buf_b = dev->Allocate(kB);
  std::vector<char> host(kA);

  // Independent: both start at 0; the clock is the longer, not the sum.
  ASSERT_TRUE(a->CopyToDevice(*buf_a, 0, host.data(), kA).ok());
  ASSERT_TRUE(b->CopyToDevice(*buf_b, 0, host.data(), kB).ok());
  ASSERT_TRUE(a->Synchronize().ok());
  ASSERT_TRUE(b->Synchronize().ok());
  double t = std::max(CopyCost(kA), CopyCost(kB));
  EXPECT_NEAR(dev->SimulatedSeconds(), t, kTol);

  // Dependent: B waits for A's event, so B's copy starts when A's ends.
  ASSERT_TRUE(a->CopyToDevice(*buf_a, 0, host.data(), kA).ok());
  auto e = a->Record();
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(b->WaitFor(*e).ok());
  ASSERT_TRUE(b->CopyToDevice(*buf_b, 0, host.data(), kB).ok());
  ASSERT_TRUE(b->Synchronize().ok());
  t += CopyCost(kA) + CopyCost(kB);
  EXPECT_NEAR(dev->SimulatedSeconds(), t, kTol);

  // A three-stage chain of 4 batches on three streams (copy 1 unit, "compute" 1 unit as a copy,
  // writeback 1 unit): a pipeline takes (4 + 2) units, not 12.
  auto c = NewStream(*dev);
  const double unit = CopyCost(kB);
  std::vector<std::shared_ptr<Event>> last;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(a->CopyToDevice(*buf_b, 0, host.data(), kB).ok());
    auto in = a->Record();
    ASSERT_TRUE(b->WaitFor(*in).ok());
    ASSERT_TRUE(b->CopyToDevice(*buf_b, 0, host.data(), kB).ok());
    auto mid = b->Record();
    ASSERT_TRUE(c->WaitFor(*mid).ok());
    ASSERT_TRUE(c->CopyToHost(host.data(), *buf_b, 0, kB).ok());
    last.push_back(*c->Record());
  }
  ASSERT_TRUE(last.back()->Wait().ok());
  t += 6 * unit;
  EXPECT_NEAR(dev->SimulatedSeconds(), t, 1e-9);
}

// The host clock: work enqueued after the host waited for an event starts no earlier than that
// event, even on a stream that was idle (a serial schedule costs the sum of its stages).
TEST(SimulatedClockTest, WorkEnqueuedAfterAHostWaitStartsAfterIt) {
  auto dev = Open("simulated", Sim());
  ASSERT_NE(dev, nullptr);
  auto a = NewStream(*dev);
  auto b = NewStream(*dev);
  auto c = NewStream(*dev);
  const size_t kN = 1 << 20;
  auto buf = dev->Allocate(kN);
  std::vector<char> host(kN);
  // Three stages run one after another with the host waiting in between, twice.
  double t = 0;
  for (int round = 0; round < 2; ++round) {
    for (Stream* s : {a.get(), b.get(), c.get()}) {
      ASSERT_TRUE(s->CopyToDevice(*buf, 0, host.data(), kN).ok());
      auto e = s->Record();
      ASSERT_TRUE(e.ok() && (*e)->Wait().ok());
      t += CopyCost(kN);
      EXPECT_NEAR(dev->SimulatedSeconds(), t, kTol);
    }
  }
  // A fresh stream created late starts at the host clock too.
  auto d = NewStream(*dev);
  ASSERT_TRUE(d->CopyToDevice(*buf, 0, host.data(), kN).ok());
  ASSERT_TRUE(d->Synchronize().ok());
  EXPECT_NEAR(dev->SimulatedSeconds(), t + CopyCost(kN), kTol);
}

// ---- Injected failures ----

TEST(InjectedFailureTest, KernelFailureReachesTheNextEventThenTheStreamWorksAgain) {
  SimulatedOptions sim = Sim();
  sim.fail_kernel = 2;
  auto dev = Open("simulated", sim);
  ASSERT_NE(dev, nullptr);
  auto compute = NewStream(*dev);
  auto out = NewStream(*dev);
  const common::MatrixSpec spec = Spec(16, 24);
  const size_t n = static_cast<size_t>(spec.numel()), bytes = n * sizeof(float);
  std::vector<float> grad(n), mom(n, 0.0f), want(n), want_mom(n, 0.0f);
  for (size_t i = 0; i < n; ++i) grad[i] = std::sin(static_cast<float>(i));
  ASSERT_TRUE(
      MuonUpdate(common::MuonConfig{}, spec, grad.data(), want_mom.data(), want.data()).ok());

  // Runs kernel k with its writeback on `out` (waiting for the kernel's event); returns both
  // events' statuses and the update.
  auto run = [&](absl::Status* kernel_status, absl::Status* written_status) {
    auto g = dev->Allocate(bytes), m = dev->Allocate(bytes);
    std::vector<float> got(n, -7.0f);
    EXPECT_TRUE(compute->CopyToDevice(*g, 0, grad.data(), bytes).ok());
    EXPECT_TRUE(compute->CopyToDevice(*m, 0, mom.data(), bytes).ok());
    EXPECT_TRUE(compute->Muon(common::MuonConfig{}, {{&spec, &*g, &*m}}).ok());
    // Work after the failing kernel and before the event is skipped.
    std::vector<float> after(n, -7.0f);
    EXPECT_TRUE(compute->CopyToHost(after.data(), *g, 0, bytes).ok());
    auto computed = compute->Record();
    EXPECT_TRUE(out->WaitFor(*computed).ok());
    EXPECT_TRUE(out->CopyToHost(got.data(), *g, 0, bytes).ok());
    auto written = out->Record();
    *kernel_status = (*computed)->Wait();
    *written_status = (*written)->Wait();
    if (!kernel_status->ok()) {
      EXPECT_EQ(after, std::vector<float>(n, -7.0f)) << "work after the failure ran";
    } else {
      EXPECT_EQ(after, want);
    }
    return got;
  };
  absl::Status k, w;
  std::vector<float> got = run(&k, &w);
  EXPECT_TRUE(k.ok() && w.ok()) << k << " / " << w;
  EXPECT_EQ(got, want);

  got = run(&k, &w);  // kernel 2 fails
  EXPECT_EQ(k.code(), absl::StatusCode::kInternal) << k;
  EXPECT_NE(std::string(k.message()).find("injected kernel failure"), std::string::npos) << k;
  EXPECT_EQ(w.code(), absl::StatusCode::kInternal) << "the waiting stream must see it: " << w;
  EXPECT_EQ(got, std::vector<float>(n, -7.0f)) << "the writeback after a failed wait ran";

  for (int i = 0; i < 2; ++i) {  // kernels 3 and 4: both streams work again
    got = run(&k, &w);
    EXPECT_TRUE(k.ok() && w.ok()) << k << " / " << w;
    EXPECT_EQ(got, want);
  }
  EXPECT_TRUE(compute->Synchronize().ok());
  EXPECT_TRUE(out->Synchronize().ok());
}

TEST(InjectedFailureTest, SynchronizeReportsTheFailureOnce) {
  SimulatedOptions sim = Sim();
  sim.fail_kernel = 1;
  auto dev = Open("simulated", sim);
  ASSERT_NE(dev, nullptr);
  auto s = NewStream(*dev);
  const common::MatrixSpec spec = Spec(8, 8);
  auto g = dev->Allocate(64 * 4), m = dev->Allocate(64 * 4);
  std::memset(g->data(), 0, 64 * 4);
  std::memset(m->data(), 0, 64 * 4);
  ASSERT_TRUE(s->Muon(common::MuonConfig{}, {{&spec, &*g, &*m}}).ok());
  const absl::Status first = s->Synchronize();
  EXPECT_EQ(first.code(), absl::StatusCode::kInternal) << first;
  EXPECT_TRUE(s->Synchronize().ok());
}

}  // namespace
}  // namespace muond::server::device
