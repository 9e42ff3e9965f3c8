// `muond-bench apply` (bench_apply.cc): the in-process baseline it measures against, and muond's
// own Muon kernel timed alone (bench_apply_inprocess.cc).
#ifndef MUOND_TESTS_BENCH_BENCH_APPLY_H_
#define MUOND_TESTS_BENCH_BENCH_APPLY_H_

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "common/job_spec.h"

namespace muond::bench::apply {

// The job's hyperparameters, the same for the daemon and the in-process baseline.
constexpr double kMuonLr = 0.02, kMuonWd = 0.01, kAdamLr = 3e-4, kAdamWd = 0.1;
constexpr double kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8;
// The in-process step's parts: grads to fp32, torch AdamW, Muon momentum and nesterov,
// Newton-Schulz, Muon scale and apply to the masters, masters to bf16.
constexpr const char* kParts[] = {"grad_to_fp32",  "adamw",      "muon_momentum",
                                  "newton_schulz", "muon_apply", "to_bf16"};
constexpr int kNumParts = 6;

// What one configuration measured.
struct Measured {
  std::vector<double> seconds;  // per timed step
  // In-process only: the step's parts, seconds per timed step (kParts order).
  std::vector<std::vector<double>> parts;
  uint64_t trainer_state_bytes = 0;
  double cpu_seconds = 0;  // user + system CPU of the process doing the math, timed steps
  torch::Tensor params;    // the flat bf16 model after every step
};

// The in-process baseline: the trainer's own fp32 masters, torch::optim::AdamW and the Muon update
// in LibTorch ops on `spec` from the flat bf16 `params0`, the flat bf16 `grads` every step;
// `steps` timed after `warmup`.
Measured InProcess(const common::JobSpec& spec, const torch::Tensor& params0,
                   const torch::Tensor& grads, int64_t warmup, int64_t steps);

// Seconds per step (median of `steps` after `warmup`) of muond's own Muon kernel on every Muon
// tensor of `spec`, same-shape tensors in one MuonUpdateSameShape call (as the CPU device batches
// them), fp32 gradients from `grads`. Prints the error and returns nullopt on failure.
std::optional<double> KernelSeconds(const common::JobSpec& spec, const torch::Tensor& grads,
                                    int64_t warmup, int64_t steps);

}  // namespace muond::bench::apply

#endif  // MUOND_TESTS_BENCH_BENCH_APPLY_H_
