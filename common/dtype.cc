// Host-side dtype conversions. Written on the bit patterns rather than with compiler half-float
// types, so the rounding (nearest even), NaN and subnormal behaviour is the same on every compiler
// and CPU, and matches PyTorch's CPU kernels bit for bit.
#include "common/dtype.h"

#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/float_bits.h"

namespace muond::common {
namespace {

inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return BitsFloat(sign | 0x7F800000u | (mant << 13));  // inf / NaN (payload kept)
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsFloat(sign | FloatBits(magnitude));
  }
  return BitsFloat(sign | ((exp + (127 - 15)) << 23) | (mant << 13));
}

inline uint16_t FloatToFp16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) {
    return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));  // quiet NaN
  }
  if (abs >= 0x38800000u) {  // >= 2^-14: a normal half, or overflow
    const uint32_t rebased = abs - ((127u - 15u) << 23);
    const uint32_t rounded = (rebased + 0xFFFu + ((rebased >> 13) & 1u)) >> 13;
    return static_cast<uint16_t>(sign | (rounded >= 0x7C00u ? 0x7C00u : rounded));
  }
  // Subnormal half (or zero): value = mant24 * 2^(exp-150) = (mant24 >> shift) units of 2^-24.
  const uint32_t exp = abs >> 23;
  if (exp < 101) return sign;  // below 2^-25: rounds to (signed) zero
  const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - exp;  // 14..25
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal: correct
  return static_cast<uint16_t>(sign | q);
}

}  // namespace

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "float32" || name == "fp32") return DType::kFloat32;
  if (name == "bfloat16" || name == "bf16") return DType::kBFloat16;
  if (name == "float16" || name == "fp16") return DType::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", std::string(name),
                   "' (accepted: float32, bfloat16, float16, fp32, bf16, fp16)"));
}

std::string_view SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "F32";
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat16:
      return "F16";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseSafetensorsDType(std::string_view name) {
  if (name == "F32") return DType::kFloat32;
  if (name == "BF16") return DType::kBFloat16;
  if (name == "F16") return DType::kFloat16;
  return absl::InvalidArgumentError(absl::StrCat(
      "unsupported safetensors dtype '", std::string(name), "' (supported: F32, BF16, F16)"));
}

void ToFloat32(DType src_dtype, const void* src, size_t n, float* dst) {
  switch (src_dtype) {
    case DType::kFloat32:
      if (n > 0 && static_cast<const void*>(dst) != src) std::memmove(dst, src, n * sizeof(float));
      return;
    case DType::kBFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = Fp16ToFloat(s[i]);
      return;
    }
  }
}

void FromFloat32(const float* src, size_t n, DType dst_dtype, void* dst) {
  switch (dst_dtype) {
    case DType::kFloat32:
      if (n > 0 && static_cast<const void*>(src) != dst) std::memmove(dst, src, n * sizeof(float));
      return;
    case DType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToFp16(src[i]);
      return;
    }
  }
}

namespace {

// First element of `n` values of type Bits at `data` whose exponent field (`mask`) is all ones
// (inf or NaN), or -1. Scans in blocks with a branch-free count the compiler vectorizes; only a
// block that holds one is rescanned element by element to find the first index.
template <typename Bits>
int64_t FindAllOnesExponent(const void* data, size_t n, Bits mask) {
  constexpr size_t kBlock = 4096 / sizeof(Bits);
  const auto* bytes = static_cast<const unsigned char*>(data);
  auto at = [&](size_t i) {
    Bits u;
    std::memcpy(&u, bytes + i * sizeof(Bits), sizeof(Bits));
    return static_cast<Bits>(u & mask) == mask;
  };
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t end = start + kBlock < n ? start + kBlock : n;
    uint32_t hits = 0;
    for (size_t i = start; i < end; ++i) hits += at(i);
    if (hits == 0) continue;
    for (size_t i = start; i < end; ++i) {
      if (at(i)) return static_cast<int64_t>(i);
    }
  }
  return -1;
}

}  // namespace

int64_t FindNonFinite(const float* data, size_t n) {
  return FindAllOnesExponent<uint32_t>(data, n, 0x7F800000u);
}

int64_t FindNonFiniteRaw(DType dtype, const void* data, size_t n) {
  switch (dtype) {
    case DType::kFloat32:
      return FindNonFinite(static_cast<const float*>(data), n);
    case DType::kBFloat16:
      return FindAllOnesExponent<uint16_t>(data, n, 0x7F80);
    case DType::kFloat16:
      return FindAllOnesExponent<uint16_t>(data, n, 0x7C00);
  }
  return -1;
}

}  // namespace muond::common
