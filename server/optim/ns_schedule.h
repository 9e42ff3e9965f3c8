// The Newton-Schulz schedule of DESIGN.md 3, shared by every backend (host LibTorch, CUDA, Level
// Zero): the per-iteration coefficients, the Polar Express safety factor, the gram restart
// (newton_schulz.cc explains the precision plan, muon.fp32_iterations). Header-only, free of
// LibTorch and device headers.
#ifndef MUOND_SERVER_OPTIM_NS_SCHEDULE_H_
#define MUOND_SERVER_OPTIM_NS_SCHEDULE_H_

#include <cstdint>

#include "common/job_spec.h"

namespace muond::server::ns {

struct Coefficients {
  double a;
  double b;
  double c;
};

inline constexpr Coefficients kStandard{3.4445, -4.7750, 2.0315};
// Polar Express (arXiv 2505.16932), one triple per iteration; kPolarExpressTail after these.
inline constexpr Coefficients kPolarExpress[] = {
    {8.28721201814563, -23.595886519098837, 17.300387312530933},
    {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
    {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
    {3.3184196573706015, -2.488488024314874, 0.51004894012372},
    {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
    {1.891301407787398, -1.2679958271945868, 0.37680408948524835},
    {1.8750014808534479, -1.2500016453999487, 0.3750001645474248},
};
inline constexpr int kPolarExpressListed = sizeof(kPolarExpress) / sizeof(kPolarExpress[0]);
inline constexpr Coefficients kPolarExpressTail{1.875, -1.25, 0.375};
// Polar Express safety factor: the norm is inflated by it, and every iteration but the last one
// divides (a, b, c) by (f, f^3, f^5).
inline constexpr double kPolarExpressSafety = 1.01;
inline constexpr double kNormEpsilon = 1e-7;
// The gram method recomputes X and R from the accumulated factor after this many iterations
// (once): the first iterations see the badly conditioned R of the raw input, and restarting there
// bounds the error that the r x r products accumulate.
inline constexpr int kGramRestartAfter = 2;
// The norm X / (||X|| * k + eps) is taken with k = NormFactor(method).
inline constexpr double NormFactor(common::NsMethod method) {
  return method == common::NsMethod::kPolarExpress ? kPolarExpressSafety : 1.0;
}

// (a, b, c) of iteration i (0-based) of `steps`.
inline constexpr Coefficients IterationCoefficients(common::NsMethod method, int i, int steps) {
  if (method != common::NsMethod::kPolarExpress) return kStandard;
  Coefficients k = i < kPolarExpressListed ? kPolarExpress[i] : kPolarExpressTail;
  if (i != steps - 1) {
    const double f = kPolarExpressSafety;
    k.a /= f;
    k.b /= f * f * f;
    k.c /= f * f * f * f * f;
  }
  return k;
}

}  // namespace muond::server::ns

#endif  // MUOND_SERVER_OPTIM_NS_SCHEDULE_H_
