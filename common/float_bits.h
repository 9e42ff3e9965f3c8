// Bit-level float helpers shared by the host conversions (common/dtype.cc) and the CPU
// Newton-Schulz passes (server/optim/ns_layout.cc), so both round to bf16 by the one rule: nearest
// even, NaN kept quiet, a carry out of the mantissa bumping the exponent (to inf past the bf16
// maximum), as PyTorch's CPU kernels do.
#ifndef MUOND_COMMON_FLOAT_BITS_H_
#define MUOND_COMMON_FLOAT_BITS_H_

#include <cstdint>
#include <cstring>

namespace muond::common {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    // NaN: keep sign and the top payload bits, force the quiet bit so truncation can't make inf.
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

}  // namespace muond::common

#endif  // MUOND_COMMON_FLOAT_BITS_H_
