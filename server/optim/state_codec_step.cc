// Muon's momentum step on stored momentum (state_codec.h), block by block. Apart from the codec
// itself (state_codec.cc), which the checkpoint payload and its fuzz target link without the
// optimizer math.
#include <algorithm>

#include "server/optim/muon_math.h"
#include "server/optim/state_codec.h"

namespace muond::server {

void MomentumStepBf16(const common::MuonConfig& config, const float* grad, const uint16_t* in,
                      size_t n, float* momentum, uint16_t* out) {
  for (size_t i = 0; i < n; i += kStateBlock) {
    const size_t len = std::min<size_t>(kStateBlock, n - i);
    DecodeBf16(in + i, len, momentum + i);
    ApplyMomentum(config, grad + i, momentum + i, len);
    EncodeBf16(momentum + i, len, out + i);
  }
}

void MomentumStepInt8(const common::MuonConfig& config, const float* grad, const int8_t* q_in,
                      const float* scales_in, size_t n, float* momentum, int8_t* q_out,
                      float* scales_out) {
  for (size_t i = 0, b = 0; i < n; i += kStateBlock, ++b) {
    const size_t len = std::min<size_t>(kStateBlock, n - i);
    DecodeLinearInt8(q_in + i, scales_in + b, len, momentum + i);
    ApplyMomentum(config, grad + i, momentum + i, len);
    EncodeLinearInt8(momentum + i, len, q_out + i, scales_out + b);
  }
}

}  // namespace muond::server
