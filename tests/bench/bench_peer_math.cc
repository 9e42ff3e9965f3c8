// `muond-bench peer`'s math outside the daemon: the gradients, the peer's update and the float64
// reference (see bench_peer.cc's top comment).
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/job_spec.h"
#include "tests/bench/bench_peer.h"

namespace muond::bench::peer {
namespace {

// ---- The peer: the usual in-process Muon update, plain LibTorch ops.

at::Tensor PeerNewtonSchulz(const at::Tensor& g, at::ScalarType compute) {
  at::Tensor x = g.to(compute);
  const bool tall = g.size(0) > g.size(1);
  if (tall) x = x.mT();
  x = x / (x.norm() + 1e-7);
  for (int i = 0; i < kNsSteps; ++i) {
    const at::Tensor a = at::matmul(x, x.mT());
    const at::Tensor b = kB * a + kC * at::matmul(a, a);
    x = kA * x + at::matmul(b, x);
  }
  return tall ? x.mT() : x;
}

// One matrix's update in the gradient's dtype; `momentum` (fp32) is updated.
at::Tensor PeerUpdate(const at::Tensor& grad, at::Tensor& momentum, double beta,
                      at::ScalarType compute) {
  // fp32 gradients: an out-of-place lerp instead of DeepSpeed's grad.lerp_ so the gradient stays
  // the same for every step (the same one allocation the bf16 cast does).
  at::Tensor g = grad.to(at::kFloat);
  momentum.lerp_(g, 1.0 - beta);
  const at::Tensor u =
      grad.scalar_type() == at::kFloat ? at::lerp(g, momentum, beta) : g.lerp_(momentum, beta);
  at::Tensor x = PeerNewtonSchulz(u, compute);
  x.mul_(std::sqrt(std::max(1.0, static_cast<double>(grad.size(0)) / grad.size(1))));
  return x.to(grad.scalar_type());
}

// ---- The float64 reference (DESIGN.md 3).

at::Tensor ReferenceNewtonSchulz(at::Tensor x) {
  const bool tall = x.size(0) > x.size(1);
  if (tall) x = x.t();
  x = x / (x.norm().item<double>() + 1e-7);
  for (int i = 0; i < kNsSteps; ++i) {
    const at::Tensor a = at::matmul(x, x.t());
    const at::Tensor b = kB * a + kC * at::matmul(a, a);
    x = kA * x + at::matmul(b, x);
  }
  return tall ? x.t() : x;
}

}  // namespace

at::ScalarType ScalarTypeOf(common::DType dtype) {
  if (dtype == common::DType::kBFloat16) return at::kBFloat16;
  return dtype == common::DType::kFloat16 ? at::kHalf : at::kFloat;
}

// `total` normal random values (fixed seed) rounded to bf16: exact in both gradient dtypes.
std::vector<float> Bf16Normals(uint64_t total) {
  std::vector<float> normals(total);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : normals) v = normal(rng);
  std::vector<uint16_t> bf16(total);
  common::FromFloat32(normals.data(), total, common::DType::kBFloat16, bf16.data());
  common::ToFloat32(common::DType::kBFloat16, bf16.data(), total, normals.data());
  return normals;
}

Gradients MakeGradients(const std::vector<float>& normals,
                        const std::vector<common::MatrixSpec>& matrices, common::DType dtype) {
  Gradients g;
  g.dtype = dtype;
  const size_t esize = common::DTypeSize(dtype);
  g.flat.assign(normals.size() * esize, '\0');
  common::FromFloat32(normals.data(), normals.size(), dtype, g.flat.data());
  size_t offset = 0;
  for (const common::MatrixSpec& m : matrices) {
    g.tensors.push_back(
        at::from_blob(g.flat.data() + offset * esize, m.shape, ScalarTypeOf(dtype)).clone());
    offset += static_cast<size_t>(m.numel());
  }
  return g;
}

// One step of the peer over every matrix: the updates in the gradients' dtype; `momenta` (fp32,
// one per matrix) are updated.
std::vector<at::Tensor> PeerStep(const Gradients& grads, std::vector<at::Tensor>& momenta,
                                 double beta, common::DType compute) {
  std::vector<at::Tensor> updates;
  for (size_t i = 0; i < grads.tensors.size(); ++i) {
    updates.push_back(PeerUpdate(grads.tensors[i], momenta[i], beta, ScalarTypeOf(compute)));
  }
  return updates;
}

// The first step's update from zero momentum: the momentum input u by the fp32 lerps both sides
// compute, then NS and the scale in float64.
std::vector<at::Tensor> ReferenceUpdates(const Gradients& grads, double beta) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& grad : grads.tensors) {
    const at::Tensor g = grad.to(at::kFloat);
    const at::Tensor m = at::zeros_like(g).lerp_(g, 1.0 - beta);
    const at::Tensor u = at::lerp(g, m, beta).to(at::kDouble);
    const double scale = std::sqrt(std::max(1.0, static_cast<double>(g.size(0)) / g.size(1)));
    out.push_back(ReferenceNewtonSchulz(u) * scale);
  }
  return out;
}

// Worst relative Frobenius error over the matrices (NaN when any is NaN).
double WorstRelError(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& ref) {
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e =
        (got[i].to(at::kDouble) - ref[i]).norm().item<double>() / ref[i].norm().item<double>();
    if (std::isnan(e)) return e;
    worst = std::max(worst, e);
  }
  return worst;
}

}  // namespace muond::bench::peer
