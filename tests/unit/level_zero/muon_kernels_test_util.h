// Host-side storage conversions for the kernel tests: fp32 <-> bf16 / fp16 bit patterns with
// round-to-nearest-even (what the kernels' stores do), and random inputs.
#ifndef MUOND_TESTS_UNIT_LEVEL_ZERO_MUON_KERNELS_TEST_UTIL_H_
#define MUOND_TESTS_UNIT_LEVEL_ZERO_MUON_KERNELS_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"

namespace muond::server::device::level_zero::testutil {

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t ToBfloat16(float f) {
  uint32_t u = Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float FromBfloat16(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

inline uint16_t ToHalf(float f) {
  const uint32_t x = Bits(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity (65520 and up)
  if (ax < 0x38800000u) {                        // below 2^-14: subnormal (or zero)
    return sign | static_cast<uint16_t>(std::nearbyint(std::abs(f) * 0x1p24f));
  }
  uint32_t h = (((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u) != 0)) ++h;
  return sign | static_cast<uint16_t>(h);
}
inline float FromHalf(uint16_t h) {
  const bool negative = (h & 0x8000u) != 0;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant != 0 ? std::nanf("") : INFINITY;
  } else {
    v = std::ldexp(1.0f + static_cast<float>(mant) / 1024.0f, exp - 15);
  }
  return negative ? -v : v;
}

inline std::vector<uint8_t> Encode(const std::vector<float>& v, common::DType dtype) {
  if (dtype == common::DType::kFloat32) {
    std::vector<uint8_t> out(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  std::vector<uint8_t> out(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = dtype == common::DType::kBFloat16 ? ToBfloat16(v[i]) : ToHalf(v[i]);
    std::memcpy(&out[2 * i], &h, 2);
  }
  return out;
}

inline std::vector<float> Decode(const std::vector<uint8_t>& bytes, common::DType dtype) {
  if (dtype == common::DType::kFloat32) {
    std::vector<float> out(bytes.size() / 4);
    std::memcpy(out.data(), bytes.data(), out.size() * 4);
    return out;
  }
  std::vector<float> out(bytes.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, &bytes[2 * i], 2);
    out[i] = dtype == common::DType::kBFloat16 ? FromBfloat16(h) : FromHalf(h);
  }
  return out;
}

// The values as `dtype` stores them.
inline std::vector<float> Round(const std::vector<float>& v, common::DType dtype) {
  return Decode(Encode(v, dtype), dtype);
}

inline std::vector<float> RandomValues(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace muond::server::device::level_zero::testutil

#endif  // MUOND_TESTS_UNIT_LEVEL_ZERO_MUON_KERNELS_TEST_UTIL_H_
