#include "server/optim/muon_apply.h"

#include <algorithm>

namespace muond::server {

void MuonApply(double lr, double weight_decay, const MuonApplyArrays& a, size_t n) {
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  const float neg_lr = static_cast<float>(-lr);
  // Blocks that stay in L1, each converted to the output dtype right after it is computed.
  constexpr size_t kBlock = 2048;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = std::min(n, b + kBlock);
    for (size_t i = b; i < e; ++i) {
      const float w = a.param_in[i] * decay;  // compiled with -ffp-contract=off: two roundings
      a.param_out[i] = w + neg_lr * a.update[i];
    }
    if (a.out != nullptr) {
      char* out = static_cast<char*>(a.out) + b * common::DTypeSize(a.out_dtype);
      common::FromFloat32(a.param_out + b, e - b, a.out_dtype, out);
    }
  }
}

}  // namespace muond::server
