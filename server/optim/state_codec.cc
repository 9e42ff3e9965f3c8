// See state_codec.h.
#include "server/optim/state_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/parallel_for.h"

namespace muond::server {
namespace {

uint16_t ToBf16(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);  // stays a (quiet) NaN
  u += 0x7FFF + ((u >> 16) & 1);  // nearest even
  return static_cast<uint16_t>(u >> 16);
}

float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float x = 0;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// One block of signed linear int8.
void EncodeLinearBlock(const float* x, size_t n, int8_t* q, float* scale) {
  float absmax = 0;
  for (size_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float s = LinearScale(absmax);
  *scale = s;
  if (s == 0) {  // zeros (or an absmax so small that its scale underflows): codes 0
    std::fill(q, q + n, int8_t{0});
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    // The default rounding mode: ties to even. A NaN (an infinite input) becomes 0, never UB.
    const float r = std::nearbyint(x[i] / s);
    q[i] = static_cast<int8_t>(r >= 127.0f ? 127.0f : r <= -127.0f ? -127.0f : r == r ? r : 0.0f);
  }
}

void DecodeLinearBlock(const int8_t* q, float scale, size_t n, float* x) {
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(q[i]) * scale;
}

constexpr float kLogSteps = 16.0f;  // codes per octave

void EncodeLogBlock(const float* x, size_t n, uint8_t* q, float* scale) {
  float top = 0;
  for (size_t i = 0; i < n; ++i) top = std::max(top, x[i]);
  *scale = top;
  for (size_t i = 0; i < n; ++i) {
    if (!(x[i] > 0) || top == 0) {
      q[i] = 0;
      continue;
    }
    const float k = std::nearbyint(255.0f + kLogSteps * std::log2(x[i] / top));
    q[i] = static_cast<uint8_t>(k >= 255.0f ? 255.0f : k >= 1.0f ? k : 1.0f);  // NaN: 1
  }
}

// The value of code k of a block of scale 1: exp2((k - 255) / 16), code 0 is 0.
const float* LogTable() {
  static const auto* table = [] {
    auto* t = new float[256];
    t[0] = 0.0f;
    for (int k = 1; k < 256; ++k) t[k] = std::exp2((static_cast<float>(k) - 255.0f) / kLogSteps);
    return t;
  }();
  return table;
}

void DecodeLogBlock(const uint8_t* q, float scale, size_t n, float* x) {
  const float* table = LogTable();
  for (size_t i = 0; i < n; ++i) x[i] = scale * table[q[i]];
}

// f(block, first element, length) for each block of kStateBlock elements of n, in order.
template <typename F>
void ForBlocks(size_t n, F f) {
  for (size_t b = 0, i = 0; i < n; ++b, i += kStateBlock) f(b, i, std::min(kStateBlock, n - i));
}

}  // namespace

float LinearScale(float absmax) {
  float s = absmax / 127.0f;
  if (!std::isfinite(s) || s == 0) return s;
  // The fewest ulps up that make the scale come back from the decoded block's largest value.
  for (int i = 0; i < 8 && (s * 127.0f) / 127.0f != s; ++i) {
    s = std::nextafter(s, std::numeric_limits<float>::infinity());
  }
  return s;
}

void EncodeBf16(const float* x, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; ++i) out[i] = ToBf16(x[i]);
}

void DecodeBf16(const uint16_t* in, size_t n, float* x) {
  for (size_t i = 0; i < n; ++i) x[i] = FromBf16(in[i]);
}

void EncodeLinearInt8(const float* x, size_t n, int8_t* q, float* scales) {
  ForBlocks(n, [&](size_t b, size_t i, size_t len) {
    EncodeLinearBlock(x + i, len, q + i, scales + b);
  });
}

void DecodeLinearInt8(const int8_t* q, const float* scales, size_t n, float* x) {
  ForBlocks(n, [&](size_t b, size_t i, size_t len) {
    DecodeLinearBlock(q + i, scales[b], len, x + i);
  });
}

void EncodeLogInt8(const float* x, size_t n, uint8_t* q, float* scales) {
  ForBlocks(n, [&](size_t b, size_t i, size_t len) {
    EncodeLogBlock(x + i, len, q + i, scales + b);
  });
}

void DecodeLogInt8(const uint8_t* q, const float* scales, size_t n, float* x) {
  ForBlocks(n, [&](size_t b, size_t i, size_t len) {
    DecodeLogBlock(q + i, scales[b], len, x + i);
  });
}

void DecodeStored(StateDType dtype, StateRole role, const float* stored, size_t n, size_t begin,
                  size_t len, float* x) {
  switch (dtype) {
    case StateDType::kFloat32:
      std::memcpy(x, stored + begin, len * sizeof(float));
      return;
    case StateDType::kBFloat16:
      DecodeBf16(reinterpret_cast<const uint16_t*>(stored) + begin, len, x);
      return;
    case StateDType::kInt8: {
      const float* scales = stored + begin / kStateBlock;
      const char* codes = reinterpret_cast<const char*>(stored + StateBlocks(n)) + begin;
      if (role == StateRole::kSigned) {
        DecodeLinearInt8(reinterpret_cast<const int8_t*>(codes), scales, len, x);
      } else {
        DecodeLogInt8(reinterpret_cast<const uint8_t*>(codes), scales, len, x);
      }
      return;
    }
  }
}

void EncodeStored(StateDType dtype, StateRole role, const float* x, size_t n, size_t begin,
                  size_t len, float* stored) {
  switch (dtype) {
    case StateDType::kFloat32:
      std::memcpy(stored + begin, x, len * sizeof(float));
      return;
    case StateDType::kBFloat16:
      EncodeBf16(x, len, reinterpret_cast<uint16_t*>(stored) + begin);
      return;
    case StateDType::kInt8: {
      float* scales = stored + begin / kStateBlock;
      char* codes = reinterpret_cast<char*>(stored + StateBlocks(n)) + begin;
      if (role == StateRole::kSigned) {
        EncodeLinearInt8(x, len, reinterpret_cast<int8_t*>(codes), scales);
      } else {
        EncodeLogInt8(x, len, reinterpret_cast<uint8_t*>(codes), scales);
      }
      return;
    }
  }
}

namespace {
// Pieces of whole blocks for the CPUs.
constexpr size_t kPiece = kStateBlock * 64;
}  // namespace

void DecodeStoredAll(StateDType dtype, StateRole role, const float* stored, size_t n, float* x) {
  common::ParallelFor((n + kPiece - 1) / kPiece, n * sizeof(float), [&](size_t p) {
    const size_t begin = p * kPiece;
    DecodeStored(dtype, role, stored, n, begin, std::min(kPiece, n - begin), x + begin);
  });
}

void EncodeStoredAll(StateDType dtype, StateRole role, const float* x, size_t n, float* stored) {
  common::ParallelFor((n + kPiece - 1) / kPiece, n * sizeof(float), [&](size_t p) {
    const size_t begin = p * kPiece;
    EncodeStored(dtype, role, x + begin, n, begin, std::min(kPiece, n - begin), stored);
  });
}

}  // namespace muond::server
