// `muond-bench peer` (bench_peer.cc): the gradients, the peer (the usual in-process Muon update in
// plain LibTorch ops) and the float64 reference its errors are measured against
// (bench_peer_math.cc).
#ifndef MUOND_TESTS_BENCH_BENCH_PEER_H_
#define MUOND_TESTS_BENCH_BENCH_PEER_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/job_spec.h"

namespace muond::bench::peer {

// DESIGN.md 3's standard Newton-Schulz: the coefficients and the step count.
constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;
constexpr int kNsSteps = 5;

// The ATen scalar type of `dtype` (bf16, fp16, else fp32).
at::ScalarType ScalarTypeOf(common::DType dtype);

// The gradients in one dtype: the matrices' elements back to back (muond's flat buffer) and one
// [r, c] tensor per matrix (the peer's; its own memory).
struct Gradients {
  common::DType dtype = common::DType::kFloat32;
  std::string flat;
  std::vector<at::Tensor> tensors;
};

// `total` normal random values (fixed seed) rounded to bf16: exact in both gradient dtypes.
std::vector<float> Bf16Normals(uint64_t total);
// `normals` as `matrices`' gradients in `dtype`.
Gradients MakeGradients(const std::vector<float>& normals,
                        const std::vector<common::MatrixSpec>& matrices, common::DType dtype);

// One step of the peer over every matrix: the updates in the gradients' dtype; `momenta` (fp32,
// one per matrix) are updated.
std::vector<at::Tensor> PeerStep(const Gradients& grads, std::vector<at::Tensor>& momenta,
                                 double beta, common::DType compute);

// The first step's update from zero momentum: the momentum input u by the fp32 lerps both sides
// compute, then NS and the scale in float64.
std::vector<at::Tensor> ReferenceUpdates(const Gradients& grads, double beta);
// Worst relative Frobenius error over the matrices (NaN when any is NaN).
double WorstRelError(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& ref);

}  // namespace muond::bench::peer

#endif  // MUOND_TESTS_BENCH_BENCH_PEER_H_
