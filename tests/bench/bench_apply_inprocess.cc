// `muond-bench apply`'s in-process baseline (what trainers do today: see bench_apply.cc's top
// comment) and muond's Muon kernel timed alone.
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "server/optim/muon_math.h"
#include "tests/bench/bench.h"
#include "tests/bench/bench_apply.h"

namespace muond::bench::apply {
namespace {

// Newton-Schulz as DESIGN.md 3 (standard): fp32, transposed when r > c, Frobenius normalized.
torch::Tensor NewtonSchulz(torch::Tensor x, const common::MuonConfig& muon) {
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  const bool tall = x.size(0) > x.size(1);
  if (tall) x = x.t();
  x = x / (x.norm() + 1e-7);
  for (int i = 0; i < muon.ns_steps; ++i) {
    torch::Tensor gram = torch::mm(x, x.t());
    torch::Tensor poly = torch::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    x = torch::addmm(x, poly, x, /*beta=*/a, /*alpha=*/1.0);
  }
  return tall ? x.t() : x;
}

}  // namespace

Measured InProcess(const common::JobSpec& spec, const torch::Tensor& params0,
                   const torch::Tensor& grads, int64_t warmup, int64_t steps) {
  torch::NoGradGuard no_grad;
  Measured out;
  out.params = params0.clone();
  std::vector<torch::Tensor> model, grad, master, grad32, momentum;
  std::vector<torch::Tensor> adam_params;
  int64_t at = 0;
  for (const common::MatrixSpec& m : spec.matrices) {
    const int64_t n = m.numel();
    model.push_back(out.params.narrow(0, at, n).view(m.shape));
    grad.push_back(grads.narrow(0, at, n).view(m.shape));
    master.push_back(model.back().to(torch::kFloat32));
    grad32.push_back(torch::zeros_like(master.back()));
    if (m.optimizer == common::Optimizer::kMuon) {
      momentum.push_back(torch::zeros_like(master.back()));
    } else {
      momentum.emplace_back();
      master.back().set_requires_grad(true);
      master.back().mutable_grad() = grad32.back();
      adam_params.push_back(master.back());
    }
    at += n;
  }
  torch::optim::AdamW adamw(
      adam_params,
      torch::optim::AdamWOptions(kAdamLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kAdamWd));
  const common::MuonConfig& muon = spec.muon;
  out.parts.assign(kNumParts, {});
  double cpu0 = CpuSeconds(getpid());
  for (int64_t s = 0; s < warmup + steps; ++s) {
    double part[kNumParts] = {};
    auto lap = [&part](int p, Clock::time_point* t) {
      const Clock::time_point now = Clock::now();
      part[p] += std::chrono::duration<double>(now - *t).count();
      *t = now;
    };
    const auto t0 = Clock::now();
    Clock::time_point t = t0;
    for (size_t i = 0; i < spec.matrices.size(); ++i) grad32[i].copy_(grad[i]);
    lap(0, &t);
    adamw.step();
    lap(1, &t);
    for (size_t i = 0; i < spec.matrices.size(); ++i) {
      const common::MatrixSpec& m = spec.matrices[i];
      if (m.optimizer != common::Optimizer::kMuon) continue;
      momentum[i].lerp_(grad32[i], 1 - muon.momentum);
      torch::Tensor u = muon.nesterov ? grad32[i].lerp_(momentum[i], muon.momentum) : momentum[i];
      lap(2, &t);
      u = NewtonSchulz(u, muon);
      lap(3, &t);
      const double scale = std::sqrt(std::max(1.0, static_cast<double>(m.shape[0]) / m.shape[1]));
      master[i].mul_(1 - kMuonLr * kMuonWd).add_(u, -kMuonLr * scale);
      lap(4, &t);
    }
    for (size_t i = 0; i < spec.matrices.size(); ++i) model[i].copy_(master[i]);
    lap(5, &t);
    if (s + 1 == warmup) cpu0 = CpuSeconds(getpid());
    if (s < warmup) continue;
    out.seconds.push_back(Since(t0));
    for (int p = 0; p < kNumParts; ++p) out.parts[p].push_back(part[p]);
  }
  out.cpu_seconds = CpuSeconds(getpid()) - cpu0;
  for (size_t i = 0; i < master.size(); ++i) {
    out.trainer_state_bytes += master[i].nbytes();
    if (momentum[i].defined()) out.trainer_state_bytes += momentum[i].nbytes();
  }
  for (const auto& kv : adamw.state()) {
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(*kv.second);
    out.trainer_state_bytes += st.exp_avg().nbytes() + st.exp_avg_sq().nbytes();
  }
  return out;
}

std::optional<double> KernelSeconds(const common::JobSpec& spec, const torch::Tensor& grads,
                                    int64_t warmup, int64_t steps) {
  std::map<std::vector<int64_t>, std::vector<uint32_t>> groups;
  std::vector<int64_t> start;
  int64_t total = 0;
  for (uint32_t i = 0; i < spec.matrices.size(); ++i) {
    start.push_back(total);
    total += spec.matrices[i].numel();
    if (spec.matrices[i].optimizer == common::Optimizer::kMuon) {
      groups[spec.matrices[i].shape].push_back(i);
    }
  }
  std::vector<torch::Tensor> grad32(spec.matrices.size()), momentum(spec.matrices.size());
  std::vector<double> seconds;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    double step = 0;
    for (const auto& [shape, members] : groups) {
      std::vector<const common::MatrixSpec*> specs;
      std::vector<const float*> g;
      std::vector<float*> mom, upd;
      for (uint32_t i : members) {
        const int64_t n = spec.matrices[i].numel();
        grad32[i] = grads.narrow(0, start[i], n).to(torch::kFloat32);
        if (!momentum[i].defined()) momentum[i] = torch::zeros({n});
        specs.push_back(&spec.matrices[i]);
        g.push_back(grad32[i].data_ptr<float>());
        upd.push_back(grad32[i].data_ptr<float>());
        mom.push_back(momentum[i].data_ptr<float>());
      }
      const auto t0 = Clock::now();
      const absl::Status st = server::MuonUpdateSameShape(spec.muon, specs.size(), specs.data(),
                                                          g.data(), mom.data(), upd.data());
      step += Since(t0);
      if (!st.ok()) {
        std::fprintf(stderr, "muond-bench apply: %s\n", std::string(st.message()).c_str());
        return std::nullopt;
      }
    }
    if (s >= warmup) seconds.push_back(step);
  }
  return Median(seconds);
}

}  // namespace muond::bench::apply
