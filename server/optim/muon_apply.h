// Apply mode's host side of a Muon tensor (DESIGN.md 4b), after the device computed U:
//   W <- W * (1 - lr*wd) - lr * U
// in float32, each operation rounded on its own (no FMA contraction), with the factors computed in
// double and rounded to float once, as torch's `W.mul_(1 - lr*wd); W.add_(U, alpha=-lr)` passes
// them; the new W is also written in the trainer's parameter dtype (round to nearest even).
// Thread-safe: a pure function over memory the caller owns.
#ifndef MUOND_SERVER_OPTIM_MUON_APPLY_H_
#define MUOND_SERVER_OPTIM_MUON_APPLY_H_

#include <cstddef>

#include "common/dtype.h"

namespace muond::server {

struct MuonApplyArrays {
  const float* param_in = nullptr;  // the committed W
  const float* update = nullptr;    // U, scaled (DESIGN.md 3 step 4)
  float* param_out = nullptr;       // the new W (may equal param_in)
  void* out = nullptr;              // optional: the new W in out_dtype
  common::DType out_dtype = common::DType::kFloat32;
};

// n elements with learning rate `lr` and weight decay `weight_decay`.
void MuonApply(double lr, double weight_decay, const MuonApplyArrays& a, size_t n);

}  // namespace muond::server

#endif  // MUOND_SERVER_OPTIM_MUON_APPLY_H_
