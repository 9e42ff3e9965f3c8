// A small apply-mode job (DESIGN.md 4b) for the client and muonctl tests, and a float64 reference
// of its steps written from the design's formulas (not from the daemon's code).
//
// Two AdamW tensors in two parameter groups: "w" [4, 8] in group "decay" (weight_decay 0.05) and
// "b" [6] in group "no_decay" (weight_decay 0); gradients float32, param dtypes chosen per job.
// eps is 0.5, so that the gradient divisor changes the AdamW step (with a tiny eps the first
// AdamW step is lr * sign(g), whatever the divisor). Initial weights are exact in bfloat16, so an
// upload rounded to bf16 (shared memory) and one in float32 (gRPC) give the same masters.
// Header-only; thread-compatible.
#ifndef MUOND_TESTS_INTEGRATION_APPLY_TEST_MODEL_H_
#define MUOND_TESTS_INTEGRATION_APPLY_TEST_MODEL_H_

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"

namespace muond::integration::apply_model {

inline constexpr int kTensors = 2;
inline const char* const kNames[kTensors] = {"w", "b"};
inline const std::vector<int64_t> kShapes[kTensors] = {{4, 8}, {6}};
inline const char* const kGroups[kTensors] = {"decay", "no_decay"};  // tensor m is in group m
inline constexpr double kDefaultLr[kTensors] = {0.01, 0.01};
inline constexpr double kDefaultWd[kTensors] = {0.05, 0.0};
inline constexpr double kBeta1 = 0.9;
inline constexpr double kBeta2 = 0.99;
inline constexpr double kEps = 0.5;

inline int64_t Numel(int m) { return m == 0 ? 32 : 6; }

// job.json of the model; `param_dtypes` of "w" and "b".
inline std::string JobJson(const std::string& id, int world, int stage, common::DType param_w,
                           common::DType param_b) {
  auto dt = [](common::DType d) { return std::string(common::DTypeName(d)); };
  return absl::StrCat(R"({"job_id": ")", id, R"(", "mode": "apply", "world_size": )", world,
                      R"(, "zero_stage": )", stage, R"(,
  "tensors": [
    {"name": "w", "shape": [4, 8], "dtype": "float32", "param_dtype": ")",
                      dt(param_w),
                      R"(", "optimizer": "adamw", "group": "decay"},
    {"name": "b", "shape": [6], "dtype": "float32", "param_dtype": ")",
                      dt(param_b),
                      R"(", "optimizer": "adamw", "group": "no_decay"}],
  "groups": [{"name": "decay", "lr": 0.01, "weight_decay": 0.05},
             {"name": "no_decay", "lr": 0.01, "weight_decay": 0}],
  "adamw": {"betas": [0.9, 0.99], "eps": 0.5}})");
}

// Initial weights of tensor m: multiples of 1/8 in [-0.375, 0.375] (exact in bf16 and fp16).
inline std::vector<float> Initial(int m) {
  std::vector<float> v(Numel(m));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = static_cast<float>((static_cast<int>(i * (m + 3)) % 7) - 3) * 0.125f;
  }
  return v;
}

// The gradient of tensor m at step t (float32; some zeros).
inline std::vector<float> Gradient(int m, int t) {
  std::vector<float> g(Numel(m));
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] = static_cast<float>((static_cast<int>(i * 7 + t * 3 + m * 5) % 11) - 5) * 0.3f;
  }
  return g;
}

// The hyperparameters of step t, per group; wd_given: whether the step names the weight decay
// (else the group's default applies).
struct Hyper {
  double lr[kTensors];
  double wd[kTensors];
  bool wd_given[kTensors];
  double divisor;
};
inline Hyper HyperOf(int t) {
  switch (t % 3) {
    case 0:
      return {{0.01, 0.02}, {0.1, kDefaultWd[1]}, {true, false}, 2.0};
    case 1:
      return {{0.005, 0.03}, {kDefaultWd[0], kDefaultWd[1]}, {false, false}, 1.0};
    default:
      return {{0.02, 0.001}, {0.0, 0.2}, {true, true}, 4.0};
  }
}

