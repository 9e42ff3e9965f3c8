// server/optim/adamw: against LibTorch's own AdamW (torch::optim::AdamW, the same algorithm as
// torch.optim.AdamW(foreach=False)) over 100 steps, and the fused kernel's paths against each other
// bit for bit.
#include "server/optim/adamw.h"
#include "server/optim/cpu_isa.h"

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace muond::server {
namespace {

struct State {
  std::vector<float> p, m, v;
};

State RandomState(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  s.p.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  for (size_t i = 0; i < n; ++i) {
    s.p[i] = normal(rng);
    s.m[i] = 0.1f * normal(rng);
    s.v[i] = std::abs(0.01f * normal(rng));
  }
  return s;
}

std::vector<float> RandomGrad(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> g(n);
  for (float& x : g) x = normal(rng);
  return g;
}

double RelativeError(const std::vector<float>& got, const torch::Tensor& want) {
  const torch::Tensor w = want.contiguous().to(torch::kFloat64).flatten();
  const torch::Tensor g = torch::from_blob(const_cast<float*>(got.data()),
                                           {static_cast<int64_t>(got.size())}, torch::kFloat32)
                              .to(torch::kFloat64);
  return (g - w).norm().item<double>() / std::max(w.norm().item<double>(), 1e-30);
}

AdamWArrays Arrays(const std::vector<float>& g, State& s) {
  return AdamWArrays{g.data(),   s.p.data(), s.m.data(),
                     s.v.data(), nullptr,    common::DType::kFloat32};
}

// Tensors of assorted sizes (tails that are not a multiple of the vector width included), an lr
// schedule, weight decay, and one tensor that gets no gradient every third step (its step count,
// like torch's, advances only when it is updated).
TEST(AdamWTest, MatchesTorchAdamWOver100Steps) {
  std::mt19937 rng(1234);
  const std::vector<int64_t> sizes = {1, 7, 16, 33, 1000, 4099, 65536 + 5};
  const AdamWHyper base{1e-3, 0.1, 0.9, 0.95, 1e-8};
  std::vector<torch::Tensor> params;
  std::vector<State> ours;
  for (int64_t n : sizes) {
    ours.push_back(RandomState(static_cast<size_t>(n), rng));
    params.push_back(torch::from_blob(ours.back().p.data(), {n}, torch::kFloat32)
                         .clone()
                         .set_requires_grad(true));
    // torch starts from zero moments: so do we.
    std::fill(ours.back().m.begin(), ours.back().m.end(), 0.0f);
    std::fill(ours.back().v.begin(), ours.back().v.end(), 0.0f);
  }
  torch::optim::AdamW torch_opt(params, torch::optim::AdamWOptions(base.lr)
                                            .betas({base.beta1, base.beta2})
                                            .eps(base.eps)
                                            .weight_decay(base.weight_decay));
  std::vector<int64_t> steps(sizes.size(), 0);
  for (int step = 1; step <= 100; ++step) {
    AdamWHyper h = base;
    h.lr = base.lr * 0.5 * (1.0 + std::cos(M_PI * step / 100.0)) + 1e-5;  // cosine schedule
    static_cast<torch::optim::AdamWOptions&>(torch_opt.param_groups()[0].options()).lr(h.lr);
    for (size_t t = 0; t < sizes.size(); ++t) {
      const bool skipped = t == 2 && step % 3 == 0;
      if (skipped) {
        params[t].mutable_grad() = torch::Tensor();
        continue;
      }
      const std::vector<float> g = RandomGrad(ours[t].p.size(), rng, 1e-2f);
      params[t].mutable_grad() =
          torch::from_blob(const_cast<float*>(g.data()), {sizes[t]}, torch::kFloat32).clone();
      AdamWUpdate(h, ++steps[t], 1.0f, Arrays(g, ours[t]), g.size());
    }
    torch_opt.step();
  }
  for (size_t t = 0; t < sizes.size(); ++t) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(
        *torch_opt.state().at(c10::guts::to_string(params[t].unsafeGetTensorImpl())));
    EXPECT_EQ(st.step(), steps[t]) << "tensor " << t;
    const double ep = RelativeError(ours[t].p, params[t].detach());
    const double em = RelativeError(ours[t].m, st.exp_avg());
    const double ev = RelativeError(ours[t].v, st.exp_avg_sq());
    std::printf("tensor %zu (%lld elements): relative error p %.2e m %.2e v %.2e\n", t,
                static_cast<long long>(sizes[t]), ep, em, ev);
    EXPECT_LT(ep, 1e-6) << "tensor " << t;
    EXPECT_LT(em, 1e-6) << "tensor " << t;
    EXPECT_LT(ev, 1e-6) << "tensor " << t;
  }
}

// Runs 5 steps from the same state on one path and returns the final state.
State FiveSteps(size_t n, AdamWPath path, int threads, float grad_scale) {
  std::mt19937 rng(99);
  State s = RandomState(n, rng);
  const AdamWHyper h{3e-3, 0.05, 0.9, 0.999, 1e-8};
  for (int step = 1; step <= 5; ++step) {
    const std::vector<float> g = RandomGrad(n, rng, 0.5f);
    AdamWUpdate(h, step, grad_scale, Arrays(g, s), n, threads, path);
  }
  return s;
}

bool SameBits(const State& a, const State& b) {
  const size_t bytes = a.p.size() * sizeof(float);
  return std::memcmp(a.p.data(), b.p.data(), bytes) == 0 &&
         std::memcmp(a.m.data(), b.m.data(), bytes) == 0 &&
         std::memcmp(a.v.data(), b.v.data(), bytes) == 0;
}

// Each vector path against the portable one (the narrower paths are forced on wider CPUs); a
// path this CPU lacks is skipped, not run as another.
void ExpectPathMatchesPortable(AdamWPath path, const char* name) {
  if (std::string(AdamWPathName(path)) != name) {
    GTEST_SKIP() << "this CPU has no " << name << " path (it would run "
                 << AdamWPathName(path) << ")";
  }
  for (size_t n : {size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{15}, size_t{16},
                   size_t{17}, size_t{2049}, size_t{100003}}) {
    EXPECT_TRUE(
        SameBits(FiveSteps(n, path, 1, 0.25f), FiveSteps(n, AdamWPath::kPortable, 1, 0.25f)))
        << name << ", " << n << " elements";
  }
}

TEST(AdamWTest, Avx512AndPortablePathsAgreeBitForBit) {
  ExpectPathMatchesPortable(AdamWPath::kAvx512, "avx512");
}

TEST(AdamWTest, Avx2AndPortablePathsAgreeBitForBit) {
  ExpectPathMatchesPortable(AdamWPath::kAvx2, "avx2");
}

TEST(AdamWTest, Avx2AndAvx512PathsAgreeBitForBit) {
  if (std::string(AdamWPathName(AdamWPath::kAvx512)) != "avx512") {
    GTEST_SKIP() << "this CPU has no AVX-512";
  }
  const size_t n = 100003;
  EXPECT_TRUE(SameBits(FiveSteps(n, AdamWPath::kAvx512, 1, 0.25f),
                       FiveSteps(n, AdamWPath::kAvx2, 1, 0.25f)));
}

TEST(AdamWTest, AutoFollowsTheCpuPath) {
  // kAuto is the vector path of the process's CPU path (MUOND_CPU_ISA=avx2 makes it avx2).
  const CpuIsa isa = CurrentCpuMathPath().isa;
  const std::string want = isa >= CpuIsa::kAvx512 ? "avx512"
                           : isa == CpuIsa::kAvx2 ? "avx2"
                                                  : "portable";
  EXPECT_EQ(AdamWAutoPathName(), want) << "cpu path " << CpuIsaName(isa);
}

TEST(AdamWTest, ThreadsDoNotChangeTheResult) {
  const size_t n = (size_t{3} << 20) + 7;  // enough for three workers
  EXPECT_TRUE(
      SameBits(FiveSteps(n, AdamWPath::kAuto, 1, 1.0f), FiveSteps(n, AdamWPath::kAuto, 3, 1.0f)));
}

TEST(AdamWTest, GradScaleIsOneMultiplication) {
  // g * scale inside the pass equals passing the scaled gradient (scale 1/1024: exact in float).
  std::mt19937 rng(7);
  State a = RandomState(1000, rng);
  State b = a;
  const std::vector<float> g = RandomGrad(1000, rng, 100.0f);
  std::vector<float> scaled(g);
  for (float& x : scaled) x *= 1.0f / 1024.0f;
  const AdamWHyper h;
  AdamWUpdate(h, 1, 1.0f / 1024.0f, Arrays(g, a), g.size());
  AdamWUpdate(h, 1, 1.0f, Arrays(scaled, b), g.size());
  EXPECT_TRUE(SameBits(a, b));
}

TEST(AdamWTest, OutputIsTheNewParamRoundedLikeTorch) {
  std::mt19937 rng(11);
  const size_t n = 5000;
  for (common::DType dtype :
       {common::DType::kBFloat16, common::DType::kFloat16, common::DType::kFloat32}) {
    State s = RandomState(n, rng);
    const std::vector<float> g = RandomGrad(n, rng, 1.0f);
    std::vector<char> out(n * common::DTypeSize(dtype));
    AdamWArrays a = Arrays(g, s);
    a.out = out.data();
    a.out_dtype = dtype;
    AdamWUpdate(AdamWHyper{}, 3, 1.0f, a, n);
    const auto torch_dtype = dtype == common::DType::kBFloat16  ? torch::kBFloat16
                             : dtype == common::DType::kFloat16 ? torch::kFloat16
                                                                : torch::kFloat32;
    const torch::Tensor want =
        torch::from_blob(s.p.data(), {static_cast<int64_t>(n)}, torch::kFloat32).to(torch_dtype);
    EXPECT_EQ(std::memcmp(out.data(), want.data_ptr(), out.size()), 0) << common::DTypeName(dtype);
  }
}

}  // namespace
}  // namespace muond::server