// What a trainer passes to RankSession::SetHyper for step t.
inline client::StepHyper ClientHyper(int t) {
  const Hyper h = HyperOf(t);
  client::StepHyper out;
  for (int g = 0; g < kTensors; ++g) {
    out.lr.emplace_back(kGroups[g], h.lr[g]);
    if (h.wd_given[g]) out.weight_decay.emplace_back(kGroups[g], h.wd[g]);
  }
  out.grad_divisor = h.divisor;
  return out;
}

// The muonctl flags of step t (--grad-divisor only where it is not 1).
inline std::vector<std::string> CtlHyperArgs(int t) {
  const Hyper h = HyperOf(t);
  std::vector<std::string> args;
  for (int g = 0; g < kTensors; ++g) {
    args.push_back("--lr");
    args.push_back(absl::StrCat(kGroups[g], "=", h.lr[g]));
    if (h.wd_given[g]) {
      args.push_back("--wd");
      args.push_back(absl::StrCat(kGroups[g], "=", h.wd[g]));
    }
  }
  if (h.divisor != 1) {
    args.push_back("--grad-divisor");
    args.push_back(absl::StrCat(h.divisor));
  }
  return args;
}

// The masters after each step, in float64: torch.optim.AdamW (decoupled decay, bias correction),
// the gradient divided by the divisor first. A tensor `absent` in a step is skipped as
// torch.optim.AdamW skips a parameter whose grad is None: no decay, no moment update, its step
// count unchanged.
class Reference {
 public:
  Reference() {
    for (int m = 0; m < kTensors; ++m) {
      const std::vector<float> w0 = Initial(m);
      w_[m].assign(w0.begin(), w0.end());
      m_[m].assign(w0.size(), 0.0);
      v_[m].assign(w0.size(), 0.0);
    }
  }
  void Step(int t, const std::vector<bool>& absent = {}) {
    const Hyper h = HyperOf(t);
    for (int m = 0; m < kTensors; ++m) {
      if (static_cast<size_t>(m) < absent.size() && absent[m]) continue;
      const int count = ++count_[m];
      const double c1 = 1 - std::pow(kBeta1, count);
      const double c2 = 1 - std::pow(kBeta2, count);
      const std::vector<float> grad = Gradient(m, t);
      for (size_t i = 0; i < grad.size(); ++i) {
        const double g = static_cast<double>(grad[i]) / h.divisor;
        w_[m][i] *= 1 - h.lr[m] * h.wd[m];
        m_[m][i] = kBeta1 * m_[m][i] + (1 - kBeta1) * g;
        v_[m][i] = kBeta2 * v_[m][i] + (1 - kBeta2) * g * g;
        w_[m][i] -= h.lr[m] * (m_[m][i] / c1) / (std::sqrt(v_[m][i] / c2) + kEps);
      }
    }
  }
  const std::vector<double>& master(int m) const { return w_[m]; }

 private:
  std::vector<double> w_[kTensors], m_[kTensors], v_[kTensors];
  int count_[kTensors] = {};
};

// Success when the parameters `got` (widened from `dtype`) of elements [offset, offset +
// got.size()) of a tensor match the reference masters `want`: fp32 within 2e-6 (the daemon's fp32
// arithmetic), bf16/fp16 within one unit in the last place of the dtype (the masters are fp32,
// then rounded to nearest even).
inline ::testing::AssertionResult ParamsNear(const std::vector<float>& got,
                                             const std::vector<double>& want, common::DType dtype,
                                             uint64_t offset = 0) {
  const double rel = dtype == common::DType::kFloat32    ? 0
                     : dtype == common::DType::kBFloat16 ? 1.0 / 128
                                                         : 1.0 / 1024;
  for (size_t i = 0; i < got.size(); ++i) {
    if (offset + i >= want.size()) {
      return ::testing::AssertionFailure() << "element " << offset + i << " beyond the tensor";
    }
    const double w = want[offset + i];
    if (!(std::fabs(got[i] - w) <= 2e-6 + rel * std::fabs(w))) {
      return ::testing::AssertionFailure()
             << "element " << offset + i << ": got " << got[i] << ", want " << w << " ("
             << common::DTypeName(dtype) << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace muond::integration::apply_model

#endif  // MUOND_TESTS_INTEGRATION_APPLY_TEST_MODEL_H_
